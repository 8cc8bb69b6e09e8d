"""What the training-loop callbacks share: take the loop's first batches, search (or load) a plan, run it in place.

A trainer (Hugging Face's, Lightning's) owns the loop and calls the model it was
given; a callback cannot hand it another module. So :class:`PlannedForward`
makes calls to that model run its :class:`~compfx.apply.PlannedModule`, which
shares the model's Parameters: the trainer's optimizer, gradient clipping,
checkpoints and ``save_pretrained`` see the model they know. ``remove()`` gives
the model its own ``forward`` back.

:func:`plan_model` is the one place a callback gets its planned module from: a
search (:func:`compfx.optimize`) on the first batches of the trainer's own
loader, or a saved plan (a resumed run), checked against the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn as nn

from ..analyze import analyze, model_device
from ..apply import PlannedModule
from ..errors import BadInputError
from ..optimize import optimize
from ..plan import Plan
from ..search.config import SearchConfig
from ..search.result import SearchResult
from ..search.sampling import check_first_batch, cuda_devices, move_batch
from ..vocabulary import Precision, dtype_name

__all__ = ["PLAN_FILE", "LOG_FILE", "PlannedForward", "PlannedRun", "first_batches", "plan_model"]

#: the chosen plan, in the trainer's output folder and in each of its checkpoints
PLAN_FILE = "compfx-plan.json"
#: the search log, in the trainer's output folder (``compfx report`` renders it)
LOG_FILE = "compfx-search.jsonl"


@contextlib.contextmanager
def _rng_untouched(device: torch.device):
    """Every generator a loader may draw from, as it was: torch (CPU and the device's), Python's, NumPy's."""
    python_state = random.getstate()
    try:
        import numpy
        numpy_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        numpy, numpy_state = None, None
    try:
        with torch.random.fork_rng(devices=cuda_devices(device)):
            yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _sampler_generators(loader) -> list[torch.Generator]:
    """Generators a DataLoader's samplers own (a seeded shuffle advances them as the loader is walked)."""
    found = []
    for holder in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                   getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def first_batches(loader: Iterable, count: int, device: torch.device) -> list:
    """The first ``count`` batches of ``loader`` on ``device``; the loop's RNG and data order stay as they were.

    A loader wrapped by a trainer (accelerate's ``DataLoaderShard``) is read
    through the DataLoader it wraps, so the trainer's own bookkeeping of its
    loader (accelerate's gradient state) is not touched by a partial walk.

    >>> import torch
    >>> loader = torch.utils.data.DataLoader(torch.arange(10.0), batch_size=4, shuffle=True)
    >>> state = torch.get_rng_state()
    >>> [b.shape for b in first_batches(loader, 2, torch.device("cpu"))], torch.equal(state, torch.get_rng_state())
    ([torch.Size([4]), torch.Size([4])], True)
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise BadInputError(f"search_batches={count!r}; expected a positive int (the number of the trainer's first "
                            "batches the search trains on, e.g. 8).")
    source = getattr(loader, "base_dataloader", loader)
    generators = _sampler_generators(source)
    states = [g.get_state() for g in generators]
    try:
        with _rng_untouched(device):
            batches = [move_batch(dict(b) if isinstance(b, dict) else b, device)
                       for b in itertools.islice(source, count)]
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)
    if not batches:
        raise BadInputError("the trainer's train dataloader yielded no batches; the search trains on its first "
                            "batches, so give the trainer a train_dataset with data.")
    return batches


class PlannedForward:
    """Calls to ``model`` run ``planned`` (a :class:`PlannedModule` of it) until :meth:`remove`.

    The model's ``forward`` is shadowed by an instance attribute (the class's is
    untouched, as are hooks, Parameters and ``state_dict``). While the planned
    module runs, the shadow is lifted, so a new input signature is captured from
    the model's own ``forward``. The planned module follows the model's
    train/eval mode, so a trainer's evaluation runs the plan in eval mode.

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> swap = PlannedForward(model, PlannedModule(model, compfx.Plan.uniform(a, "low"), analysis=a))
    >>> model(torch.randn(3, 4)).dtype, len(swap.planned.graphs)
    (torch.float32, 1)
    >>> swap.remove(); "forward" in vars(model)
    False
    """

    def __init__(self, model: nn.Module, planned: PlannedModule):
        if "forward" in vars(model):
            raise BadInputError(f"{type(model).__name__}.forward is already replaced on this object (another "
                                "CompfxCallback, or a wrapper); compfx runs one plan per model. Use one callback.")
        self.model, self.planned = model, planned

        @functools.wraps(type(model).forward)  # inspect.signature(model.forward) stays the model's
        def forward(*args, **kwargs):
            if planned.training != model.training:
                planned.train(model.training)
            del model.forward  # the model's own forward while the plan runs (and captures a new signature)
            try:
                return planned(*args, **kwargs)
            finally:
                model.forward = forward

        self._forward = forward
        model.forward = forward

    def remove(self) -> None:
        """The model's own ``forward`` again (idempotent)."""
        if vars(self.model).get("forward") is self._forward:
            del self.model.forward


