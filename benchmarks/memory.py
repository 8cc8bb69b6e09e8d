"""Memory a training step needs, measured, not estimated.

* On any device: the bytes autograd saves for backward in one step, recorded
  with :func:`compfx.memory.saved_storages` (saved-tensor hooks, unique
  storages). The model's own parameters and buffers are counted apart, so what
  remains is activations (and low-precision copies of weights, which autocast
  and compfx's casts save).
* On GPU: ``torch.cuda.max_memory_allocated`` around each timed step, and
  ``torch.cuda.memory_allocated`` (:func:`allocated_bytes`) to tell what one
  mode holds from what the other modes taking turns with it hold (below).

>>> import torch
>>> peak_memory_bytes(torch.device("cpu")) is None  # no allocator counter on CPU
True
"""

from __future__ import annotations

import torch

from compfx.memory import saved_storages

__all__ = ["saved_storages", "reset_peak_memory", "peak_memory_bytes", "allocated_bytes"]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes since the last reset on a GPU; None where there is no such counter."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def allocated_bytes(device: torch.device) -> int | None:
    """Bytes allocated now on a GPU; None where there is no such counter."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None
