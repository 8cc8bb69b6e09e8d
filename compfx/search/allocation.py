"""QSync's per-device allocator (section V), as pure logic: one plan per rank of a mixed fleet.

Each rank starts at its fastest plan that fits its memory budget (activation
bytes saved for backward, see :mod:`compfx.memory`), then gives ops back to
FP32 one at a time while the slowest rank's step time does not grow and the
memory still fits. Measurements come from a callable, so the allocator is
exactly testable with a fake device model; :mod:`compfx.search.distributed`
gathers real ones over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Callable, Sequence

from ..errors import SearchError
from ..plan import Assignment
from ..vocabulary import Category, Precision
from .space import SearchSpace

__all__ = ["Allocation", "Measure", "allocation_starts", "recovery_order", "allocate_per_device"]

#: ``measure(plans)``: one plan per rank in, ``(seconds, activation_bytes)`` per rank out.
Measure = Callable[[Sequence[Assignment]], Sequence[tuple[float, int]]]

_LOW, _FP32 = Precision.LOW, Precision.FP32


@dataclass(frozen=True)
class Allocation:
    """One plan per rank, with the measured step seconds and activation bytes of each."""

    plans: tuple[Assignment, ...]
    seconds: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    starts: tuple[Assignment, ...]  # each rank's fastest plan within its budget
    recovered: tuple[tuple[int, ...], ...]  # op positions each rank moved back to FP32

    @property
    def step_seconds(self) -> float:
        """The synchronous step: the slowest rank's."""
        return max(self.seconds)


def allocation_starts(space: SearchSpace, budget: int = 64) -> list[Assignment]:
    """Candidate starting plans: whitelist and blacklist ops low or FP32, "other" ops follow.

    Ops of one kind and input shapes share a decision (QSync searches repeated
    subgraphs once). All ``2**g`` group combinations when they fit ``budget``,
    else all-low, all-low with one group FP32, and all-FP32. Most-low first.

    >>> space = SearchSpace((Category.WHITELIST, Category.OTHER, Category.BLACKLIST), (False,) * 3, ("a", "b", "c"))
    >>> [str(plan) for plan in allocation_starts(space)]
    ['0f0', '0f1', '1f0', '1f1']
    """
    groups = space.groups_of(space.stage1_positions)
    base = Assignment(_LOW if c is not Category.OTHER else Precision.FOLLOW for c in space.categories)
    if 2 ** len(groups) <= budget:
        choices = sorted(product((_LOW, _FP32), repeat=len(groups)), key=lambda c: c.count(_FP32))
        return [_with_groups(base, groups, choice) for choice in choices]
    everything = [i for g in groups for i in g]
    return [base, *(base.replaced(g, _FP32) for g in groups), base.replaced(everything, _FP32)]


def _with_groups(plan: Assignment, groups: Sequence[Sequence[int]], choice: Sequence[Precision]) -> Assignment:
    for members, precision in zip(groups, choice):
        plan = plan.replaced(members, precision)
    return plan


def recovery_order(space: SearchSpace) -> list[int]:
    """Which low ops to give back FP32 first: autocast's blacklist (numerically touchy), then
    whitelist ops without Tensor Cores (low precision buys little there), then the rest; graph order within."""
    def rank(i: int) -> int:
        if space.categories[i] is Category.BLACKLIST:
            return 0
        return 1 if not space.tc_eligible[i] else 2
    return sorted(space.stage1_positions, key=lambda i: (rank(i), i))


def allocate_per_device(space: SearchSpace, measure: Measure, budgets: Sequence[int | None], *,
                        starts: Sequence[Assignment] | None = None,
                        order: Sequence[int] | None = None) -> Allocation:
    """QSync's allocator: each rank's fastest plan within its memory budget, then FP32 recovered op by op.

    ``measure(plans)`` takes one plan per rank and returns ``(seconds, activation_bytes)``
    per rank; a rank's numbers must depend on its own plan only. ``budgets[r]`` is
    rank ``r``'s byte limit (None: no limit). Recovery runs in rounds: every rank
    that still has a low op left (in ``order``, default :func:`recovery_order`)
    tries it at FP32; a rank keeps the change when it still fits its budget and
    its new time is at most the slowest rank's time at the start of the round,
    so the synchronous step never grows.

    >>> space = SearchSpace((Category.WHITELIST, Category.WHITELIST), (False, False), ("a", "b"))
    >>> def measure(plans):  # FP32 ops cost 1 s and 10 bytes, low ops 0.5 s and 4 bytes; rank 1 is twice as slow
    ...     return [((1 + r) * sum(1 if p is Precision.FP32 else 0.5 for p in plan),
    ...              sum(10 if p is Precision.FP32 else 4 for p in plan)) for r, plan in enumerate(plans)]
    >>> [str(plan) for plan in allocate_per_device(space, measure, [None, 10]).plans]  # rank 0 recovers both ops
    ['11', '00']
    """
    world = len(budgets)
    starts = list(starts) if starts is not None else allocation_starts(space)
    if not starts:
        raise SearchError("allocate_per_device needs at least one starting plan")
    results = {plan: _checked_rows(measure([plan] * world), world) for plan in starts}
    current = [_fastest_fitting(starts, results, rank, budgets[rank]) for rank in range(world)]
    seconds = [results[current[r]][r][0] for r in range(world)]
    memory = [results[current[r]][r][1] for r in range(world)]
    start_plans = tuple(current)
    order = list(order) if order is not None else recovery_order(space)
    queues = [[i for i in order if current[r][i] is _LOW] for r in range(world)]
    recovered: list[list[int]] = [[] for _ in range(world)]
    while any(queues):
        trying = {r: queue.pop(0) for r, queue in enumerate(queues) if queue}
        proposal = [current[r].replaced([trying[r]], _FP32) if r in trying else current[r] for r in range(world)]
        rows = _checked_rows(measure(proposal), world)
        pace = max(seconds)  # the synchronous step at the start of the round
        for r, i in trying.items():
            new_seconds, new_bytes = rows[r]
            if new_seconds <= pace and _fits(new_bytes, budgets[r]):
                current[r], seconds[r], memory[r] = proposal[r], new_seconds, new_bytes
                recovered[r].append(i)
    return Allocation(tuple(current), tuple(seconds), tuple(int(m) for m in memory), start_plans,
                      tuple(tuple(r) for r in recovered))


def _checked_rows(rows, world: int) -> list[tuple[float, int]]:
    rows = [(float(s), int(m)) for s, m in rows]
    if len(rows) != world:
        raise SearchError(f"measure() returned {len(rows)} results for {world} ranks; expected one per rank")
    return rows


def _fits(nbytes: int, budget: int | None) -> bool:
    return budget is None or nbytes <= budget


def _fastest_fitting(starts: list[Assignment], results: dict, rank: int, budget: int | None) -> Assignment:
    fitting = [plan for plan in starts if _fits(results[plan][rank][1], budget)]
    if not fitting:
        smallest = min(results[plan][rank][1] for plan in starts)
        raise SearchError(f"no plan fits rank {rank}'s memory_budget={budget} bytes: the smallest candidate saves "
                          f"{smallest} activation bytes per step. Raise the budget or lower that rank's batch size.")
    return min(fitting, key=lambda plan: (results[plan][rank][0], results[plan][rank][1]))  # ties: the earlier
