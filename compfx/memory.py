"""Activation memory of a training step, measured: the bytes autograd saves for backward.

A plan changes memory mostly through what the forward pass keeps for the
backward pass: a low-precision op saves half-size inputs and outputs, and a
cast of a weight saves a low-precision copy of it. This module counts exactly
that, with :func:`torch.autograd.graph.saved_tensors_hooks`, on any device
(no CUDA allocator counters needed): the ``nbytes`` of every *unique* storage
saved during one forward pass, leaving out the module's own parameters and
buffers (they are resident whatever the plan).

``benchmarks/memory.py`` (``measure_saved_tensors``) measures the same thing
around a whole step; this is the library's version, which the per-device
allocator (:mod:`compfx.distributed`) uses to check a rank's memory budget.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

__all__ = ["SavedStorages", "saved_activation_bytes"]


class SavedStorages:
    """Unique storages autograd saved while recording, keyed by (device, address)."""

    def __init__(self, excluded: set[tuple[str, int]]):
        self.excluded = excluded
        self.nbytes: dict[tuple[str, int], int] = {}
        # Holding each storage stops its address from being reused by a later
        # tensor of the same forward pass, which would hide it from the count.
        self._alive: list = []

    def record(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses): nothing to count
            return
        key = _storage_key(tensor.device, storage)
        if key in self.excluded or key in self.nbytes:
            return
        self._alive.append(storage)
        self.nbytes[key] = storage.nbytes()

    @property
    def total(self) -> int:
        return sum(self.nbytes.values())


def _storage_key(device: torch.device, storage) -> tuple[str, int]:
    return str(device), storage.data_ptr()


def _resident_storages(module: nn.Module) -> set[tuple[str, int]]:
    return {_storage_key(t.device, t.untyped_storage()) for t in (*module.parameters(), *module.buffers())}


@contextmanager
def _state_kept(module: nn.Module) -> Iterator[None]:
    """Undo what a measuring forward changes: buffers (BatchNorm running stats) and the RNG (dropout)."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({b.device.index for b, _ in buffers if b.device.type == "cuda" and b.device.index is not None})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for live, saved in buffers:
                    live.copy_(saved)


def saved_activation_bytes(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> int:
    """Bytes of the unique storages one forward pass of ``module(*args, **kwargs)`` saves for backward.

    The module's parameters and buffers are not counted; its inputs, its
    activations and any low-precision copies of its weights are. The pass runs
    with gradients on, in the module's current train/eval mode; buffers and the
    RNG are put back afterwards, and no backward runs, so the module's state and
    gradients are unchanged.

    >>> import torch
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> x = torch.randn(32, 16)
    >>> full = saved_activation_bytes(mlp, (x,))
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     half = saved_activation_bytes(mlp, (x,))
    >>> full > 0 and half < full
    True
    """
    saved = SavedStorages(_resident_storages(module))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.record(tensor)
        return tensor

    with _state_kept(module), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = module(*args, **(kwargs or {}))
        del output  # frees the autograd graph: nothing is kept past the measurement
    return saved.total
