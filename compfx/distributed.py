"""The search under ``torch.distributed``: one plan for every rank, or one per device (QSync).

compfx runs on the distributed engine the user already has (``torchrun`` +
``init_process_group``; DDP, FSDP); it builds none of its own.

**One shared plan** (the default). Each rank samples on its own data shard, and
every measurement is agreed on before the search sees it: per batch, the
seconds are the MAX over ranks (a synchronous step waits for the slowest rank)
and the loss is the mean over ranks; a candidate's cost is the MAX over ranks of
``cost_fn``. Every rank then sees the same numbers, makes the same accept and
prune decisions -- so the collectives stay matched -- and reaches the same plan,
which rank 0 broadcasts as the last word. Rank 0's trained state (parameters,
buffers, optimizer state) is broadcast too, so the module ``optimize`` returns
can be wrapped in ``DistributedDataParallel`` and trains in step.

**One plan per device** (``SearchConfig(per_device=True)``): QSync's allocator
(section V) for fleets that mix fast and slow or small devices. Each rank starts
at its fastest plan that fits its ``memory_budget`` (activation bytes, see
:mod:`compfx.memory`) and recovers ops to FP32 one at a time while the slowest
rank's step time does not grow and memory fits. Parameters stay FP32 master
weights on every rank, so DDP still reduces FP32 gradients of the same model.

Collectives use ``all_gather`` of a few float64 numbers, and every rank reduces
the gathered rows itself, in rank order: the results are bitwise identical on
all ranks, which the lock-step search relies on.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from itertools import product
from typing import Callable, Hashable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .errors import BadInputError, SearchError
from .search import SearchSpace, is_accepted

__all__ = [
    "PlanFailedOnRankError", "RankContext", "rank_context", "synced_epoch", "synced_value", "synced_cost",
    "broadcast_training_state",
    "Allocation", "allocation_starts", "recovery_order", "allocate_per_device", "gathered_measure",
    "distribute_search",
]

_LOW, _FP32 = "0", "1"
# What a rank reports in each synced step: a value, the end of its epoch, a plan failure (the
# model raised under this plan: the search tries the next one) or an abort (the user's input is
# wrong whatever the plan: the search stops), so that every rank takes the same branch.
_BATCH, _DONE, _FAILED, _ABORTED = 0.0, 1.0, 2.0, 3.0


class PlanFailedOnRankError(RuntimeError):
    """Raised on every rank when the model failed under a plan on some other rank.

    A ``RuntimeError`` on purpose: to the search it is a plan failure like the
    other rank's own error, so every rank marks the plan "error" and goes on.
    """


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


def rank_context(group=None) -> RankContext:
    """The context of the initialised default (or given) process group; a single-process context otherwise.

    >>> rank_context().world_size  # no process group in a doctest
    1
    """
    if not (dist.is_available() and dist.is_initialized()):
        return RankContext()
    backend = dist.get_backend(group)
    device = torch.device("cpu")
    if backend == "nccl":  # NCCL only moves CUDA tensors
        device = torch.device("cuda", torch.cuda.current_device())
    return RankContext(dist.get_rank(group), dist.get_world_size(group), group, device)


# -- evaluators every rank agrees on -------------------------------------------------

def _status_of(error: BaseException) -> float:
    return _ABORTED if isinstance(error, (BadInputError, SearchError)) else _FAILED


def _raise_if_failed(rows: list[list[float]], local_error: BaseException | None, what: str) -> None:
    """Raise on every rank when any rank failed: its own error where it failed, a stand-in elsewhere."""
    aborted = [rank for rank, row in enumerate(rows) if row[0] == _ABORTED]
    failed = [rank for rank, row in enumerate(rows) if row[0] == _FAILED]
    if not aborted and not failed:
        return
    if local_error is not None:
        raise local_error  # this rank's own error, with its own traceback
    if aborted:
        raise SearchError(f"{what} stopped on rank(s) {aborted} with an input error (see their output); "
                          "stopping this rank too.")
    raise PlanFailedOnRankError(f"{what} failed on rank(s) {failed} (see their output); every rank treats the "
                                "plan as failed so that the ranks stay in step.")


def synced_epoch(run_epoch: Callable, ctx: RankContext) -> Callable:
    """Wrap a search ``run_epoch(bits)`` so that each batch yields (mean loss, max seconds) over ranks.

    A rank that fails reports it in the same collective, so every rank stops
    together; ranks whose loaders have different lengths raise SearchError.
    Closing the wrapper (pruning) closes this rank's epoch, which restores its state.
    """

    def epoch(bits: str):
        local = None
        try:
            try:
                local = run_epoch(bits)
            except Exception as error:  # e.g. the plan could not be applied on this rank
                _raise_if_failed(ctx.gather([_status_of(error), math.nan, 0.0]), error, f"plan {bits}")
            while True:
                status, loss, seconds, payload = _next_batch(local)
                rows = ctx.gather([status, loss, seconds])
                failure = payload if status in (_FAILED, _ABORTED) else None
                _raise_if_failed(rows, failure, f"an epoch under plan {bits}")
                done = [row[0] == _DONE for row in rows]
                if all(done):
                    return payload
                if any(done):
                    first = [rank for rank, finished in enumerate(done) if finished]
                    raise SearchError(
                        f"the ranks' sample loaders have different lengths (ranks {first} ran out first); give "
                        "every rank the same number of batches, e.g. with DistributedSampler(drop_last=True).")
                yield sum(row[1] for row in rows) / len(rows), max(row[2] for row in rows)
        finally:
            if local is not None and hasattr(local, "close"):
                local.close()

    return epoch


def _next_batch(epoch) -> tuple[float, float, float, object]:
    try:
        loss, seconds = next(epoch)
        return _BATCH, float(loss), float(seconds), None
    except StopIteration as stop:
        return _DONE, math.nan, 0.0, stop.value
    except Exception as error:
        return _status_of(error), math.nan, 0.0, error


def synced_value(fn: Callable[..., float], ctx: RankContext, reduce: Callable[[list[float]], float]) -> Callable:
    """``fn(*args)`` on every rank, reduced over ranks (``max`` for time, a mean for loss)."""

    def agreed(*args) -> float:
        try:
            value, error = float(fn(*args)), None
        except Exception as caught:
            value, error = math.nan, caught
        rows = ctx.gather([_status_of(error) if error else _BATCH, value])
        _raise_if_failed(rows, error, f"{getattr(fn, '__name__', 'an evaluator')}{args[:1]}")
        return reduce([row[1] for row in rows])

    return agreed


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def synced_cost(cost: Callable[[str, float], float], ctx: RankContext) -> Callable[[str, float], float]:
    """The search's ``cost(bits, seconds)`` as the MAX over ranks: the slowest rank sets the pace.

    It stays non-decreasing in ``seconds`` when every rank's cost is, so Stage-1 pruning stays exact.
    """
    return synced_value(cost, ctx, max)


@torch.no_grad()
def broadcast_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: RankContext,
                             src: int = 0) -> None:
    """Copy ``src``'s parameters, buffers and optimizer state tensors into every rank, in place.

    Each rank trained its own shard during the search; after this the ranks
    start the real training from one state, as DDP requires.
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
        _broadcast_in_place(tensor, ctx, src)


