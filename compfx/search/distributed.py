"""The search under ``torch.distributed``: one plan for every rank, or one per device (QSync).

compfx runs on the distributed engine the user already has (``torchrun`` +
``init_process_group``; DDP); it builds none of its own. Two pieces plug into
the search's interfaces:

* :class:`SyncedEvaluator` wraps this rank's evaluator so that every
  measurement is agreed on before the search sees it: per batch, the seconds
  are the MAX over ranks (a synchronous step waits for the slowest rank) and the
  loss is the mean over ranks; a plan's cost is the MAX over ranks of its cost.
  Every rank then sees the same numbers, makes the same accept and prune
  decisions -- so the collectives stay matched -- and reaches the same plan.
* a :class:`~compfx.search.driver.Strategy` for the step after the loss check:
  :class:`RankAgreement` (rank 0's plan is the last word) or
  :class:`PerDeviceAllocation` (QSync's allocator gives each rank its own plan,
  :mod:`compfx.search.allocation`). Both finish by giving every rank rank 0's
  trained state, so the module ``optimize`` returns can be wrapped in
  ``DistributedDataParallel`` and trains in step.

Collectives use ``all_gather`` of a few float64 numbers, and every rank reduces
the gathered rows itself, in rank order: the results are bitwise identical on
all ranks, which the lock-step search relies on.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..errors import PlanFailedError, PlanFailedOnRankError, SearchError
from ..plan import Assignment
from ..vocabulary import Stage
from .allocation import Measure, allocate_per_device
from .convergence import check_plan
from .evaluator import Epoch, Evaluator
from .outcome import Reporter, note
from .stage1 import Stage1Result

__all__ = [
    "RankContext", "rank_context", "collective_device", "SyncedEvaluator", "RankAgreement", "PerDeviceAllocation",
    "gathered_measure", "broadcast_training_state",
]

log = logging.getLogger("compfx")

# What a rank reports in each synced step: a value, the end of its epoch, a plan failure (the
# search tries the next plan) or an abort (anything else: the search stops), so that every rank
# takes the same branch.
_BATCH, _DONE, _FAILED, _ABORTED = 0.0, 1.0, 2.0, 3.0


# -- which rank am I ----------------------------------------------------------------

@dataclass(frozen=True)
class RankContext:
    """This process's place in the job; ``world_size == 1`` makes every collective a no-op."""

    rank: int = 0
    world_size: int = 1
    group: object = None
    device: torch.device = torch.device("cpu")  # where collective tensors live (CUDA for NCCL)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def gather(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values`` (the same count on every rank), in rank order, on every rank."""
        if not self.distributed:
            return [[float(v) for v in values]]
        local = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(rows, local, group=self.group)
        return [row.tolist() for row in rows]

    def broadcast_text(self, text: str, src: int = 0) -> str:
        if not self.distributed:
            return text
        box = [text]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src) if self.group else src,
                                   group=self.group)
        return box[0]


def rank_context(group=None, device: torch.device | str | None = None) -> RankContext:
    """The context of the initialised default (or given) process group; a single-process context otherwise.

    ``device`` is where this rank trains (``optimize`` passes the model's):
    see :func:`collective_device` for where collective tensors go.

    >>> rank_context().world_size  # no process group in a doctest
    1
    """
    if not (dist.is_available() and dist.is_initialized()):
        return RankContext()
    return RankContext(dist.get_rank(group), dist.get_world_size(group), group, collective_device(group, device))


