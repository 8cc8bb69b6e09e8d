"""CoMP Stage 2 (Algorithm 2): time the "other" ops between Stage-1 ops whose precisions differ.

The Stage-1 winner fixes every whitelist and blacklist op. Between two
consecutive such ops of different precision (a segment), the "other" ops
decide where the one cast between them goes; Algorithm 2 enumerates them and
times each candidate on a few batches (``evaluator.time_step``). A segment's
``2**n`` plans are built one at a time and never more than ``stage2_budget``
allows (:func:`segment_candidates`): a segment whose plans do not fit is
searched greedily, and a note (``SEGMENT_NOT_ENUMERATED``) says how many of its
plans were tried. A candidate
replaces the incumbent (first the Stage-1 winner) only under the decision rule
(:mod:`compfx.search.compare`: faster by more than a margin, confirmed by a
duel of paired, interleaved steps). Nothing here changes a Stage-1 op, so no new loss risk arises beyond
where casts sit; :func:`compfx.search.convergence.check_winner` checks anyway.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import islice, product
from typing import Callable, Iterable, Iterator, Sequence

from ..errors import PlanFailedError, SearchError
from ..plan import Assignment
from ..vocabulary import Precision, SampleStatus, Stage
from .compare import COMP_RULE, DecisionRule, duel, log_duel
from .log import NOTHING_CAN_WIN, SAVED_BYTES, SEGMENT_NOT_ENUMERATED
from .outcome import Outcome, PriceVersion, ProgramIndex, Reporter, checked_cost, failure_reason, note
from .space import SearchSpace

__all__ = ["Segment", "Stage2Result", "stage2_segments", "algorithm2_candidates", "greedy_candidates",
           "segment_candidates", "run_stage2"]

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


def algorithm2_candidates(plan: Assignment, segment: Segment) -> Iterator[Assignment]:
    """The ``2**n`` plans of Algorithm 2 for one segment, in binary counting order, built one at a time (a segment
    of many ops has more plans than can be listed; :func:`segment_candidates` takes what the budget allows)."""
    for chosen in product((_LOW, _FP32), repeat=len(segment.inner)):
        candidate = list(plan)
        for i, precision in zip(segment.inner, chosen):
            candidate[i] = precision
        yield Assignment(candidate)


def greedy_candidates(plan: Assignment, segment: Segment) -> Iterator[Assignment]:
    """Each op of ``segment`` alone at low, then at FP32, the rest as in ``plan``: the greedy search's order."""
    for i in segment.inner:
        for precision in (_LOW, _FP32):
            yield plan.replaced([i], precision)


def fits(segment: Segment, left: int) -> bool:
    """Do Algorithm 2's ``2**n`` plans for ``segment`` fit in ``left`` timings (else it is searched greedily)?"""
    return 2 ** len(segment.inner) <= left


def segment_candidates(plan: Assignment, segment: Segment, left: int) -> Iterator[Assignment]:
    """What Stage 2 may time for ``segment`` with ``left`` timings of ``stage2_budget`` left, built lazily and never
    more than ``left`` of them: Algorithm 2's ``2**n`` plans where they fit, else the first ``left`` of the
    greedy order (each op alone at low, then at FP32). This is also all the cost model prices for the segment.

    >>> base = Assignment.parse("0" + "f" * 30 + "1")  # a segment of 30 ops: 2**30 plans
    >>> segment = Segment(0, 31, tuple(range(1, 31)))
    >>> [str(p)[:4] for p in segment_candidates(base, segment, 3)]
    ['00ff', '01ff', '0f0f']
    >>> [str(p) for p in segment_candidates(Assignment.parse("0ff1"), Segment(0, 3, (1, 2)), 4)]
    ['0001', '0011', '0101', '0111']
    """
    if fits(segment, left):
        yield from algorithm2_candidates(plan, segment)
    else:
        yield from islice(greedy_candidates(plan, segment), max(left, 0))


@dataclass
class Stage2Result:
    best: Outcome
    base: Outcome
    samples: list[Outcome]
    segments: list[Segment]


