"""Activation memory of a training step, measured: the bytes autograd saves for backward.

A plan changes memory mostly through what the forward pass keeps for the
backward pass: a low-precision op saves half-size inputs and outputs, and a
cast of a weight saves a low-precision copy of it. This module counts exactly
that, with :func:`torch.autograd.graph.saved_tensors_hooks`, on any device
(no CUDA allocator counters needed): the ``nbytes`` of every *unique* storage
saved during one forward pass, leaving out the module's own parameters and
buffers (they are resident whatever the plan).

The benchmarks (``benchmarks/harness.py``) record a whole training step with
:func:`saved_storages`; the per-device allocator (:mod:`compfx.search.allocation`)
checks a rank's memory budget with :func:`saved_activation_bytes`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.nn as nn

from .batches import model_devices
from .state import buffers_restored, torch_rng_preserved

__all__ = ["SavedStorages", "saved_storages", "saved_activation_bytes"]


class SavedStorages:
    """Unique storages autograd saved while recording, keyed by (device, address).

    Storages of the ``resident`` tensors (a model's parameters and buffers,
    which stay in memory whatever the plan) are counted apart from the rest.
    """

    def __init__(self, resident: set[tuple[str, int]] = frozenset()):
        self.resident = resident
        self.nbytes: dict[tuple[str, int], int] = {}
        # Holding each storage stops its address from being reused by a later
        # tensor of the same step, which would hide it from the count.
        self._alive: list = []

    def record(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses): nothing to count
            return
        key = _storage_key(tensor.device, storage)
        if key not in self.nbytes:
            self._alive.append(storage)
            self.nbytes[key] = storage.nbytes()

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    @property
    def resident_bytes(self) -> int:
        return sum(n for key, n in self.nbytes.items() if key in self.resident)

    @property
    def activation_bytes(self) -> int:
        """Everything saved but the resident storages: inputs, activations, low-precision weight copies."""
        return self.total_bytes - self.resident_bytes


def _storage_key(device: torch.device, storage) -> tuple[str, int]:
    return str(device), storage.data_ptr()


@contextmanager
def saved_storages(resident: Iterable[torch.Tensor] = ()) -> Iterator[SavedStorages]:
    """Record every storage autograd saves for backward inside the block (its forward passes).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    >>> with saved_storages(model.parameters()) as saved:
    ...     model(torch.randn(32, 64)).sum().backward()
    >>> saved.activation_bytes > 0, saved.resident_bytes > 0
    (True, True)
    """
    saved = SavedStorages({_storage_key(t.device, t.untyped_storage()) for t in resident})

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.record(tensor)
        # detached: an output a node saves (ReLU's result) has that node as its grad_fn, so packing the tensor
        # itself would tie node and tensor in a cycle through C++ that Python's gc cannot see; a forward whose
        # backward never runs (saved_activation_bytes) would then keep its whole graph, activations and
        # low-precision weight copies included, for the rest of the process (saved_tensors_hooks' warning)
        return tensor.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield saved
    finally:
        saved._alive.clear()  # the count is taken: the storages go when their graph does, even if the block raised


@contextmanager
def _state_kept(module: nn.Module) -> Iterator[None]:
    """Undo what a measuring forward changes: buffers (BatchNorm running stats) and the RNG (dropout)."""
    # Parameters too: a CUDA model with dropout and no buffers still draws from the CUDA generator.
    with torch_rng_preserved(*model_devices(module)), buffers_restored(module):
        yield


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
    with _state_kept(module), torch.enable_grad():
        with saved_storages((*module.parameters(), *module.buffers())) as saved:
            output = module(*args, **(kwargs or {}))
        del output  # frees the autograd graph: nothing is kept past the measurement
    return saved.activation_bytes
