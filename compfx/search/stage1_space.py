"""Stage 1's candidates, and how Stage 1 covers them within its budget.

A Stage-1 plan fixes Tensor-Core-eligible whitelist ops to low and "other"
ops to follow; the adjustable ops (blacklist, and whitelist without Tensor
Cores) are tried at each of their levels (:meth:`SearchSpace.levels`: both
precisions, and FP8 where an op can run it). When the plans (``2**k`` without
FP8) exceed the budget, the space is reduced (:func:`stage1_plan_space` says
how) and a note is logged. Candidates run most-low first, in a fixed order.
"""

from __future__ import annotations

from itertools import product
from typing import Protocol, Sequence

from ..plan import AMP_PRECISION, Assignment
from ..vocabulary import Category, Precision, Stage
from .outcome import Outcome, Reporter, note
from .space import SearchSpace
from .tied_blocks import end_candidates, untie_end_blocks

__all__ = ["stage1_plan", "stage1_plan_space", "stage1_candidates", "try_candidates", "Stage1Trials"]

_LOW = Precision.LOW


def stage1_plan(space: SearchSpace, choice: dict[int, Precision]) -> Assignment:
    """A Stage-1 plan: TC whitelist ops low, "other" ops follow, adjustable ops from ``choice``.

    An adjustable op left out of ``choice`` keeps autocast's precision.
    """
    plan = []
    for i, category in enumerate(space.categories):
        if i in choice:
            plan.append(choice[i])
        elif category is Category.WHITELIST and space.tc_eligible[i]:
            plan.append(_LOW)
        else:
            plan.append(AMP_PRECISION[category])
    return Assignment(plan)


def stage1_plan_space(space: SearchSpace, budget: int) -> str:
    """How Stage 1 covers the ``k`` decisions within ``budget`` samples (FP32 baseline not counted).

    A decision is one searched op, or the ops tied across the repeats of a
    block (:attr:`SearchSpace.decisions`, ``tie_blocks``).

    * ``"exhaustive"``: every combination fits (``2**k`` without FP8), as in the paper.
    * ``"grouped"``: ops of the same kind and input shapes share one decision;
      all group combinations are run, then the remaining budget refines op by
      op (try its other levels; keep a change when it gives a new best plan).
    * ``"greedy"``: even the groups' combinations are over budget; start from
      autocast's choice and change one op at a time, in graph order, keeping
      changes that give a new best.
    """
    budget = _strategy_budget(space, budget)
    if space.plan_count(space.decisions) <= budget:
        return "exhaustive"
    if space.plan_count(_merged(space.decision_groups)) <= budget:
        return "grouped"
    return "greedy"


def _merged(groups) -> list[tuple[int, ...]]:
    """Each group of decisions as one decision (the ops of all of them)."""
    return [tuple(i for decision in group for i in decision) for group in groups]


#: How "low" a precision is, for ordering candidates: FP8 below the low dtype below FP32.
_LOWNESS = {Precision.FP8: 2, Precision.LOW: 1}


def _most_low_first(choices: list[dict[int, Precision]]) -> list[dict[int, Precision]]:
    # Plans with more low-precision ops are usually the fast ones where low
    # precision pays; running them first sets a low bar that prunes later samples sooner.
    return sorted(choices, key=lambda c: -sum(_LOWNESS.get(p, 0) for p in c.values()))


def stage1_candidates(space: SearchSpace, groups: Sequence[Sequence[int]] | None = None) -> list[Assignment]:
    """Every combination of the searched ops' levels (or of ``groups`` of ops), most-low first.

    >>> from compfx.vocabulary import Category as C
    >>> space = SearchSpace((C.WHITELIST, C.OTHER, C.BLACKLIST), (False,) * 3, ("a", "b", "c"))
    >>> [str(plan) for plan in stage1_candidates(space)]
    ['0f0', '0f1', '1f0', '1f1']
    >>> [str(plan) for plan in stage1_candidates(SearchSpace(space.categories, (True,) * 3, space.groups,
    ...                                                      fp8_eligible=(True, False, False)))]
    ['8f0', '8f1', '0f0', '0f1']
    """
    groups = space.decisions if groups is None else groups
    choices = [{i: p for members, p in zip(groups, chosen) for i in members}
               for chosen in product(*(space.levels(members[0]) for members in groups))]
    return [stage1_plan(space, c) for c in _most_low_first(choices)]