def _broadcast_in_place(tensor: torch.Tensor, ctx: RankContext, src: int) -> None:
    buffer = tensor if tensor.device == ctx.device and tensor.is_contiguous() else tensor.to(ctx.device).contiguous()
    dist.broadcast(buffer, src=dist.get_global_rank(ctx.group, src) if ctx.group else src, group=ctx.group)
    if buffer is not tensor:
        tensor.copy_(buffer)


# -- QSync's per-device allocator -------------------------------------------------------

Measure = Callable[[Sequence[str]], Sequence[tuple[float, int]]]


@dataclass(frozen=True)
class Allocation:
    """One plan per rank, with the predicted step seconds and activation bytes of each."""

    bits: tuple[str, ...]
    seconds: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    starts: tuple[str, ...]  # each rank's fastest plan within its budget
    recovered: tuple[tuple[int, ...], ...]  # op positions each rank moved back to FP32

    @property
    def step_seconds(self) -> float:
        """The synchronous step: the slowest rank's."""
        return max(self.seconds)


def _stage1_groups(space: SearchSpace) -> list[tuple[int, ...]]:
    groups: dict[Hashable, list[int]] = {}
    for i in space.stage1_positions:
        groups.setdefault(space.groups[i], []).append(i)
    return [tuple(members) for members in groups.values()]


