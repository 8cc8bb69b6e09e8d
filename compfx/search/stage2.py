"""CoMP Stage 2 (Algorithm 2): time the "other" ops between Stage-1 ops whose precisions differ.

The Stage-1 winner fixes every whitelist and blacklist op. Between two
consecutive such ops of different precision (a segment), the "other" ops
decide where the one cast between them goes; Algorithm 2 enumerates them and
times each candidate on a few batches (``evaluator.time_step``). The cheapest
wins. Nothing here changes a Stage-1 op, so no new loss risk arises beyond
where casts sit; :func:`compfx.search.convergence.check_winner` checks anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import product
from typing import Sequence

from ..errors import PlanFailedError, SearchError
from ..plan import Assignment
from ..vocabulary import Precision, SampleStatus, Stage
from .outcome import Outcome, ProgramIndex, Reporter, checked_cost, failure_reason, note
from .space import SearchSpace

__all__ = ["Segment", "Stage2Result", "stage2_segments", "algorithm2_candidates", "run_stage2"]

_LOW, _FP32 = Precision.LOW, Precision.FP32


@dataclass(frozen=True)
class Segment:
    """Ops strictly between two consecutive Stage-1 positions (or a boundary) whose precisions differ."""

    start: int
    end: int
    inner: tuple[int, ...]


def stage2_segments(space: SearchSpace, plan: Assignment) -> list[Segment]:
    """Segments that Algorithm 2 enumerates for the Stage-1 winner ``plan``.

    The paper adds boundaries -1 and ``len - 1`` to Stage1_OP_list and counts
    ``2**(end - start)`` strings per segment, which takes in the op at ``end``.
    We enumerate the ops *strictly* inside each segment (so a Stage-1 op is never
    changed) and put the right boundary at ``len`` instead, so the ops after the
    last Stage-1 op are still covered, as in the paper. Both boundaries stand for
    FP32: the model's inputs, and the outputs that the FP32 loss reads.

    >>> from compfx.vocabulary import Category as C
    >>> space = SearchSpace((C.WHITELIST, C.OTHER, C.OTHER, C.BLACKLIST), (False,) * 4, range(4))
    >>> stage2_segments(space, Assignment.parse("0ff1"))
    [Segment(start=0, end=3, inner=(1, 2))]
    """
    space.check(plan)
    cuts = [-1, *space.stage1_positions, len(space)]

    def precision(i: int) -> Precision:  # an FP8 op takes and gives FP32 (cast_policy.precision_dtype)
        return _FP32 if i in (-1, len(space)) or plan[i] is Precision.FP8 else plan[i]

    segments = []
    for start, end in zip(cuts, cuts[1:]):
        inner = tuple(range(start + 1, end))
        if inner and precision(start) != precision(end):
            segments.append(Segment(start, end, inner))
    return segments


def algorithm2_candidates(plan: Assignment, segment: Segment) -> list[Assignment]:
    """The ``2**n`` plans of Algorithm 2 for one segment, in binary counting order."""
    candidates = []
    for chosen in product((_LOW, _FP32), repeat=len(segment.inner)):
        candidate = list(plan)
        for i, precision in zip(segment.inner, chosen):
            candidate[i] = precision
        candidates.append(Assignment(candidate))
    return candidates


@dataclass
class Stage2Result:
    best: Outcome
    base: Outcome
    samples: list[Outcome]
    segments: list[Segment]


class _Stage2:
    def __init__(self, evaluator, report: Reporter | None):
        self.evaluator = evaluator
        self.report = report or (lambda record: None)
        self.samples: list[Outcome] = []
        self.known: dict[Assignment, Outcome] = {}
        self.programs = ProgramIndex(evaluator.program)

    def sample(self, plan: Assignment, reason: str = "") -> Outcome:
        if plan in self.known:
            return self.known[plan]
        twin = self.programs.earlier_twin(plan)
        if twin is not None:  # the same program was timed: its outcome stands (and wins the tie, being earlier)
            self.known[plan] = self.known[twin]
            note(self.report, Stage.STAGE2, f"plan {plan} runs the same program as {twin}, already timed: not "
                 "timed again", plan=str(plan), same_as=str(twin))
            return self.known[plan]
        start = time.perf_counter()
        outcome = Outcome(plan, SampleStatus.ACCEPTED, reason=reason)
        try:
            outcome.seconds = float(self.evaluator.time_step(plan))
            outcome.cost = checked_cost(self.evaluator, plan, outcome.seconds)
        except PlanFailedError as error:
            outcome.status, outcome.reason = SampleStatus.ERROR, failure_reason(error)
        outcome.duration = time.perf_counter() - start
        self.known[plan] = outcome
        self.samples.append(outcome)
        self.report(outcome.record(Stage.STAGE2))
        return outcome

    @staticmethod
    def cheapest(outcomes: Sequence[Outcome]) -> Outcome:
        """Lowest cost; the earliest wins a tie (``min`` keeps the first)."""
        return min(outcomes, key=lambda o: o.cost)


def run_stage2(space: SearchSpace, base: Assignment, evaluator, *, budget: int = 32,
               report: Reporter | None = None) -> Stage2Result:
    """CoMP Algorithm 2 on the Stage-1 winner ``base``; ``budget`` caps timed candidates (the winner included).

    Candidates are the winner itself, then each differing segment's ``2**n``
    plans with the rest as in the winner (Algorithm 2). A segment whose
    ``2**n`` does not fit the budget left is searched greedily instead (each op
    tried at low and FP32 in turn, keeping the cheaper). Last, when two or more
    segments improved, their best plans are combined into one more candidate.
    The cheapest candidate wins. With no segment at all the winner stands
    untimed (``samples`` is empty and a note says why). A candidate whose
    program (``evaluator.program``) was already timed (e.g. follow ops set to
    the dtype that reaches them anyway) takes that outcome instead of being
    timed, and does not count against ``budget``.

    >>> from compfx.search.evaluator import FunctionEvaluator
    >>> from compfx.vocabulary import Category as C
    >>> space = SearchSpace((C.WHITELIST, C.OTHER, C.BLACKLIST), (False,) * 3, ("a", "b", "c"))
    >>> timer = FunctionEvaluator(time_step=lambda plan: 1.0 - 0.1 * str(plan).count("0"))
    >>> str(run_stage2(space, Assignment.parse("0f1"), timer).best.plan)
    '001'
    """
    if budget < 1:
        raise SearchError(f"stage2_budget={budget}; expected at least 1 (the Stage-1 winner itself)")
    segments = stage2_segments(space, base)
    if not segments:  # no alternative to compare with: timing the winner alone would decide nothing
        note(report, Stage.STAGE2, "no segment lies between Stage-1 ops of differing precision: the Stage-1 "
             "winner stands, with nothing to time")
        winner = Outcome(base, SampleStatus.ACCEPTED, reason="Stage-1 winner")
        return Stage2Result(winner, winner, [], [])
    search = _Stage2(evaluator, report)
    winner = search.sample(base, "Stage-1 winner")
    improved: list[tuple[Segment, Assignment]] = []
    for segment in segments:
        left = budget - len(search.samples)
        if left <= 0:
            note(report, Stage.STAGE2, f"stage2_budget={budget} spent: segment ({segment.start}, {segment.end}) "
                 "keeps the Stage-1 precisions (follow)", segment=[segment.start, segment.end])
            continue
        if 2 ** len(segment.inner) <= left:
            tried = [search.sample(plan, f"segment ({segment.start}, {segment.end})")
                     for plan in algorithm2_candidates(base, segment)]
        else:
            tried = _greedy(space, search, base, segment, budget, report)
        best = search.cheapest([winner, *tried])
        if best is not winner:
            improved.append((segment, best.plan))
    if len(improved) > 1 and len(search.samples) < budget:
        combined = list(base)
        for segment, plan in improved:
            for i in segment.inner:
                combined[i] = plan[i]
        search.sample(Assignment(combined), "best plan of every segment, combined")
    return Stage2Result(search.cheapest(search.samples), winner, search.samples, segments)


def _greedy(space: SearchSpace, search: _Stage2, base: Assignment, segment: Segment, budget: int,
            report: Reporter | None) -> list[Outcome]:
    note(report, Stage.STAGE2, f"segment ({segment.start}, {segment.end}) has {len(segment.inner)} ops: 2^"
         f"{len(segment.inner)} plans exceed the budget left, so its ops are tried one at a time",
         segment=[segment.start, segment.end])
    current = search.known[base]
    tried = []
    for position, i in enumerate(segment.inner):
        for precision in (_LOW, _FP32):
            if len(search.samples) >= budget:
                untried = [space.name(j) for j in segment.inner[position:]]
                note(report, Stage.STAGE2, f"stage2_budget={budget} spent inside segment ({segment.start}, "
                     f"{segment.end}); {len(untried)} ops keep 'follow'", untried=untried)
                return tried
            outcome = search.sample(current.plan.replaced([i], precision),
                                    f"segment ({segment.start}, {segment.end}), greedy")
            tried.append(outcome)
            if outcome.cost < current.cost:
                current = outcome
    return tried
