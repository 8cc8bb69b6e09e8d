"""The caller's random state, saved before compfx runs a model's forward and put back afterwards.

compfx runs the user's forward to capture it (:func:`compfx.analyze`), to
rewrite it (:func:`compfx.apply`) and to train samples (:func:`compfx.optimize`).
A forward may draw random numbers (dropout) or even reseed
(``torch.manual_seed`` inside ``forward``); neither may leak into the caller's
generators. :func:`rng_preserved` puts back every generator such a forward can
reach: torch's CPU generator, the CUDA generators of the devices in use, the
CUDA seeds torch queues while CUDA is not initialised yet (``torch.manual_seed``
queues one for every GPU, which ``torch.random.fork_rng`` cannot undo), and
Python's and NumPy's global generators, and the generators of a ``DataLoader``
given to it (:func:`loader_generators`: a seeded shuffle advances them as the
loader is walked).

>>> import torch
>>> torch.manual_seed(0); before = torch.get_rng_state()  # doctest: +ELLIPSIS
<torch._C.Generator ...>
>>> with rng_preserved():
...     _ = torch.manual_seed(123), torch.rand(3)
>>> torch.equal(before, torch.get_rng_state())
True
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterable, Iterator

import torch

__all__ = ["rng_preserved", "cuda_devices", "loader_generators", "outside_torch_states", "same_states"]


def cuda_devices(device: torch.device) -> list[int]:
    """The CUDA device whose RNG ``torch.random.fork_rng`` must protect for work on ``device`` ([] off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _cuda_indices(devices: Iterable) -> list[int]:
    """The CUDA device indices among ``devices`` (torch.device, str or int), plus the current one once CUDA runs."""
    if not torch.cuda.is_available():
        return []
    indices = {torch.cuda.current_device()} if torch.cuda.is_initialized() else set()
    for device in devices:
        device = torch.device(device)
        if device.type == "cuda":
            indices.add(device.index if device.index is not None else torch.cuda.current_device())
    return sorted(indices)


class _LazySeeds:
    """The seeds torch queued for CUDA devices before CUDA started (``torch.cuda._lazy_seed_tracker``)."""

    _FIELDS = ("manual_seed_all_cb", "manual_seed_cb", "call_order")

    def __init__(self):
        self.tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
        self.saved = None
        if self.tracker is not None and all(hasattr(self.tracker, f) for f in self._FIELDS):
            self.saved = {f: getattr(self.tracker, f) for f in self._FIELDS}
            self.saved["call_order"] = list(self.saved["call_order"])

    def restore(self) -> None:
        if self.saved is not None and not torch.cuda.is_initialized():  # once CUDA ran, the queue has been used
            for name, value in self.saved.items():
                setattr(self.tracker, name, value)


def loader_generators(loader) -> list[torch.Generator]:
    """The generators a DataLoader and its samplers own (``DataLoader(..., generator=g)``): a seeded shuffle draws
    its order from them, not from torch's global generator. [] for a loader that holds none (a list)."""
    found = []
    for holder in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                   getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


@contextlib.contextmanager
def rng_preserved(*devices, generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
    """Run the body; afterwards every random generator it could reach is as it was (see the module docstring).

    ``devices`` are the devices the body's work runs on (their CUDA generators
    are saved; the current CUDA device's always is, once CUDA runs);
    ``generators`` are other generators it may advance (:func:`loader_generators`).
    """
    own = [(generator, generator.get_state()) for generator in generators]
    outside = outside_torch_states()
    lazy = _LazySeeds()
    try:
        with torch.random.fork_rng(devices=_cuda_indices(devices)):
            yield
    finally:
        lazy.restore()
        for generator, state in own:
            generator.set_state(state)
        _set_outside_torch_states(outside)


def outside_torch_states() -> tuple:
    """Python's global generator state, and NumPy's where NumPy is installed: the generators no graph draws from.

    >>> import random
    >>> before = outside_torch_states(); _ = random.random()
    >>> same_states(before, outside_torch_states())
    False
    """
    states = [random.getstate()]
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return tuple(states)
    return (*states, numpy.random.get_state())


def _set_outside_torch_states(states: tuple) -> None:
    random.setstate(states[0])
    if len(states) > 1:
        import numpy

        numpy.random.set_state(states[1])


def same_states(first, second) -> bool:
    """Are two :func:`outside_torch_states` equal (NumPy's key is an array, compared element by element)?"""
    if isinstance(first, tuple) and isinstance(second, tuple):
        return len(first) == len(second) and all(same_states(a, b) for a, b in zip(first, second))
    if hasattr(first, "shape"):
        return first.shape == second.shape and bool((first == second).all())
    return first == second
