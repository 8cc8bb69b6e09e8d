"""How compfx times a training step: wall clock around a device-synchronised call.

CUDA kernels run asynchronously, so a timer read without
``torch.cuda.synchronize`` measures only the launch. Every timing here
synchronises the step's device before starting and before stopping the clock.
A batch of repeats reports the median: robust to the odd slow step
(allocator growth, a background process) that a mean would absorb.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

__all__ = ["synchronize", "timed", "Timing", "time_repeats"]

T = TypeVar("T")


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued kernels on ``device`` (a no-op on CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
    elif device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.synchronize(device)
    elif device.type == "mps" and torch.backends.mps.is_available():
        torch.mps.synchronize()


def timed(fn: Callable[[], T], device: torch.device | str | None) -> tuple[T, float]:
    """Run ``fn()`` once; return its result and the synchronised wall seconds it took.

    >>> result, seconds = timed(lambda: sum(range(10)), "cpu")
    >>> result, seconds >= 0
    (45, True)
    """
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one step, in seconds."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def time_repeats(step: Callable[[int], object], *, warmup: int, repeats: int,
                 device: torch.device | str | None) -> Timing:
    """Call ``step(i)`` ``warmup`` times untimed, then ``repeats`` times timed.

    Warm-up absorbs one-off costs (allocator growth, kernel selection, lazy
    optimizer state) that a steady training run does not pay.

    >>> time_repeats(lambda i: None, warmup=1, repeats=3, device="cpu").median >= 0
    True
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; expected at least 1 timed repeat")
    for i in range(warmup):
        step(i)
    samples = tuple(timed(lambda i=i: step(warmup + i), device)[1] for i in range(repeats))
    return Timing(samples)