def collective_device(group=None, device: torch.device | str | None = None) -> torch.device:
    """Where this rank's collective tensors live: the CPU for gloo; for NCCL, this rank's own GPU.

    That GPU is ``device`` when it is one (the model's), else the one the
    process group was bound to (``init_process_group(device_id=...)``), else
    ``cuda:LOCAL_RANK`` (torchrun sets it; the global rank without it), modulo
    the GPUs visible. Not ``torch.cuda.current_device()``: in a process that
    never called ``torch.cuda.set_device`` it is ``cuda:0`` on every rank, and
    NCCL would run every rank's collectives on one GPU. Logged at INFO, with
    where it came from (a warning when it is not the current device).
    """
    if dist.get_backend(group) != "nccl":  # gloo moves CPU tensors
        return torch.device("cpu")
    device = torch.device(device) if device is not None else None
    bound = getattr(group if group is not None else _default_group(), "bound_device_id", None)
    if device is not None and device.type == "cuda" and device.index is not None:
        found, source = device, "the model's device"
    elif bound is not None:
        found, source = torch.device(bound), "the process group's device_id"
    else:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) if local is not None else dist.get_rank()
        found = torch.device("cuda", index % max(torch.cuda.device_count(), 1))
        source = f"LOCAL_RANK={local}" if local is not None else f"rank {index} (no LOCAL_RANK)"
    log.info("compfx: rank %d runs its collectives on %s (%s)", dist.get_rank(group), found, source)
    if torch.cuda.is_available() and torch.cuda.current_device() != found.index:
        log.warning("compfx: rank %d's collectives use %s (%s), not the current CUDA device cuda:%d; call "
                    "torch.cuda.set_device(%s) before init_process_group so that your own collectives agree",
                    dist.get_rank(group), found, source, torch.cuda.current_device(), found.index)
    return found


def _default_group():
    try:
        return dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - a private accessor: without it, LOCAL_RANK decides
        return None


# -- an evaluator every rank agrees on -------------------------------------------------

def _status_of(error: BaseException) -> float:
    return _FAILED if isinstance(error, PlanFailedError) else _ABORTED


