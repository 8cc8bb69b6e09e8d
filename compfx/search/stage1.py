"""CoMP Stage 1 (Algorithm 1): one epoch per plan of the Stage-1 ops, kept only if its loss tracks FP32's.

An FP32 epoch gives ``loss_0`` (and is the fallback plan). Tensor-Core-eligible
whitelist ops are fixed to low and "other" ops to follow; the adjustable ops
(blacklist, and whitelist without Tensor Cores) are tried at both precisions.
With FP8 in the space (``SearchConfig(fp8=True)``), an op that can run FP8 also
tries it, as a third level (:meth:`SearchSpace.levels`); the guard is the same.
A plan is accepted when :func:`~compfx.search.convergence.is_accepted`; the
cheapest accepted plan wins, ties going to the earlier sample. When the plans
(``2**k`` without FP8) exceed the budget the space is reduced (:func:`stage1_plan_space` says how)
and a note is logged.

**Exact-safe pruning.** A sample stops as soon as its running cost,
``evaluator.cost(plan, seconds so far)``, reaches the best accepted cost (it
cannot win: costs only grow and ties go to the earlier sample), or as soon as
a batch loss is NaN/inf (the epoch mean cannot be finite). This is exact --
the same plan wins as without pruning -- provided ``cost`` never decreases as
the seconds grow, as every cost of the form "seconds times or plus something
that depends on the plan" does.

**Fewer samples.** A candidate whose program (``evaluator.program``) was
already sampled is not run again. With a cost model (``predict``), candidates
run cheapest-predicted first and those predicted over ``margin`` x the best
are skipped; ``early_stop`` also ends a sample whose measured pace projects it
over the best. These two are not exact: :func:`compfx.optimize` uses them only
with ``predictor="on"``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from itertools import product
from typing import Callable, Sequence

from ..errors import BadInputError, PlanFailedError, SearchError
from ..plan import AMP_PRECISION, Assignment
from ..vocabulary import Category, Precision, SampleStatus, Stage
from .convergence import is_accepted, loss_limit
from .log import STOPPED_EARLY
from .outcome import Outcome, ProgramIndex, Reporter, checked_cost, cost_unit, failure_reason, note
from .space import SearchSpace

__all__ = [
    "Stage1Result", "run_stage1", "stage1_plan", "stage1_plan_space", "stage1_candidates", "should_skip",
    "skip_message", "EARLY_STOP_MIN_BATCHES",
]

Predict = Callable[[Assignment], float]  # plan -> predicted seconds of one Stage-1 epoch

#: batches a Stage-1 sample runs before an early stop may judge its pace
EARLY_STOP_MIN_BATCHES = 3
_LOW = Precision.LOW


# -- candidates ------------------------------------------------------------------

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
    """How Stage 1 covers the ``k`` searched ops within ``budget`` samples (FP32 baseline not counted).

    * ``"exhaustive"``: every combination fits (``2**k`` without FP8), as in the paper.
    * ``"grouped"``: ops of the same kind and input shapes share one decision;
      all group combinations are run, then the remaining budget refines op by
      op (try its other levels; keep a change when it gives a new best plan).
    * ``"greedy"``: even the groups' combinations are over budget; start from
      autocast's choice and change one op at a time, in graph order, keeping
      changes that give a new best.
    """
    if space.plan_count([(i,) for i in space.searched]) <= budget:
        return "exhaustive"
    if space.plan_count(space.groups_of(space.searched)) <= budget:
        return "grouped"
    return "greedy"


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
    groups = [(i,) for i in space.searched] if groups is None else groups
    choices = [{i: p for members, p in zip(groups, chosen) for i in members}
               for chosen in product(*(space.levels(members[0]) for members in groups))]
    return [stage1_plan(space, c) for c in _most_low_first(choices)]


# -- the skip rule of the cost model ----------------------------------------------

def should_skip(predicted: float, best: float | None, margin: float = 1.25) -> bool:
    """Skip measuring a candidate predicted to cost more than ``margin`` times the best accepted one.

    A plan that cannot be priced (NaN) is never skipped.

    >>> should_skip(1.3, 1.0), should_skip(1.2, 1.0), should_skip(9.0, None), should_skip(float("nan"), 1.0)
    (True, False, False, False)
    """
    if margin < 1.0:
        raise BadInputError(f"margin={margin}; expected >= 1.0 (1.25 skips candidates predicted 25% slower).")
    return best is not None and predicted > margin * best


def skip_message(predicted: float, best: float, unit: str = "s") -> str:
    """The reason logged for a candidate the predictor skipped, in the costs' ``unit`` ("" for a cost function's).

    >>> skip_message(0.0123, 0.0045)
    'skipped (predicted 0.0123 s vs best 0.0045 s)'
    >>> skip_message(3.0, 1.0, unit="")
    "skipped (predicted cost 3 vs best 1, in cost_fn's units)"
    """
    if unit:
        return f"skipped (predicted {predicted:.3g} {unit} vs best {best:.3g} {unit})"
    return f"skipped (predicted cost {predicted:.3g} vs best {best:.3g}, in cost_fn's units)"


# -- sampling ----------------------------------------------------------------------

def _alternatives(space: SearchSpace, plan: Assignment, i: int) -> list[Assignment]:
    """``plan`` with op ``i`` at each of its other Stage-1 levels."""
    return [plan.replaced([i], level) for level in space.levels(i) if level is not plan[i]]


class _Stage1:
    """Runs samples and keeps the best accepted one; the strategies below decide what to run."""

    def __init__(self, evaluator, threshold: float, prune: bool, report: Reporter | None,
                 predict: Predict | None = None, margin: float = 1.25, bound: Predict | None = None,
                 early_stop: float | None = None):
        self.evaluator, self.threshold, self.prune = evaluator, threshold, prune
        self.report = report or (lambda record: None)
        self.predict, self.margin = predict, margin
        self.bound = bound if predict is not None else None
        self.early_stop = early_stop
        self.predicted: dict[Assignment, float] = {}  # plan -> predicted cost
        self.bounds: dict[Assignment, float] = {}  # plan -> cost at the lower bound of the predicted seconds
        self.samples: list[Outcome] = []
        self.seen: set[Assignment] = set()
        self.programs = ProgramIndex(evaluator.program)
        self.best: Outcome | None = None
        self.loss0: float | None = None

    def cost(self, plan: Assignment, seconds: float) -> float:
        return checked_cost(self.evaluator, plan, seconds)

    def sample(self, plan: Assignment) -> Outcome:
        """Run one epoch under ``plan``, stopping early when pruning allows it."""
        start = time.perf_counter()
        outcome = Outcome(plan, SampleStatus.REJECTED)
        epoch = None
        try:
            epoch = self.evaluator.run_epoch(plan)
            outcome.artifact = self._consume(epoch, outcome)
        except PlanFailedError as error:  # this plan failed: reject it, keep searching
            outcome.status, outcome.reason = SampleStatus.ERROR, failure_reason(error)
        finally:
            if epoch is not None and hasattr(epoch, "close"):
                epoch.close()  # restores the state when the sample stopped early
            outcome.duration = time.perf_counter() - start
        return outcome

    def _consume(self, epoch, outcome: Outcome):
        total = 0.0
        while True:
            try:
                loss, seconds = next(epoch)
            except StopIteration as stop:
                artifact = stop.value
                break
            outcome.batch_losses.append(float(loss))
            outcome.batch_seconds.append(float(seconds))
            outcome.batches += 1
            outcome.seconds += seconds
            total += loss
            if self.prune and not math.isfinite(loss):
                outcome.status, outcome.loss = SampleStatus.PRUNED, float(loss)
                outcome.reason = f"loss became {loss} at batch {outcome.batches}; the epoch mean cannot be finite"
                return None
            if self.prune and self.best is not None:
                running = self.cost(outcome.plan, outcome.seconds)
                if running >= self.best.cost:
                    outcome.status, outcome.cost = SampleStatus.PRUNED, running
                    outcome.reason = (f"running cost {running:.6g} after {outcome.batches} batches already "
                                      f">= best accepted cost {self.best.cost:.6g} ({self.best.plan})")
                    return None
                if self._stopped_early(outcome):
                    return None
        if outcome.batches == 0:
            raise SearchError("the sample loader yielded no batches; Stage 1 needs at least one batch per epoch")
        outcome.loss = total / outcome.batches
        outcome.cost = self.cost(outcome.plan, outcome.seconds)
        return artifact

    def baseline(self, plan: Assignment) -> Outcome:
        outcome = self.sample(plan)
        if outcome.status is SampleStatus.ERROR or outcome.loss is None or not math.isfinite(outcome.loss):
            self.report(outcome.record(Stage.STAGE1))
            raise SearchError(
                f"the FP32 baseline epoch failed ({outcome.reason or f'loss {outcome.loss}'}); the search compares "
                "every plan with it. Check that the model trains in FP32 with this loader, loss_fn and optimizer.")
        outcome.status, outcome.reason = SampleStatus.ACCEPTED, "FP32 baseline (loss_0)"
        self.loss0, self.best = outcome.loss, outcome
        self.samples.append(outcome)
        self.seen.add(plan)
        self.programs.earlier_twin(plan)  # the baseline's program is the first recorded
        self.report(outcome.record(Stage.STAGE1))
        return outcome

    def predicted_cost(self, plan: Assignment) -> float | None:
        """``cost(plan, predicted epoch seconds)``; None without a predictor, NaN when it cannot price ``plan``."""
        return None if self.predict is None else self._priced(self.predict, self.predicted, plan)

    def bound_cost(self, plan: Assignment) -> float:
        """``cost(plan, lower bound of the predicted seconds)``: the full prediction when there is no bound."""
        if self.bound is None:
            return self.predicted_cost(plan)
        return self._priced(self.bound, self.bounds, plan)

    def _priced(self, estimate: Predict, cache: dict[Assignment, float], plan: Assignment) -> float:
        """``cost(plan, estimate(plan))``, computed once per plan; NaN when ``plan`` cannot be priced."""
        if plan not in cache:
            seconds = float(estimate(plan))
            cache[plan] = self.cost(plan, seconds) if math.isfinite(seconds) else math.nan
        return cache[plan]

    def by_prediction(self, candidates: Sequence[Assignment]) -> list[Assignment]:
        """Candidates cheapest-predicted first (stable; by the bound when there is one), or as given."""
        if self.predict is None:
            return list(candidates)

        def key(plan: Assignment) -> tuple[bool, float]:
            value = self.bound_cost(plan)  # a plan that cannot be priced (NaN) goes after those that can
            return (not math.isfinite(value), value if math.isfinite(value) else 0.0)
        return sorted(candidates, key=key)

    def skipped(self, plan: Assignment) -> bool:
        """Log and skip ``plan`` when its predicted cost exceeds ``margin`` x the best measured accepted cost.

        The cheap lower bound is tried first: when even it is over, the full
        prediction (which can only be higher) is not computed.
        """
        if self.predict is None or self.best is None:
            return False
        predicted = self.bound_cost(plan)
        name = "predicted_cost" if self.bound is None else "predicted_cost_lower_bound"  # which figure was over
        if not should_skip(predicted, self.best.cost, self.margin):
            predicted, name = self.predicted_cost(plan), "predicted_cost"
            if not should_skip(predicted, self.best.cost, self.margin):
                return False
        outcome = Outcome(plan, SampleStatus.SKIPPED, reason=skip_message(predicted, self.best.cost, cost_unit(self.evaluator)),
                          extra={name: predicted})
        self.report(outcome.record(Stage.STAGE1))
        return True

    def _same_program_sampled(self, plan: Assignment) -> bool:
        """True (and a note) when ``plan`` runs a program already sampled: its epoch would be a replica.

        E.g. the Stage-1 plan with every adjustable op FP32 is the FP32 baseline
        whenever its "follow" ops only ever see FP32 inputs.
        """
        first = self.programs.earlier_twin(plan)
        if first is None:
            return False
        note(self.report, Stage.STAGE1, f"plan {plan} runs the same program as {first}, already sampled: not run "
             "again", plan=str(plan), same_as=str(first))
        return True

    def _stopped_early(self, outcome: Outcome) -> bool:
        """Stop a sample whose pace, batch for batch against the best plan's, projects it well over the best.

        Not exact (pruning is): the projection is the best plan's epoch seconds
        times the median per-batch ratio so far, after
        :data:`EARLY_STOP_MIN_BATCHES` batches; the sample stops when that
        projected cost exceeds the best accepted cost by more than ``early_stop``.
        """
        best, k = self.best, outcome.batches
        if self.early_stop is None or k < EARLY_STOP_MIN_BATCHES or len(best.batch_seconds) < k:
            return False
        ratios = [mine / theirs for mine, theirs in zip(outcome.batch_seconds, best.batch_seconds) if theirs > 0]
        if len(ratios) < EARLY_STOP_MIN_BATCHES:
            return False
        projected = self.cost(outcome.plan, statistics.median(ratios) * best.seconds)
        if not projected > (1.0 + self.early_stop) * best.cost:
            return False
        outcome.status, outcome.cost = SampleStatus.PRUNED, projected
        outcome.extra[STOPPED_EARLY] = True
        outcome.reason = (f"stopped early: projected cost {projected:.6g} after {k} batches is over "
                          f"{1.0 + self.early_stop:g} x best accepted cost {best.cost:.6g} ({best.plan})")
        return True

    def try_plan(self, plan: Assignment) -> bool:
        """Sample ``plan`` (once); True when it became the new best."""
        if plan in self.seen:
            return False
        self.seen.add(plan)
        if self.skipped(plan) or self._same_program_sampled(plan):
            return False
        outcome = self.sample(plan)
        if self.predict is not None and math.isfinite(self.predicted_cost(plan)):
            outcome.extra["predicted_cost"] = self.predicted_cost(plan)
        became_best = False
        if outcome.status is SampleStatus.REJECTED:
            if is_accepted(outcome.loss, self.loss0, self.threshold):
                outcome.status = SampleStatus.ACCEPTED
                became_best = outcome.cost < self.best.cost
                outcome.reason = "new best" if became_best else f"accepted; best cost is {self.best.cost:.6g}"
            else:
                outcome.reason = (f"loss {outcome.loss:.6g} not below {loss_limit(self.loss0, self.threshold):.6g} "
                                  f"(loss_0 {self.loss0:.6g} x threshold {self.threshold})")
        if became_best:
            self.best.artifact = None  # only the best plan's trained state is kept
            self.best = outcome
        else:
            outcome.artifact = None  # only the best plan's trained state is kept
        self.samples.append(outcome)
        self.report(outcome.record(Stage.STAGE1))
        return became_best


@dataclass
class Stage1Result:
    best: Outcome
    baseline: Outcome
    samples: list[Outcome]
    mode: str

    @property
    def loss0(self) -> float:
        return self.baseline.loss


def run_stage1(space: SearchSpace, evaluator, *, threshold: float = 1.01, budget: int = 64, prune: bool = True,
               report: Reporter | None = None, predict: Predict | None = None, margin: float = 1.25,
               bound: Predict | None = None, early_stop: float | None = None) -> Stage1Result:
    """CoMP Algorithm 1 with exact-safe pruning; ``budget`` caps samples after the FP32 baseline.

    ``evaluator`` is an :class:`~compfx.search.evaluator.Evaluator`. With
    ``predict(plan) -> predicted epoch seconds`` (called only after the FP32
    baseline has run, so it may calibrate on it; NaN when it cannot price a
    plan, which then runs after the priced ones and is never skipped),
    candidates run cheapest predicted cost first, and a candidate whose
    ``cost(plan, predicted seconds)`` exceeds ``margin`` times the best measured
    accepted cost is not run: it is logged with status ``skipped``. Skipped
    plans do not count against ``budget``. ``margin=math.inf`` only reorders.
    An optional cheap ``bound(plan)`` that never exceeds ``predict(plan)``
    orders the candidates and skips without the full prediction when even the
    bound is over the margin (the logged figure is then that bound).
    ``early_stop`` (a fraction, e.g. 0.05; None: off) stops a sample once its
    measured pace projects it more than that fraction over the best accepted
    cost; unlike pruning it can misjudge a near-tie.

    >>> from compfx.search.evaluator import FunctionEvaluator
    >>> from compfx.vocabulary import Category as C
    >>> space = SearchSpace((C.WHITELIST, C.OTHER, C.BLACKLIST), (False,) * 3, ("a", "b", "c"))
    >>> def run_epoch(plan):                # fake: low precision halves the time, never hurts the loss
    ...     for _ in range(3):
    ...         yield 1.0, 1.0 - 0.25 * str(plan).count("0")
    >>> str(run_stage1(space, FunctionEvaluator(run_epoch=run_epoch)).best.plan)
    '0f0'
    """
    if budget < 1:
        raise SearchError(f"stage1_budget={budget}; expected at least 1 sample after the FP32 baseline")
    if not margin >= 1.0:
        raise SearchError(f"predictor margin={margin}; expected >= 1 (1.25 skips plans predicted 25% costlier)")
    if early_stop is not None and not early_stop >= 0:
        raise SearchError(f"early_stop={early_stop}; expected a fraction >= 0 (0.05: stop samples projected "
                          "5% over the best) or None")
    search = _Stage1(evaluator, threshold, prune, report, predict, margin, bound, early_stop)
    search.baseline(space.fp32_plan)
    mode = stage1_plan_space(space, budget)
    if mode == "exhaustive":
        for plan in search.by_prediction(stage1_candidates(space)):
            search.try_plan(plan)
    elif mode == "grouped":
        _grouped(space, search, budget, report)
    else:
        _greedy(space, search, budget, report)
    return Stage1Result(search.best, search.samples[0], search.samples, mode)


def _budget_left(search: _Stage1, budget: int) -> int:
    return budget - (len(search.samples) - 1)


def _grouped(space: SearchSpace, search: _Stage1, budget: int, report: Reporter | None) -> None:
    groups = space.groups_of(space.searched)
    note(report, Stage.STAGE1, f"{len(space.searched)} adjustable ops give "
         f"{space.plan_count([(i,) for i in space.searched])} plans, over "
         f"stage1_budget={budget}: ops of the same kind and input shapes share one decision ({len(groups)} groups, "
         f"{space.plan_count(groups)} plans), then the rest of the budget refines op by op", mode="grouped",
         groups=[[space.name(i) for i in g] for g in groups])
    candidates = stage1_candidates(space, groups)
    for plan in search.by_prediction(candidates):
        search.try_plan(plan)
    current = search.best.plan if search.best is not search.samples[0] else candidates[-1]
    _refine(space, search, budget, report, current, [i for g in groups if len(g) > 1 for i in g])


def _greedy(space: SearchSpace, search: _Stage1, budget: int, report: Reporter | None) -> None:
    note(report, Stage.STAGE1, f"even the {len(space.groups_of(space.searched))} groups of same-kind, same-shape "
         f"ops exceed stage1_budget={budget}: starting from autocast's choice and changing one op at a time",
         mode="greedy")
    start = stage1_plan(space, {})
    search.try_plan(start)
    _refine(space, search, budget, report, start, list(space.searched))


def _refine(space: SearchSpace, search: _Stage1, budget: int, report: Reporter | None,
            current: Assignment, order: list[int]) -> None:
    """Change one op at a time from ``current`` (each of its other levels); keep a change that gives a new best."""
    for position, i in enumerate(order):
        start = current
        for candidate in _alternatives(space, start, i):
            if _budget_left(search, budget) <= 0:
                untried = [space.name(j) for j in order[position:]]
                note(report, Stage.STAGE1, f"stage1_budget={budget} spent: {len(untried)} ops were not tried alone "
                     "and keep the precision of the best plan found", untried=untried)
                return
            if search.try_plan(candidate):
                current = candidate