class _Stage2:
    def __init__(self, evaluator, report: Reporter | None, rule: DecisionRule = COMP_RULE,
                 memory_budget: int | None = None, bound: Callable[[Assignment], float] | None = None,
                 predict: Callable[[Assignment], float] | None = None,
                 bound_against: Callable[[Assignment, Assignment], float] | None = None,
                 price_version: Callable[[], int] | None = None):
        self.evaluator, self.rule, self.memory_budget = evaluator, rule, memory_budget
        self.bound, self.predict = bound, predict or bound
        self.bound_against = bound_against
        self.report = report or (lambda record: None)
        self.samples: list[Outcome] = []
        self.known: dict[Assignment, Outcome] = {}
        self.programs = ProgramIndex(evaluator.program)
        self._bytes: dict[Assignment, int | None] = {}
        self._verdicts: dict[tuple[Assignment, Assignment], bool] = {}
        self._predicted: dict[tuple[Assignment, Assignment], float] = {}  # (incumbent, plan) -> predicted_cost
        self.prices = PriceVersion(price_version)

    def saved_bytes(self, plan: Assignment) -> int | None:
        if plan not in self._bytes:
            try:
                found = self.evaluator.saved_bytes(plan)
            except PlanFailedError:
                found = None  # its timing will say why
            self._bytes[plan] = None if found is None else int(found)
        return self._bytes[plan]

    def saves_less(self, plan: Assignment, than: Assignment) -> bool:
        mine, theirs = self.saved_bytes(plan), self.saved_bytes(than)
        return mine is not None and theirs is not None and mine < theirs

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
        nbytes = self.saved_bytes(plan)
        if nbytes is not None:
            outcome.extra[SAVED_BYTES] = nbytes
        if nbytes is not None and self.memory_budget is not None and nbytes > self.memory_budget:
            outcome.status = SampleStatus.REJECTED
            outcome.reason = f"saves {nbytes} activation bytes for backward, over memory_budget={self.memory_budget}"
        else:
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

    def replaces(self, incumbent: Outcome, candidate: Outcome) -> bool:
        """Does ``candidate`` replace ``incumbent`` under the rule (the screen on their timings, then a duel)?"""
        if candidate is incumbent or candidate.status is not SampleStatus.ACCEPTED:
            return False
        saves_less = self.saves_less(candidate.plan, incumbent.plan)
        if not self.rule.passes_screen(candidate.cost, incumbent.cost, saves_less=saves_less):
            return False
        if not self.rule.rounds:
            return True
        key = (incumbent.plan, candidate.plan)
        if key not in self._verdicts:
            try:
                verdict = duel(self.evaluator, self.rule, incumbent.plan, candidate.plan, saves_less=saves_less)
            except PlanFailedError as error:
                note(self.report, Stage.STAGE2, f"duel of {candidate.plan} with incumbent {incumbent.plan} failed "
                     f"({failure_reason(error)}); incumbent kept", plan=str(candidate.plan))
                self._verdicts[key] = False
            else:
                log_duel(self.report, Stage.STAGE2, verdict, incumbent.plan, candidate.plan, self.rule.rounds)
                self._verdicts[key] = verdict.replaces
        return self._verdicts[key]

    def chain(self, incumbent: Outcome, candidates: Sequence[Outcome]) -> Outcome:
        """The incumbent after each of ``candidates`` in turn challenged it."""
        for candidate in candidates:
            if self.replaces(incumbent, candidate):
                incumbent = candidate
        return incumbent

    def _priced(self, estimate, plan: Assignment) -> float:
        seconds = float(estimate(plan))
        return checked_cost(self.evaluator, plan, seconds) if math.isfinite(seconds) else math.nan

    def predicted_cost(self, incumbent: Outcome, plan: Assignment) -> float:
        """The figure that says whether ``plan`` can beat ``incumbent``: the first of its lower bounds (the cheap
        one, then the one read off the incumbent's priced graph) that is at the bar or over, else its full
        prediction (a rewrite); NaN when it cannot be priced. Each figure is worked out once."""
        key = (incumbent.plan, plan)
        if self.prices.moved():  # evidence scaled the prices down: price again
            self._predicted.clear()
        if key not in self._predicted:
            self._predicted[key] = self._predicted_cost(incumbent, plan)
        return self._predicted[key]

    def _predicted_cost(self, incumbent: Outcome, plan: Assignment) -> float:
        bound = self._priced(self.bound, plan)
        reference = self._priced(self.predict, incumbent.plan)
        if not math.isfinite(reference) or self.predict is self.bound:
            return bound
        bar = self.rule.bar(reference, saves_less=False)
        if math.isfinite(bound) and bound >= bar:
            return bound
        if self.bound_against is not None:
            against = self._priced(lambda p: self.bound_against(p, incumbent.plan), plan)
            bound = against if math.isfinite(against) else bound
        if not math.isfinite(bound) or bound >= bar:
            return bound
        return self._priced(self.predict, plan)

    def cannot_win(self, incumbent: Outcome, plan: Assignment) -> bool:
        """Does the cost model show ``plan`` cannot beat ``incumbent`` by the margin (its predicted step cost against
        the bar on the incumbent's predicted step cost, like for like; the cheap bound first)? Never for a plan or
        incumbent that cannot be priced."""
        if self.bound is None:
            return False
        reference, predicted = self._priced(self.predict, incumbent.plan), self.predicted_cost(incumbent, plan)
        return (math.isfinite(reference) and math.isfinite(predicted)
                and predicted >= self.rule.bar(reference, saves_less=False))

    def nothing_can_win(self, incumbent: Outcome, candidates: Iterable[Assignment], what: str) -> bool:
        """True (and a note) when the cost model shows none of ``candidates`` can beat ``incumbent`` by the margin.

        ``candidates`` is walked lazily: the first plan that may win ends the walk, so no more are built or priced."""
        if self.bound is None or incumbent.status is not SampleStatus.ACCEPTED:
            return False
        priced, lowest = 0, math.inf
        for plan in candidates:
            if plan == incumbent.plan:
                continue
            if not self.cannot_win(incumbent, plan):
                return False
            priced, lowest = priced + 1, min(lowest, self.predicted_cost(incumbent, plan))
        if not priced:
            return False
        bar = self.rule.bar(self._priced(self.predict, incumbent.plan), saves_less=False)
        note(self.report, Stage.STAGE2, f"{what} not timed: the profiles show that none of its {priced} "
             f"plans can beat the incumbent {incumbent.plan} by more than the margin (the lowest of their "
             f"predicted step costs, {lowest:.6g}, is not below {bar:.6g}, {1 - self.rule.margin:g} x the "
             "incumbent's predicted step cost)", **{NOTHING_CAN_WIN: priced})
        return True