def _raise_if_failed(rows: list[list[float]], local_error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed: its own error where it failed, a stand-in elsewhere."""
    aborted = [rank for rank, row in enumerate(rows) if row[0] == _ABORTED]
    failed = [rank for rank, row in enumerate(rows) if row[0] == _FAILED]
    if not aborted and not failed:
        return
    if local_error is not None:
        raise local_error  # this rank's own error, with its own traceback
    if aborted:
        raise SearchError(f"{what} stopped on rank(s) {aborted} with an error that is not the plan's (see their "
                          "output); stopping this rank too.")
    raise PlanFailedOnRankError(f"{what} failed on rank(s) {failed} (see their output); every rank treats the "
                                "plan as failed so that the ranks stay in step.")


def _next_batch(epoch) -> tuple[float, float, float, object]:
    try:
        loss, seconds = next(epoch)
        return _BATCH, float(loss), float(seconds), None
    except StopIteration as stop:
        return _DONE, math.nan, 0.0, stop.value
    except Exception as error:
        return _status_of(error), math.nan, 0.0, error


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _or_nan(value) -> float:
    return math.nan if value is None else float(value)


class SyncedEvaluator:
    """``inner`` (this rank's evaluator) with every measurement agreed over the ranks of ``ctx``.

    Seconds are the max over ranks, losses the mean, costs the max (it stays
    non-decreasing in the seconds when every rank's cost is, so pruning stays
    exact). A rank that fails reports it in the same collective, so every rank
    stops together; ranks whose loaders have different lengths raise
    :class:`SearchError`.
    """

    def __init__(self, inner: Evaluator, ctx: RankContext):
        self.inner, self.ctx = inner, ctx

    @property
    def cost_unit(self) -> str:
        return getattr(self.inner, "cost_unit", "s")

    def run_epoch(self, plan: Assignment) -> Epoch:
        local = None
        try:
            try:
                local = self.inner.run_epoch(plan)
            except Exception as error:  # e.g. the plan could not be applied on this rank
                _raise_if_failed(self.ctx.gather([_status_of(error), math.nan, 0.0]), error, f"plan {plan}")
            while True:
                status, loss, seconds, payload = _next_batch(local)
                rows = self.ctx.gather([status, loss, seconds])
                _raise_if_failed(rows, payload if status in (_FAILED, _ABORTED) else None,
                                 f"an epoch under plan {plan}")
                done = [row[0] == _DONE for row in rows]
                if all(done):
                    return payload
                if any(done):
                    first = [rank for rank, finished in enumerate(done) if finished]
                    raise SearchError(
                        f"the ranks' sample loaders have different lengths (ranks {first} ran out first); give "
                        "every rank the same number of batches, e.g. with DistributedSampler(drop_last=True).")
                yield _mean([row[1] for row in rows]), max(row[2] for row in rows)
        finally:
            if local is not None and hasattr(local, "close"):
                local.close()  # pruning closes this wrapper: let this rank's epoch restore its state

    def _agreed(self, what: str, reduce: Callable[[list[float]], float], call: Callable[[], float]) -> float:
        try:
            value, error = float(call()), None
        except Exception as caught:
            value, error = math.nan, caught
        rows = self.ctx.gather([_status_of(error) if error else _BATCH, value])
        _raise_if_failed(rows, error, what)
        return reduce([row[1] for row in rows])

    def time_step(self, plan: Assignment) -> float:
        return self._agreed(f"timing plan {plan}", max, lambda: self.inner.time_step(plan))

    def time_steps(self, plans: Sequence[Assignment], rounds: int) -> list[list[float]]:
        """Each rank's interleaved timings, agreed element by element: the slowest rank's step counts."""
        try:
            local, error = [float(s) for row in self.inner.time_steps(plans, rounds) for s in row], None
        except Exception as caught:
            local, error = [math.nan] * (len(plans) * rounds), caught
        rows = self.ctx.gather([_status_of(error) if error else _BATCH, *local])
        _raise_if_failed(rows, error, f"timing plans {' '.join(map(str, plans))} in turns")
        agreed = [max(row[1 + k] for row in rows) for k in range(len(local))]
        return [agreed[j * rounds:(j + 1) * rounds] for j in range(len(plans))]

    def saved_bytes(self, plan: Assignment) -> int | None:
        """The most bytes any rank's forward saves (None when a rank cannot tell)."""
        value = self._agreed(f"the memory of plan {plan}", max, lambda: _or_nan(self.inner.saved_bytes(plan)))
        return None if math.isnan(value) else int(value)

    def check_loss(self, plan: Assignment, batches: int) -> float:
        return self._agreed(f"the loss check of plan {plan}", _mean, lambda: self.inner.check_loss(plan, batches))

    def cost(self, plan: Assignment, seconds: float) -> float:
        return self._agreed(f"the cost of plan {plan}", max, lambda: self.inner.cost(plan, seconds))

    def program(self, plan: Assignment) -> Hashable:
        return self.inner.program(plan)  # the same model and plan give the same program on every rank


# -- strategies -------------------------------------------------------------------------

@torch.no_grad()
def broadcast_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: RankContext,
                             src: int = 0) -> None:
    """Copy ``src``'s parameters, buffers and optimizer state tensors into every rank, in place.

    Each rank trained its own shard during the search; after this the ranks
    start the real training from one state, as DDP requires. Sharded tensors
    (FSDP2's DTensor parameters and their optimizer state) are left alone:
    every rank holds a different part of them by design.
    """
    if not ctx.distributed:
        return
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                tensors.extend(state[key] for key in sorted(state) if isinstance(state[key], torch.Tensor))
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            continue  # a shard (FSDP2): each rank holds its own part, kept in step by the sharded training itself
        buffer = tensor if tensor.device == ctx.device and tensor.is_contiguous() else tensor.to(ctx.device).contiguous()
        dist.broadcast(buffer, src=dist.get_global_rank(ctx.group, src) if ctx.group else src, group=ctx.group)
        if buffer is not tensor:
            tensor.copy_(buffer)


class RankAgreement:
    """Every rank runs rank 0's plan (they reached the same one; rank 0's is the last word)."""

    def __init__(self, ctx: RankContext, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.ctx, self.model, self.optimizer = ctx, model, optimizer

    def decide(self, checked: Assignment, *, stage1: Stage1Result, evaluator, report: Reporter) -> Assignment:
        shared = Assignment.parse(self.ctx.broadcast_text(str(checked)))
        if self.ctx.distributed:
            note(report, Stage.DISTRIBUTED, f"{self.ctx.world_size} ranks agreed on plan {shared}",
                 world_size=self.ctx.world_size)
        return shared

    def finish(self) -> None:
        broadcast_training_state(self.model, self.optimizer, self.ctx)


def gathered_measure(local: Callable[[Assignment], tuple[float, int]], ctx: RankContext) -> Measure:
    """A :data:`~compfx.search.allocation.Measure` for a real job: each rank measures its own plan; rows gathered.

    Results are cached per plan, so ranks whose plan did not change only join the collective.
    """
    cache: dict[Assignment, tuple[float, int]] = {}

    def measure(plans: Sequence[Assignment]) -> list[tuple[float, int]]:
        mine = plans[ctx.rank]
        error = None
        if mine not in cache:
            try:
                cache[mine] = tuple(local(mine))
            except Exception as caught:
                error = caught
        seconds, nbytes = cache.get(mine, (math.nan, 0))
        rows = ctx.gather([_status_of(error) if error else _BATCH, seconds, nbytes])
        _raise_if_failed(rows, error, "measuring a per-device plan")
        return [(row[1], int(row[2])) for row in rows]

    return measure


class PerDeviceAllocation(RankAgreement):
    """QSync's allocator after the ranks agree: each rank gets its own plan within its memory budget.

    ``local`` is this rank's own (unsynced) evaluator: each rank times its own
    plan. ``activation_bytes(plan)`` measures this rank's activation bytes on
    its first batch. The per-device plans must pass the loss check together
    (the mean loss over ranks, each under its own plan); otherwise every rank
    keeps the shared plan.
    """

    def __init__(self, ctx: RankContext, model: nn.Module, optimizer: torch.optim.Optimizer, *, space,
                 local: Evaluator, activation_bytes: Callable[[Assignment], int], memory_budget: int | None,
                 threshold: float, check_batches: int):
        super().__init__(ctx, model, optimizer)
        self.space, self.local, self.activation_bytes = space, local, activation_bytes
        self.memory_budget, self.threshold, self.check_batches = memory_budget, threshold, check_batches

    def decide(self, checked: Assignment, *, stage1: Stage1Result, evaluator, report: Reporter) -> Assignment:
        shared = Assignment.parse(self.ctx.broadcast_text(str(checked)))  # rank 0 has the last word
        rows = self.ctx.gather([0.0, -1 if self.memory_budget is None else self.memory_budget])
        budgets = [None if budget < 0 else int(budget) for _, budget in rows]
        allocation = allocate_per_device(self.space, gathered_measure(self._measure, self.ctx), budgets)
        # every rank computed the same allocation from the same gathered numbers; rank 0's is the last word
        plans = self.ctx.broadcast_text(" ".join(map(str, allocation.plans))).split()
        mine = Assignment.parse(plans[self.ctx.rank])
        note(report, Stage.DISTRIBUTED, f"per-device plans {plans}; predicted step {allocation.step_seconds:.6g} s",
             plans=plans, starts=[str(p) for p in allocation.starts], seconds=list(allocation.seconds),
             activation_bytes=list(allocation.activation_bytes), budgets=budgets,
             recovered=[list(r) for r in allocation.recovered])
        check = check_plan(evaluator, mine, stage1.baseline, batches=self.check_batches, threshold=self.threshold)
        if check.passed:
            return mine
        note(report, Stage.DISTRIBUTED, f"the per-device plans failed the loss check ({check.reason}); every rank "
             f"keeps the shared plan {shared}, which may exceed a memory budget", fallback=str(shared))
        return shared

    def _measure(self, plan: Assignment) -> tuple[float, int]:
        return self.local.time_step(plan), self.activation_bytes(plan)