def _with(bits: str, positions: Sequence[int], bit: str) -> str:
    chars = list(bits)
    for i in positions:
        chars[i] = bit
    return "".join(chars)


def allocation_starts(space: SearchSpace, budget: int = 64) -> list[str]:
    """Candidate starting plans: whitelist and blacklist ops low or FP32, "other" ops follow.

    Ops of one kind and input shapes share a bit (QSync searches repeated
    subgraphs once). All ``2**g`` group combinations when they fit ``budget``,
    else all-low, all-FP32, and all-low with one group FP32. Most-low first.

    >>> space = SearchSpace(("whitelist", "other", "blacklist"), (False,) * 3, ("a", "b", "c"))
    >>> allocation_starts(space)
    ['0f0', '0f1', '1f0', '1f1']
    """
    groups = _stage1_groups(space)
    base = "".join(_LOW if c != "other" else "f" for c in space.categories)
    if 2 ** len(groups) <= budget:
        choices = sorted(product((_LOW, _FP32), repeat=len(groups)), key=lambda c: c.count(_FP32))
        return [_with_groups(base, groups, choice) for choice in choices]
    everything = [i for g in groups for i in g]
    return [base, *(_with(base, g, _FP32) for g in groups), _with(base, everything, _FP32)]


def _with_groups(bits: str, groups: Sequence[Sequence[int]], choice: Sequence[str]) -> str:
    for members, bit in zip(groups, choice):
        bits = _with(bits, members, bit)
    return bits


def recovery_order(space: SearchSpace) -> list[int]:
    """Which low ops to give back FP32 first: autocast's blacklist (numerically touchy), then
    whitelist ops without Tensor Cores (low precision buys little there), then the rest; graph order within."""
    def rank(i: int) -> int:
        if space.categories[i] == "blacklist":
            return 0
        return 1 if not space.tc_eligible[i] else 2
    return sorted(space.stage1_positions, key=lambda i: (rank(i), i))


