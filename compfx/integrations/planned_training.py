"""What the training-loop callbacks share: take the loop's first batches, search (or load) a plan, run it in place.

A trainer (Hugging Face's, Lightning's) owns the loop and calls the model it was
given; a callback cannot hand it another module, and patches no method. So the
model is planned in place, region by region (:mod:`compfx.per_module`): each
outermost submodule its forward runs (:func:`planned_regions`; for a Hugging
Face model, its base model and head) is replaced in its parent by a
:class:`~compfx.per_module.PlannedBlock` that holds the same Parameters and
runs the plan. The model's class, ``forward``, Parameters and ``state_dict``
keys stay as they were, so the trainer's optimizer, gradient clipping,
checkpoints and ``save_pretrained`` see the model they know. What the model's
own forward computes outside the regions (a Hugging Face model's loss) runs
eagerly, as it was. :meth:`PlannedRun.restore` puts the original submodules
(the same objects) back.

:func:`plan_model` is the one place a callback gets its plan from: a search
(:func:`compfx.optimize` with ``per_module``) on the first batches of the
trainer's own loader, or a saved plan (a resumed run), checked against the
model.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn as nn

from ..planned_module import plan_blocks
from ..batches import check_first_batch, model_device, move_batch
from ..errors import BadInputError
from ..optimization import optimize
from ..per_module import PlannedBlock, restore_blocks
from ..plan import Plan
from ..regions import region_paths
from ..search.config import SearchConfig
from ..search.result import SearchResult
from ..state import loader_generators, rng_preserved
from ..vocabulary import Precision, dtype_name

__all__ = ["PLAN_FILE", "LOG_FILE", "PlannedRun", "first_batches", "planned_regions", "plan_model"]

#: the chosen plan, in the trainer's output folder and in each of its checkpoints
PLAN_FILE = "compfx-plan.json"
#: the search log, in the trainer's output folder (``compfx report`` renders it)
LOG_FILE = "compfx-search.jsonl"


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
    with rng_preserved(device, generators=loader_generators(source)):
        batches = [move_batch(dict(b) if isinstance(b, dict) else b, device) for b in itertools.islice(source, count)]
    if not batches:
        raise BadInputError("the trainer's train dataloader yielded no batches; the search trains on its first "
                            "batches, so give the trainer a train_dataset with data.")
    return batches


def planned_regions(model: nn.Module, batch, loss_fn=None, *, with_loss: bool = True) -> tuple[list[str], tuple[type, ...]]:
    """The regions a callback plans ``model`` by: the outermost submodules its forward runs on ``batch``, and
    their types (the ``per_module`` of :func:`compfx.optimize`, which finds exactly these regions).

    One forward runs (no grad; parameters, buffers and RNG put back), and ``loss_fn`` on its output unless
    ``with_loss`` is False. Submodules
    the forward does not run (a loss module or metric a training step calls,
    an unused head) are no region; containers (``nn.ModuleList``) are not run,
    so their entries are the regions. What the model's own forward computes
    outside them (a Hugging Face model's loss) runs eagerly, in FP32.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> planned_regions(model, (torch.randn(3, 8), torch.randn(3, 2)),
    ...                 lambda out, batch: torch.nn.functional.mse_loss(out, batch[-1]))
    (['0', '1', '2'], (<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.modules.activation.ReLU'>))
    """
    ran: set[str] = set()
    in_forward = [True]  # loss_fn may call submodules too (a criterion): those are no region

    def record(path: str) -> None:
        if in_forward[0]:
            ran.add(path)

    handles = [module.register_forward_pre_hook(lambda *_, path=path: record(path))
               for path, module in model.named_modules() if path]
    handles.append(model.register_forward_hook(lambda *_: in_forward.__setitem__(0, False)))
    try:
        check_first_batch(model, batch, loss_fn, model_device(model), with_loss=with_loss)
    finally:
        for handle in handles:
            handle.remove()
    order = {path: position for position, (path, _) in enumerate(model.named_modules())}
    regions = sorted((path for path in ran if not any(outer in ran for outer in _ancestors(path))),
                     key=order.__getitem__)  # registration order, as region_paths gives them
    if not regions:
        raise BadInputError(f"{type(model).__name__}'s forward runs no submodule; CompfxCallback plans a model by "
                            "its submodules (the ones its forward calls), so give it a model built of modules, or "
                            "use compfx.optimize directly.")
    types = tuple(dict.fromkeys(type(model.get_submodule(path)) for path in regions))
    found = [] if isinstance(model, types) else region_paths(model, types)
    if found != regions:
        other = next(iter(sorted(set(found) ^ set(regions))), "")
        raise BadInputError(
            f"CompfxCallback plans {type(model).__name__} by the submodules its forward runs ({', '.join(regions)}), "
            f"by their types; but {other or 'the model itself'!r} ({type(model.get_submodule(other)).__name__}) is "
            "of one of those types and is no such region (its forward does not run it, or it holds or is nested in "
            "another). Give that module another type, or plan the model with compfx.optimize(..., per_module=...) "
            "directly.")
    return regions, types


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


@dataclass
class PlannedRun:
    """A model a callback trains, planned in place: each region (``regions``, model paths) is a
    :class:`~compfx.per_module.PlannedBlock` running ``plan``, until :meth:`restore`; ``result`` is the search's
    (None: a saved plan was loaded)."""

    model: nn.Module
    regions: list[str]
    plan: Plan
    result: SearchResult | None
    source: str  # "searched", or where the plan was loaded from

    @property
    def searched(self) -> bool:
        return self.result is not None

    @property
    def blocks(self) -> dict[str, PlannedBlock]:
        """The planned regions by path (empty after :meth:`restore`)."""
        blocks = {path: self.model.get_submodule(path) for path in self.regions}
        return {path: block for path, block in blocks.items() if isinstance(block, PlannedBlock)}

    def restore(self) -> None:
        """Put the model's own submodules back in place of the planned regions (the same objects; idempotent)."""
        restore_blocks(self.model)

    def summary(self) -> str:
        """One line for the trainer's log."""
        counts = {p: sum(v is p for v in self.plan.values()) for p in Precision}
        ops = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
        head = (f"compfx: plan {self.plan.fingerprint} ({dtype_name(self.plan.low_dtype)}): {len(self.plan)} ops "
                f"({ops}) in {', '.join(self.regions)}")
        if self.result is None:
            return f"{head}; loaded from {self.source}, no search"
        comparison = self.result.step_comparison
        speedup = comparison.speedup("fp32") if comparison is not None else None
        speed = f"; chosen vs FP32: {speedup}" if speedup else ""  # the report's own words and figures
        return f"{head}; searched in {self.result.search_seconds:.1f} s (not training){speed}"

    def metrics(self) -> dict[str, float]:
        """Numbers for a trainer's metric loggers."""
        numbers = {"compfx/ops_low": float(sum(v is Precision.LOW for v in self.plan.values())),
                   "compfx/ops": float(len(self.plan)), "compfx/searched": float(self.searched)}
        if self.result is not None:
            numbers["compfx/search_seconds"] = self.result.search_seconds
            comparison = self.result.step_comparison
            for name in ("fp32", "amp", "chosen"):
                median = comparison.median(name) if comparison is not None else None
                if median is not None:
                    numbers[f"compfx/step_seconds_{name}"] = median
        return numbers


def plan_model(model: nn.Module, batches: list, *, optimizer: torch.optim.Optimizer, loss_fn=None,
               low_dtype: torch.dtype | None = None, config: SearchConfig | None = None, plan: Plan | None = None,
               log: str | os.PathLike | None = None, source: str = "searched") -> PlannedRun:
    """Plan ``model`` in place, region by region (:func:`planned_regions`): search a plan on ``batches``, or take
    ``plan``; each region becomes a :class:`~compfx.per_module.PlannedBlock` running it.

    The model keeps its class, ``forward``, Parameters and ``state_dict``
    keys: the trainer's optimizer, gradient clipping, checkpoints and
    ``save_pretrained`` see the model they know. :meth:`PlannedRun.restore`
    puts its own submodules back; if planning fails they are put back before
    the error propagates. The trainer owns the training, so the search's own
    training is undone (``keep_search_training=False``): the trainer's step
    count, schedule and checkpoints describe the model, and a resumed run
    matches an uninterrupted one. A given ``plan`` is checked against the
    model's regions (:class:`~compfx.errors.PlanMismatchError` when it was
    made for another model).

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 3))
    >>> batches = [(torch.randn(4, 8), torch.randint(0, 3, (4,)))]
    >>> ce = lambda out, batch: torch.nn.functional.cross_entropy(out, batch[-1])
    >>> a = compfx.regions.analyze_regions(model, batches[0][0], torch.nn.Linear)
    >>> run = plan_model(model, batches, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=ce,
    ...                  plan=compfx.Plan.fp32(a), source="a test")
    >>> run.searched, run.regions, type(model[0]).__name__
    (False, ['0'], 'PlannedBlock')
    >>> run.restore(); type(model[0]).__name__
    'Linear'
    """
    with_loss = plan is None or loss_fn is not None  # a given plan trains with the trainer's own loss
    regions, per_module = planned_regions(model, batches[0], loss_fn, with_loss=with_loss)
    try:
        if plan is None:
            config = dataclasses.replace(config or SearchConfig(), keep_search_training=False)
            result = optimize(model, batches, optimizer=optimizer, loss_fn=loss_fn, low_dtype=low_dtype,
                              config=config, log=log, per_module=per_module)
            return PlannedRun(model, regions, result.plan, result, "searched")
        args, kwargs = check_first_batch(model, batches[0], loss_fn, model_device(model), with_loss=with_loss)
        plan_blocks(model, plan, kwargs if kwargs else args, blocks=per_module,
                    verify=(config or SearchConfig()).verify_capture)
        return PlannedRun(model, regions, plan, None, source)
    except BaseException:
        restore_blocks(model)  # the user's model as it was, whatever failed
        raise


def saved_plan(*candidates: str | os.PathLike) -> tuple[Plan, str] | None:
    """The first of ``candidates`` (plan files) that exists, loaded, and its path; None when none does."""
    for candidate in candidates:
        if candidate is not None and Path(candidate).is_file():
            return Plan.load(candidate), str(candidate)
    return None