def _alternatives(space: SearchSpace, plan: Assignment, decision: Sequence[int]) -> list[Assignment]:
    """``plan`` with the ops of ``decision`` at each of their other Stage-1 levels."""
    return [plan.replaced(decision, level) for level in space.levels(decision[0]) if level is not plan[decision[0]]]


# -- covering the space within the budget ---------------------------------------------------

class Stage1Trials(Protocol):
    """What the budget strategies ask of Stage 1: the plans seen and sampled, the incumbent, and a trial."""

    seen: set[Assignment]
    samples: list[Outcome]  # every sample so far, the FP32 baseline first
    best: Outcome | None  # the incumbent

    def nothing_can_win(self, candidates: Sequence[Assignment]) -> bool: ...

    def try_plan(self, plan: Assignment) -> bool: ...


def try_candidates(space: SearchSpace, search: Stage1Trials, mode: str, budget: int,
                   report: Reporter | None) -> None:
    """Try the candidates after the first incumbent, as ``mode`` (:func:`stage1_plan_space`) covers the space."""
    covering = _strategy_budget(space, budget)
    if mode == "exhaustive":
        _enumerate(search, stage1_candidates(space))
    elif mode == "grouped":
        _grouped(space, search, covering, report)
    else:
        _greedy(space, search, covering, report)
    if covering < budget:
        untie_end_blocks(space, search, budget, report)


def _strategy_budget(space: SearchSpace, budget: int) -> int:
    """The budget the strategies cover the space with: ``budget`` less what trying tied decisions in the end repeats
    takes (:func:`~compfx.search.tied_blocks.end_candidates`), when that leaves some."""
    ends = end_candidates(space)
    return budget - ends if ends < budget else budget


def _enumerate(search: Stage1Trials, candidates: Sequence[Assignment]) -> bool:
    """Try ``candidates`` in order, stopping when the profiles show none left can win; False when it stopped."""
    for position, plan in enumerate(candidates):
        if plan in search.seen:
            continue
        if search.nothing_can_win(candidates[position:]):
            return False
        search.try_plan(plan)
    return True


def _budget_left(search: Stage1Trials, budget: int) -> int:
    return budget - (len(search.samples) - 1)


def _grouped(space: SearchSpace, search: Stage1Trials, budget: int, report: Reporter | None) -> None:
    grouped = space.decision_groups
    groups = _merged(grouped)
    note(report, Stage.STAGE1, f"{len(space.decisions)} adjustable ops give "
         f"{space.plan_count(space.decisions)} plans, over "
         f"stage1_budget={budget}: ops of the same kind and input shapes share one decision ({len(groups)} groups, "
         f"{space.plan_count(groups)} plans), then the rest of the budget refines op by op", mode="grouped",
         groups=[[space.name(i) for i in g] for g in groups])
    candidates = stage1_candidates(space, groups)
    if not _enumerate(search, candidates):
        return
    best = search.best
    current = best.plan if best is not None and best is not search.samples[0] else candidates[-1]
    _refine(space, search, budget, report, current, [d for group in grouped if len(group) > 1 for d in group])


def _greedy(space: SearchSpace, search: Stage1Trials, budget: int, report: Reporter | None) -> None:
    note(report, Stage.STAGE1, f"even the {len(space.decision_groups)} groups of same-kind, same-shape "
         f"ops exceed stage1_budget={budget}: starting from autocast's choice and changing one op at a time",
         mode="greedy")
    start = stage1_plan(space, {})  # AMP's plan, the first incumbent (already sampled)
    _refine(space, search, budget, report, start, list(space.decisions))


def _refine(space: SearchSpace, search: Stage1Trials, budget: int, report: Reporter | None,
            current: Assignment, order: list[tuple[int, ...]]) -> None:
    """Change one decision at a time from ``current`` (each of its other levels); keep a change that gives a new
    best."""
    for position, decision in enumerate(order):
        start = current
        for candidate in _alternatives(space, start, decision):
            if _budget_left(search, budget) <= 0:
                untried = [space.name(j) for d in order[position:] for j in d]
                note(report, Stage.STAGE1, f"stage1_budget={budget} spent: {len(untried)} ops were not tried alone "
                     "and keep the precision of the best plan found", untried=untried)
                return
            if search.try_plan(candidate):
                current = candidate
