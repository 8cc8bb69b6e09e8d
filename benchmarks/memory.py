"""Memory a training step needs, measured, not estimated.

* On CPU (and on GPU too): the bytes autograd saves for backward in one step,
  recorded with :func:`torch.autograd.graph.saved_tensors_hooks` as the sum of
  ``nbytes`` of the unique storages saved. Storages that belong to the model's
  own parameters and buffers are counted separately, so what remains is
  activations (and low-precision copies of weights, which autocast saves).
* On GPU: ``torch.cuda.max_memory_allocated`` over the timed epochs.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
>>> with measure_saved_tensors(model.parameters()) as saved:
...     model(torch.randn(32, 64)).sum().backward()
>>> saved.activation_bytes > 0, saved.parameter_bytes > 0
(True, True)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

__all__ = ["SavedTensors", "measure_saved_tensors", "reset_peak_memory", "peak_memory_bytes", "synchronize"]


@dataclass
class SavedTensors:
    """Unique storages saved for backward while the measurement was active."""

    parameter_pointers: frozenset = frozenset()
    storages: dict = field(default_factory=dict)  # (device, data_ptr) -> (nbytes, is_parameter)
    _keep_alive: list = field(default_factory=list, repr=False)

    def record(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse) are skipped
            return
        # Holding the storage keeps its address from being reused by a later tensor in the same step.
        self._keep_alive.append(storage)
        key = (str(tensor.device), storage.data_ptr())
        self.storages.setdefault(key, (storage.nbytes(), storage.data_ptr() in self.parameter_pointers))

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.storages.values())

    @property
    def parameter_bytes(self) -> int:
        return sum(nbytes for nbytes, is_parameter in self.storages.values() if is_parameter)

    @property
    def activation_bytes(self) -> int:
        return self.total_bytes - self.parameter_bytes


@contextmanager
def measure_saved_tensors(parameters: Iterable[torch.Tensor] = ()) -> Iterator[SavedTensors]:
    """Record every tensor autograd saves inside the block (forward passes of the step)."""
    pointers = frozenset(p.untyped_storage().data_ptr() for p in parameters)
    saved = SavedTensors(parameter_pointers=pointers)

    def pack(tensor):
        saved.record(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved
    saved._keep_alive.clear()


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes since the last reset on a GPU; None where there is no such counter."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