@dataclass
class PlannedRun:
    """The planned module a callback trains with, its plan, and the search result (None: a saved plan was loaded)."""

    module: PlannedModule
    plan: Plan
    result: SearchResult | None
    source: str  # "searched", or where the plan was loaded from

    @property
    def searched(self) -> bool:
        return self.result is not None

    def summary(self) -> str:
        """One line for the trainer's log."""
        counts = {p: sum(v is p for v in self.plan.values()) for p in Precision}
        ops = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
        head = f"compfx: plan {self.plan.fingerprint} ({dtype_name(self.plan.low_dtype)}): {len(self.plan)} ops ({ops})"
        if self.result is None:
            return f"{head}; loaded from {self.source}, no search"
        steps = self.result.step_seconds
        speed = (f"; step {steps['fp32'] / steps['chosen']:.2f}x FP32's speed" if steps.get("fp32")
                 and steps.get("chosen") else "")
        return f"{head}; searched in {self.result.search_seconds:.1f} s{speed}"

    def metrics(self) -> dict[str, float]:
        """Numbers for a trainer's metric loggers."""
        numbers = {"compfx/ops_low": float(sum(v is Precision.LOW for v in self.plan.values())),
                   "compfx/ops": float(len(self.plan)), "compfx/searched": float(self.searched)}
        if self.result is not None:
            numbers["compfx/search_seconds"] = self.result.search_seconds
        return numbers


def plan_model(model: nn.Module, batches: list, *, optimizer: torch.optim.Optimizer, loss_fn=None,
               low_dtype: torch.dtype | None = None, config: SearchConfig | None = None, plan: Plan | None = None,
               log: str | os.PathLike | None = None, source: str = "searched") -> PlannedRun:
    """Search a plan for ``model`` on ``batches`` (or take ``plan``), and the :class:`PlannedModule` running it.

    The trainer owns the training, so the search's own training is undone
    (``keep_search_training=False``): the trainer's step count, learning-rate
    schedule and checkpoints describe the model, and a resumed run matches an
    uninterrupted one. A given ``plan`` is checked against the model
    (:class:`~compfx.errors.PlanMismatchError` when it was made for another).

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 3))
    >>> batches = [(torch.randn(4, 8), torch.randint(0, 3, (4,)))]
    >>> ce = lambda out, batch: torch.nn.functional.cross_entropy(out, batch[-1])
    >>> a = compfx.analyze(model, batches[0][0])
    >>> run = plan_model(model, batches, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=ce,
    ...                  plan=compfx.Plan.fp32(a), source="a test")
    >>> run.searched, run.summary().endswith("loaded from a test, no search")
    (False, True)
    """
    if plan is None:
        config = dataclasses.replace(config or SearchConfig(), keep_search_training=False)
        result = optimize(model, batches, optimizer=optimizer, loss_fn=loss_fn, low_dtype=low_dtype, config=config,
                          log=log)
        return PlannedRun(result.module, result.plan, result, "searched")
    args, kwargs = check_first_batch(model, batches[0], loss_fn, model_device(model))
    analysis = analyze(model, kwargs if kwargs else args, low_dtype=plan.low_dtype)
    return PlannedRun(PlannedModule(model, plan, analysis=analysis), plan, None, source)


def saved_plan(*candidates: str | os.PathLike) -> tuple[Plan, str] | None:
    """The first of ``candidates`` (plan files) that exists, loaded, and its path; None when none does."""
    for candidate in candidates:
        if candidate is not None and Path(candidate).is_file():
            return Plan.load(candidate), str(candidate)
    return None