def allocate_per_device(space: SearchSpace, measure: Measure, budgets: Sequence[int | None], *,
                        starts: Sequence[str] | None = None, order: Sequence[int] | None = None) -> Allocation:
    """QSync's allocator: each rank's fastest plan within its memory budget, then FP32 recovered op by op.

    ``measure(plans)`` takes one plan per rank and returns ``(seconds, activation_bytes)``
    per rank; a rank's numbers must depend on its own plan only. ``budgets[r]`` is
    rank ``r``'s byte limit (None: no limit). Recovery runs in rounds: every rank
    that still has a low op left (in ``order``, default :func:`recovery_order`)
    tries it at FP32; a rank keeps the change when it still fits its budget and
    its new time is at most the slowest rank's time at the start of the round,
    so the synchronous step never grows.

    >>> space = SearchSpace(("whitelist", "whitelist"), (False, False), ("a", "b"))
    >>> def measure(plans):  # FP32 ops cost 1 s and 10 bytes, low ops 0.5 s and 4 bytes; rank 1 is twice as slow
    ...     return [((1 + r) * sum(1 if b == "1" else 0.5 for b in p), sum(10 if b == "1" else 4 for b in p))
    ...             for r, p in enumerate(plans)]
    >>> allocate_per_device(space, measure, [None, 10]).bits  # rank 0 recovers both ops within rank 1's 2 s
    ('11', '00')
    """
    world = len(budgets)
    starts = list(starts) if starts is not None else allocation_starts(space)
    if not starts:
        raise SearchError("allocate_per_device needs at least one starting plan")
    results = {bits: _checked_rows(measure([bits] * world), world) for bits in starts}
    current = [_fastest_fitting(starts, results, rank, budgets[rank]) for rank in range(world)]
    seconds = [results[current[r]][r][0] for r in range(world)]
    memory = [results[current[r]][r][1] for r in range(world)]
    start_bits = tuple(current)
    order = list(order) if order is not None else recovery_order(space)
    queues = [[i for i in order if current[r][i] == _LOW] for r in range(world)]
    recovered: list[list[int]] = [[] for _ in range(world)]
    while any(queues):
        trying = {r: queue.pop(0) for r, queue in enumerate(queues) if queue}
        proposal = [_with(current[r], [trying[r]], _FP32) if r in trying else current[r] for r in range(world)]
        rows = _checked_rows(measure(proposal), world)
        pace = max(seconds)  # the synchronous step at the start of the round
        for r, i in trying.items():
            new_seconds, new_bytes = rows[r]
            if new_seconds <= pace and _fits(new_bytes, budgets[r]):
                current[r], seconds[r], memory[r] = proposal[r], new_seconds, new_bytes
                recovered[r].append(i)
    return Allocation(tuple(current), tuple(seconds), tuple(int(m) for m in memory), start_bits,
                      tuple(tuple(r) for r in recovered))


def _checked_rows(rows, world: int) -> list[tuple[float, int]]:
    rows = [(float(s), int(m)) for s, m in rows]
    if len(rows) != world:
        raise SearchError(f"measure() returned {len(rows)} results for {world} ranks; expected one per rank")
    return rows


def _fits(nbytes: int, budget: int | None) -> bool:
    return budget is None or nbytes <= budget


def _fastest_fitting(starts: list[str], results: dict, rank: int, budget: int | None) -> str:
    fitting = [bits for bits in starts if _fits(results[bits][rank][1], budget)]
    if not fitting:
        smallest = min(results[bits][rank][1] for bits in starts)
        raise SearchError(f"no plan fits rank {rank}'s memory_budget={budget} bytes: the smallest candidate saves "
                          f"{smallest} activation bytes per step. Raise the budget or lower that rank's batch size.")
    return min(fitting, key=lambda bits: (results[bits][rank][0], results[bits][rank][1]))  # ties: the earlier


def gathered_measure(local: Callable[[str], tuple[float, int]], ctx: RankContext) -> Measure:
    """A :data:`Measure` for a real job: each rank measures its own plan; the rows are gathered.

    Results are cached per plan, so ranks whose plan did not change only join the collective.
    """
    cache: dict[str, tuple[float, int]] = {}

    def measure(plans: Sequence[str]) -> list[tuple[float, int]]:
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


# -- wiring into compfx.optimize ---------------------------------------------------------