def run_stage2(space: SearchSpace, base: Assignment, evaluator, *, budget: int = 32,
               report: Reporter | None = None, rule: DecisionRule = COMP_RULE, memory_budget: int | None = None,
               bound: Callable[[Assignment], float] | None = None,
               predict: Callable[[Assignment], float] | None = None,
               bound_against: Callable[[Assignment, Assignment], float] | None = None,
               price_version: Callable[[], int] | None = None) -> Stage2Result:
    """CoMP Algorithm 2 on the Stage-1 winner ``base`` under the decision rule; ``budget`` caps timed candidates.

    Candidates are the winner itself, then each differing segment's ``2**n``
    plans with the rest as in the winner (Algorithm 2), each challenging the
    segment's incumbent under ``rule`` (:class:`~compfx.search.compare.DecisionRule`;
    the winner is the first incumbent). A segment whose ``2**n`` does not fit
    the budget left is searched greedily instead (each op tried at low and FP32
    in turn, keeping a change that wins), and a note
    (``SEGMENT_NOT_ENUMERATED``) says how many of its plans were tried. No more
    of a segment's plans are built or priced than the budget left could time
    (:func:`segment_candidates`). Last, when two or more segments
    improved, their best plans are combined into one more candidate; the final
    plan is the incumbent after each segment's best, then the combination,
    challenged the winner in turn. With no segment at all the winner stands
    untimed (``samples`` is empty and a note says why). A candidate whose
    program (``evaluator.program``) was already timed takes that outcome
    instead of being timed, and does not count against ``budget``. Plans over
    ``memory_budget`` are rejected untimed. With ``bound(plan)`` (a lower bound
    of the predicted step seconds) and ``predict(plan)`` (the prediction itself),
    a segment, or the whole stage, whose plans' bounds are all at the rule's bar
    on the Stage-1 winner's predicted step or over is not timed (a note says so); a plan whose bound is under
    that bar is priced in full, and its prediction decides. ``bound_against(plan, incumbent)`` is a tighter bound
    read off the incumbent's priced plan, used where it can be had. ``price_version()`` moves when the
    predictor's prices change mid-stage (a duel scaled them down): figures priced before are priced again.

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
    search = _Stage2(evaluator, report, rule, memory_budget, bound, predict, bound_against, price_version)
    untimed = Outcome(base, SampleStatus.ACCEPTED, reason="Stage-1 winner")
    # what each segment would price once the winner is timed: if none of it can win, the winner needs no timing
    every = (plan for segment in segments for plan in segment_candidates(base, segment, budget - 1))
    if search.nothing_can_win(untimed, every, "Stage 2"):
        for segment in segments:
            if not fits(segment, budget - 1):
                _not_enumerated(report, space, segment, budget, tried=0, why=_priced_greedy(segment, budget - 1))
        return Stage2Result(untimed, untimed, [], segments)
    winner = search.sample(base, "Stage-1 winner")
    improved: list[tuple[Segment, Outcome]] = []
    for segment in segments:
        best = _search_segment(space, search, base, winner, segment, budget, report)
        if best is not winner:
            improved.append((segment, best))
    candidates = [best for _, best in improved]
    if len(improved) > 1 and len(search.samples) < budget:
        combined = list(base)
        for segment, best in improved:
            for i in segment.inner:
                combined[i] = best.plan[i]
        candidates.append(search.sample(Assignment(combined), "best plan of every segment, combined"))
    return Stage2Result(search.chain(winner, candidates), winner, search.samples, segments)


def _search_segment(space: SearchSpace, search: _Stage2, base: Assignment, winner: Outcome, segment: Segment,
                    budget: int, report: Reporter | None) -> Outcome:
    """The incumbent after ``segment``'s candidates challenged ``winner``: Algorithm 2's ``2**n`` plans where they
    fit the budget left, else the greedy search; a segment not enumerated fully is noted."""
    what, left = f"segment ({segment.start}, {segment.end})", budget - len(search.samples)
    if left <= 0:
        _not_enumerated(report, space, segment, budget, tried=0, why="stage2_budget spent before it")
        return winner
    if search.nothing_can_win(winner, segment_candidates(base, segment, left), what):
        if not fits(segment, left):
            _not_enumerated(report, space, segment, budget, tried=0, why=_priced_greedy(segment, left))
        return winner
    if fits(segment, left):
        return search.chain(winner, [search.sample(plan, what) for plan in algorithm2_candidates(base, segment)])
    best, tried = _greedy(space, search, winner, segment, budget, report)
    _not_enumerated(report, space, segment, budget, tried=tried, why="its ops tried one at a time (greedy)")
    return best


def _priced_greedy(segment: Segment, left: int) -> str:
    priced = min(2 * len(segment.inner), left)
    return f"the profiles show that none of the greedy order's first {priced} plans can win"


def _not_enumerated(report: Reporter | None, space: SearchSpace, segment: Segment, budget: int, *, tried: int,
                    why: str) -> None:
    """Note that ``segment``'s ``2**n`` plans were not all tried: which ops, how many plans were, and why."""
    n = len(segment.inner)
    note(report, Stage.STAGE2, f"segment ({segment.start}, {segment.end}) not enumerated fully: {tried} of its 2^{n} "
         f"plans tried, {why} (stage2_budget={budget}; its {n} ops run from {space.name(segment.inner[0])} to "
         f"{space.name(segment.inner[-1])})",
         **{SEGMENT_NOT_ENUMERATED: {"segment": [segment.start, segment.end], "ops": n, "tried": tried}})


def _greedy(space: SearchSpace, search: _Stage2, winner: Outcome, segment: Segment, budget: int,
            report: Reporter | None) -> tuple[Outcome, int]:
    """Each op of ``segment`` at low, then at FP32, in turn, keeping a change that wins, while the budget lasts;
    returns the incumbent and how many candidates were tried."""
    current, tried = winner, 0
    for position, i in enumerate(segment.inner):
        for precision in (_LOW, _FP32):
            if len(search.samples) >= budget:
                untried = [space.name(j) for j in segment.inner[position:]]
                note(report, Stage.STAGE2, f"stage2_budget={budget} spent inside segment ({segment.start}, "
                     f"{segment.end}); {len(untried)} ops keep 'follow'", untried=untried)
                return current, tried
            outcome = search.sample(current.plan.replaced([i], precision),
                                    f"segment ({segment.start}, {segment.end}), greedy")
            tried += 1
            if search.replaces(current, outcome):
                current = outcome
    return current, tried