class _DistributedSearch:
    """Runs an ``optimize`` search in lock-step across ranks.

    It relies on these attributes of ``compfx.optimize._Search``: the evaluator
    methods ``run_epoch``, ``time_step``, ``check_loss``, ``cost`` (replaced on
    the instance by synced ones), ``_checked(stage1, winner)`` (the hook where the
    plan is agreed or allocated), ``module(bits)``, ``space``, ``config``,
    ``log``, ``model``, ``sampler`` and ``run()``.
    """

    def __init__(self, search, ctx: RankContext):
        self.search, self.ctx = search, ctx
        config = search.config
        self.per_device, self.budget = config.per_device, config.memory_budget  # checked by SearchConfig
        if ctx.distributed and config.predictor == "on":
            # Each rank would profile its own ops and order or skip candidates on its own
            # predictions, and the ranks' collectives would stop matching; measure them all.
            search.config = replace(config, predictor="off")
            search.log.note("search", "cost model off under torch.distributed: every rank measures every candidate")
        self.local_time_step = search.time_step
        self.checked = search._checked
        search.run_epoch = synced_epoch(search.run_epoch, ctx)
        search.time_step = synced_value(search.time_step, ctx, max)
        search.check_loss = synced_value(search.check_loss, ctx, _mean)
        search.cost = synced_cost(search.cost, ctx)
        search._checked = self._agree

    def run(self):
        result = self.search.run()
        broadcast_training_state(self.search.model, self.search.sampler.optimizer, self.ctx)
        return result

    def _agree(self, stage1, winner: str) -> str:
        shared = self.ctx.broadcast_text(self.checked(stage1, winner))  # rank 0 has the last word
        if not self.per_device:
            if self.ctx.distributed:
                self.search.log.note("distributed", f"{self.ctx.world_size} ranks agreed on plan {shared}",
                                     world_size=self.ctx.world_size)
            return shared
        return self._allocate(stage1, shared)

    def _allocate(self, stage1, shared: str) -> str:
        search, ctx = self.search, self.ctx
        rows = ctx.gather([0.0, -1 if self.budget is None else self.budget])
        budgets = [None if budget < 0 else int(budget) for _, budget in rows]
        measure = gathered_measure(self._measure_locally, ctx)
        allocation = allocate_per_device(search.space, measure, budgets)
        # every rank computed the same allocation from the same gathered numbers; rank 0's is the last word
        mine = ctx.broadcast_text(" ".join(allocation.bits)).split()[ctx.rank]
        search.log.note("distributed", f"per-device plans {list(allocation.bits)}; predicted step "
                        f"{allocation.step_seconds:.6g} s", plans=list(allocation.bits), starts=list(allocation.starts),
                        seconds=list(allocation.seconds), activation_bytes=list(allocation.activation_bytes),
                        budgets=budgets, recovered=[list(r) for r in allocation.recovered])
        if self._converges(stage1, mine):
            return mine
        search.log.note("distributed", f"the per-device plans failed the loss check; every rank keeps the shared "
                        f"plan {shared}, which may exceed a memory budget", fallback=shared)
        return shared

    def _measure_locally(self, bits: str) -> tuple[float, int]:
        from .memory import saved_activation_bytes

        args, kwargs = self._first_inputs
        return self.local_time_step(bits), saved_activation_bytes(self.search.module(bits), args, kwargs)

    @functools.cached_property
    def _first_inputs(self) -> tuple[tuple, dict]:
        """The loader's first batch on this rank's device, fetched once: every plan's bytes are of the same batch."""
        from .training import move_batch, split_batch

        sampler = self.search.sampler
        return split_batch(move_batch(next(iter(sampler.loader)), sampler.device))

    def _converges(self, stage1, mine: str) -> bool:
        """The mean loss over ranks, each under its own plan, against FP32's on the same batches."""
        batches = min(self.search.config.stage2_check_batches, stage1.baseline.batches)
        if batches == 0:
            return True
        reference = sum(stage1.baseline.batch_losses[:batches]) / batches
        try:
            loss = self.search.check_loss(mine)
        except Exception:
            return False
        return is_accepted(loss, reference, self.search.config.threshold)


def distribute_search(search, group=None):
    """Make an ``optimize`` search run in lock-step over the ranks of ``group`` (default: the whole job).

    Returns an object whose ``run()`` returns what the search's does. Called by
    :func:`compfx.optimize` when ``torch.distributed`` is initialised or
    ``per_device=True``; with one process it only adds the per-device allocator.
    See the module docstring for what is agreed and how.
    """
    return _DistributedSearch(search, rank_context(group))
