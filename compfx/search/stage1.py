"""CoMP Stage 1 (Algorithm 1): one epoch per plan of the Stage-1 ops, kept only if its loss tracks FP32's.

An FP32 epoch gives ``loss_0`` (and is the fallback plan); it and AMP's epoch take
turns on the same batches where the evaluator can run them so (their pairs are
their duel: :meth:`_Stage1.first_epochs_in_turns`). Tensor-Core-eligible
whitelist ops are fixed to low and "other" ops to follow; the adjustable ops
(blacklist, and whitelist without Tensor Cores) are tried at both precisions.
With FP8 in the space (``SearchConfig(fp8=True)``), an op that can run FP8 also
tries it, as a third level (:meth:`SearchSpace.levels`); the guard is the same.
A plan is accepted when :func:`~compfx.search.convergence.is_accepted`; an
accepted plan replaces the incumbent (AMP's plan first) only under the
decision rule (:class:`~compfx.search.compare.DecisionRule`), and ties keep
the incumbent. When the plans
(``2**k`` without FP8) exceed the budget the space is reduced (:func:`stage1_plan_space` says how)
and a note is logged.

**Candidates take turns with the incumbent.** Where the evaluator can run
epochs in turns, each candidate's epoch runs with the incumbent's again, on
the same batches (:meth:`_Stage1._sample_taking_turns`): the screen and the
pruning look at their pairs, by the decision rule's own verdict, and the pairs
open their duel. A burst of other work then slows both plans' steps alike.

**Exact-safe pruning.** A sample run alone stops as soon as its running cost,
``evaluator.cost(plan, seconds so far)``, reaches the rule's bar (:meth:`_Stage1.bar`,
the cost it must stay below to challenge the incumbent: it cannot win, as
costs only grow and ties keep the incumbent), or as soon as
a batch loss is NaN/inf (the epoch mean cannot be finite). This is exact --
the same plan wins as without pruning -- provided ``cost`` never decreases as
the seconds grow, as every cost of the form "seconds times or plus something
that depends on the plan" does.

**Fewer samples.** A candidate whose program (``evaluator.program``) was
already sampled is not run again. With a cost model (``predict``), candidates
still run in the fixed order (an order by predicted cost would move with the
profiles' noise, and with it the plan a near tie goes to); those the profiles
show cannot beat the incumbent by more than the rule's margin are skipped, and
Stage 1 stops when none left can. ``early_stop`` also ends a sample whose
measured pace projects it over the incumbent. These are not exact:
:func:`compfx.optimize` uses them only with ``predictor="on"``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Callable, Sequence

from ..errors import BadInputError, PlanFailedError, SearchError
from ..measure import interleaved_order
from ..plan import AMP_PRECISION, Assignment
from ..vocabulary import Category, Precision, SampleStatus, Stage
from .compare import MAX_DUEL_BLOCKS, Comparison, DecisionRule, Verdict, duel, log_duel
from .convergence import is_accepted, loss_limit
from .log import BATCH_VERDICT, CANNOT_WIN, INCUMBENT_AGAIN, NOTHING_CAN_WIN, PRUNED_AT, SAVED_BYTES, STOPPED_EARLY
from .outcome import (Outcome, PriceVersion, ProgramIndex, Reporter, checked_cost, cost_unit, failure_reason,
                      note)
from .space import SearchSpace

__all__ = [
    "Stage1Result", "run_stage1", "stage1_plan", "stage1_plan_space", "stage1_candidates", "should_skip",
    "skip_message", "cannot_win_message", "EARLY_STOP_MIN_BATCHES",
]

Predict = Callable[[Assignment], float]  # plan -> predicted seconds of one Stage-1 epoch
BoundAgainst = Callable[[Assignment, Assignment], float]  # (plan, a priced plan) -> a lower bound of predict(plan)

#: batches a Stage-1 sample runs before an early stop may judge its pace
EARLY_STOP_MIN_BATCHES = 3
#: pairs of FP32's and AMP's epochs in turns that their duel does not count (the warm-up of a duel)
_TURNS_WARMUP = 1
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


def cannot_win_message(predicted: float, bar: float, margin: float, unit: str = "s") -> str:
    """The reason logged for a candidate the profiles show cannot beat the incumbent by more than ``margin``.

    >>> cannot_win_message(1.2, 0.873, 0.03)
    'skipped: cannot beat the incumbent by more than 3% on the profiles (predicted 1.2 s, bar 0.873 s)'
    >>> cannot_win_message(91.0, 5.0, 0.0, unit="")
    "skipped: cannot beat the incumbent on the profiles (predicted cost 91 vs bar 5, in cost_fn's units)"
    """
    by = f" by more than {margin:.0%}" if margin else ""
    if unit:
        return (f"skipped: cannot beat the incumbent{by} on the profiles (predicted {predicted:.3g} {unit}, "
                f"bar {bar:.3g} {unit})")
    return (f"skipped: cannot beat the incumbent{by} on the profiles (predicted cost {predicted:.3g} vs bar "
            f"{bar:.3g}, in cost_fn's units)")


# -- sampling ----------------------------------------------------------------------

def _alternatives(space: SearchSpace, plan: Assignment, i: int) -> list[Assignment]:
    """``plan`` with op ``i`` at each of its other Stage-1 levels."""
    return [plan.replaced([i], level) for level in space.levels(i) if level is not plan[i]]


@dataclass
class _Paired:
    """A candidate's epoch run taking turns with the incumbent's (:meth:`_Stage1._sample_taking_turns`)."""

    incumbent: Outcome  # the incumbent's epoch again: its batches are the pairs' first halves
    outcome: Outcome  # the candidate's sample
    saves_less: bool  # the candidate saves fewer activation bytes than the incumbent (the rule's looser bar)
    verdict: Verdict | None = None  # on the pairs at the last block

    def pairs(self) -> tuple[list[float], list[float]]:
        """(incumbent's, candidate's) seconds of the batches both ran, but the first (the duel's warm-up)."""
        count = min(self.incumbent.batches, self.outcome.batches)
        start = _TURNS_WARMUP if count > _TURNS_WARMUP else 0
        return self.incumbent.batch_seconds[start:count], self.outcome.batch_seconds[start:count]


class _Stage1:
    """Runs samples and keeps the incumbent (the best accepted plan under the decision rule)."""

    def __init__(self, evaluator, threshold: float, prune: bool, report: Reporter | None,
                 predict: Predict | None = None, margin: float = 1.25, bound: Predict | None = None,
                 early_stop: float | None = None, rule: DecisionRule = DecisionRule(),
                 memory_budget: int | None = None, bound_against: BoundAgainst | None = None,
                 price_version: Callable[[], int] | None = None):
        self.evaluator, self.threshold, self.prune = evaluator, threshold, prune
        self.report = report or (lambda record: None)
        self.predict, self.margin = predict, margin
        self.bound = bound if predict is not None else None
        self.bound_against = bound_against if self.bound is not None else None
        self.early_stop = early_stop
        self.rule, self.memory_budget = rule, memory_budget
        self.predicted: dict[Assignment, float] = {}  # plan -> predicted cost
        self.bounds: dict[Assignment, float] = {}  # plan -> cost at the lower bound of the predicted seconds
        self.bounds_against: dict[tuple, float] = {}  # (plan, incumbent, plans priced) -> bound against it
        self.prices = PriceVersion(price_version)
        self.samples: list[Outcome] = []
        self.seen: set[Assignment] = set()
        self.programs = ProgramIndex(evaluator.program)
        self.best: Outcome | None = None  # the incumbent; None while no accepted plan fits the memory budget
        self.baseline_outcome: Outcome | None = None
        self.duels: list[tuple[Assignment, Assignment, Verdict]] = []  # (incumbent, challenger, verdict), in order
        self.loss0: float | None = None
        self._bytes: dict[Assignment, int | None] = {}
        self._incumbent_in_turns = False  # the incumbent's epoch took turns with another's: see _incumbent_alone

    def cost(self, plan: Assignment, seconds: float) -> float:
        return checked_cost(self.evaluator, plan, seconds)

    # -- memory ------------------------------------------------------------------------
    def saved_bytes(self, plan: Assignment) -> int | None:
        """The activation bytes ``plan`` saves (None: unknown, or the plan failed; its sample will say why)."""
        if plan not in self._bytes:
            try:
                found = self.evaluator.saved_bytes(plan)
            except PlanFailedError:
                found = None
            self._bytes[plan] = None if found is None else int(found)
        return self._bytes[plan]

    def saves_less(self, plan: Assignment, than: Assignment | None = None) -> bool:
        """Does ``plan`` save fewer activation bytes than ``than`` (default: the incumbent's plan)? False when unknown."""
        if than is None:
            if self.best is None:
                return False
            than = self.best.plan
        mine, theirs = self.saved_bytes(plan), self.saved_bytes(than)
        return mine is not None and theirs is not None and mine < theirs

    def over_budget(self, plan: Assignment) -> str:
        """Why ``plan`` cannot be chosen under the memory budget ("" when it can)."""
        nbytes = self.saved_bytes(plan) if self.memory_budget is not None else None
        if nbytes is None or nbytes <= self.memory_budget:
            return ""
        return f"saves {nbytes} activation bytes for backward, over memory_budget={self.memory_budget}"

    # -- the rule ----------------------------------------------------------------------
    def bar(self, plan: Assignment) -> float:
        """The cost ``plan`` must stay below to challenge the incumbent (inf while there is none)."""
        if self.best is None:
            return math.inf
        return self.rule.bar(self.best.cost, saves_less=self.saves_less(plan))

    def judge(self, incumbent: Outcome, challenger: Outcome, *, prefix: int | None = None) -> bool:
        """Does ``challenger`` (accepted, measured) replace ``incumbent``? The screen, the batches, the duel; logged.

        Before a duel, the two epochs' batches (the same batches, timed in
        different phases) must already show the challenger ahead of the bar,
        in their median ratio: a duel costs steps, and one the batches do not
        support is not run. ``prefix`` compares only the incumbent's first batches (FP32's plan against AMP's,
        whose epoch may have been stopped at the bar: the batches up to where it crossed it, whether or not it was).
        """
        saves_less = self.saves_less(challenger.plan, incumbent.plan)
        if not self.rule.passes_screen(challenger.cost, incumbent.cost, saves_less=saves_less):
            return False
        if not self.rule.rounds:
            return True
        behind = self._batches_behind(incumbent, challenger, saves_less, prefix)
        if behind:
            challenger.extra[BATCH_VERDICT] = behind
            return False
        try:
            verdict = duel(self.evaluator, self.rule, incumbent.plan, challenger.plan, saves_less=saves_less)
        except PlanFailedError as error:
            note(self.report, Stage.STAGE1, f"duel of {challenger.plan} with incumbent {incumbent.plan} failed "
                 f"({failure_reason(error)}); incumbent kept", plan=str(challenger.plan))
            return False
        log_duel(self.report, Stage.STAGE1, verdict, incumbent.plan, challenger.plan, self.rule.rounds)
        self.duels.append((incumbent.plan, challenger.plan, verdict))
        return verdict.replaces

    def _batches_behind(self, incumbent: Outcome, challenger: Outcome, saves_less: bool,
                        prefix: int | None = None) -> str:
        """Why the two epochs, batch for batch, do not even suggest the challenger wins ("" when they do).

        The median of the per-batch cost ratios must be below the rule's bar,
        as it must in the duel; a heavy-tailed outlier (another job's burst)
        moves a median by one rank only.
        """
        pairs = list(zip(incumbent.batch_seconds[:prefix], challenger.batch_seconds))
        if len(pairs) < 2:
            return ""
        comparison = Comparison.of([self.cost(incumbent.plan, a) for a, _ in pairs],
                                   [self.cost(challenger.plan, b) for _, b in pairs])
        bar = self.rule.ratio_bar(saves_less)
        if comparison.median < bar:
            return ""
        return (f"batch for batch its cost is {comparison.median:.3f} x the incumbent's (median over {len(pairs)} "
                f"batches), not below {bar:g}: no duel")

    # -- samples ------------------------------------------------------------------------
    def sample(self, plan: Assignment, bar: float = math.inf, *, bar_until: int | None = None) -> Outcome:
        """Run one epoch under ``plan``, stopping early when pruning allows it (its running cost reaches ``bar``;
        with ``bar_until``, only within its first ``bar_until`` batches)."""
        start = time.perf_counter()
        outcome = Outcome(plan, SampleStatus.REJECTED)
        nbytes = self._bytes.get(plan)
        if nbytes is not None:
            outcome.extra[SAVED_BYTES] = nbytes
        epoch = None
        try:
            epoch = self.evaluator.run_epoch(plan)
            outcome.artifact = self._consume(epoch, outcome, bar, bar_until)
        except PlanFailedError as error:  # this plan failed: reject it, keep searching
            outcome.status, outcome.reason = SampleStatus.ERROR, failure_reason(error)
        finally:
            if epoch is not None and hasattr(epoch, "close"):
                epoch.close()  # restores the state when the sample stopped early
            outcome.duration = time.perf_counter() - start
        return outcome

    def _took_batch(self, outcome: Outcome, loss: float, seconds: float, *, prune: bool) -> bool:
        """Add one batch to ``outcome``; False (the sample pruned) when ``prune`` and its loss is not finite."""
        outcome.batch_losses.append(float(loss))
        outcome.batch_seconds.append(float(seconds))
        outcome.batches += 1
        outcome.seconds += seconds
        if prune and not math.isfinite(loss):
            outcome.status, outcome.loss = SampleStatus.PRUNED, float(loss)
            outcome.reason = f"loss became {loss} at batch {outcome.batches}; the epoch mean cannot be finite"
            return False
        return True

    def _finished(self, outcome: Outcome) -> None:
        """A whole epoch ran: its mean loss and its cost."""
        if outcome.batches == 0:
            raise SearchError("the sample loader yielded no batches; Stage 1 needs at least one batch per epoch")
        outcome.loss = sum(outcome.batch_losses) / outcome.batches
        outcome.cost = self.cost(outcome.plan, outcome.seconds)

    def _consume(self, epoch, outcome: Outcome, bar: float, bar_until: int | None = None):
        while True:
            try:
                loss, seconds = next(epoch)
            except StopIteration as stop:
                artifact = stop.value
                break
            if not self._took_batch(outcome, loss, seconds, prune=self.prune):
                return None
            if self.prune and math.isfinite(bar) and (bar_until is None or outcome.batches <= bar_until):
                running = self.cost(outcome.plan, outcome.seconds)
                if running >= bar:
                    outcome.status, outcome.cost = SampleStatus.PRUNED, running
                    outcome.reason = (f"running cost {running:.6g} after {outcome.batches} batches already >= "
                                      f"{bar:.6g}, the most it may cost to challenge {self._bar_words()}")
                    outcome.extra[PRUNED_AT] = bar
                    return None
                if self._stopped_early(outcome):
                    return None
        self._finished(outcome)
        return artifact

    def _bar_words(self) -> str:
        return f"the incumbent {self.best.plan} (cost {self.best.cost:.6g})" if self.best is not None else "it"

    def baseline(self, plan: Assignment) -> Outcome:
        self.saved_bytes(plan)
        return self._settle_baseline(self.sample(plan))

    def _settle_baseline(self, outcome: Outcome) -> Outcome:
        """The FP32 baseline's epoch, run: loss_0 and the incumbent until AMP's plan is measured; a failed one
        stops the search."""
        plan = outcome.plan
        if outcome.status is SampleStatus.ERROR or outcome.loss is None or not math.isfinite(outcome.loss):
            self.report(outcome.record(Stage.STAGE1))
            raise SearchError(
                f"the FP32 baseline epoch failed ({outcome.reason or f'loss {outcome.loss}'}); the search compares "
                "every plan with it. Check that the model trains in FP32 with this loader, loss_fn and optimizer.")
        outcome.status, outcome.reason = SampleStatus.ACCEPTED, "FP32 baseline (loss_0)"
        over = self.over_budget(plan)
        if over:
            outcome.reason += f"; it {over}, so it cannot be chosen"
        self.loss0, self.baseline_outcome = outcome.loss, outcome
        self.best = None if over else outcome  # the incumbent until AMP's plan is measured
        self.samples.append(outcome)
        self.seen.add(plan)
        self.programs.earlier_twin(plan)  # the baseline's program is the first recorded
        self.report(outcome.record(Stage.STAGE1))
        return outcome

    def first_epochs_in_turns(self, fp32: Assignment, amp: Assignment) -> bool:
        """FP32's baseline and AMP's plan (the first incumbent) in one phase; False, having run nothing, where they
        cannot be (then :meth:`baseline` and :meth:`first_incumbent` run them one after the other).

        Their epochs take turns on the same batches, each plan training a copy
        of the state of its own (``evaluator.run_epochs_taking_turns``), so
        their batches are paired, interleaved timings: the duel of the two. FP32's
        plan replaces AMP's only under the rule, on those pairs. AMP's epoch stops
        early once a block of ``rule.rounds`` pairs decides that FP32's plan
        replaces it (as a duel of blocks would); a non-finite loss stops it too.
        Not where the evaluator cannot run epochs in turns (or a second copy of
        the state may not fit), the rule takes no duels, AMP's plan runs FP32's
        program, or either is over the memory budget.
        """
        turns = getattr(self.evaluator, "run_epochs_taking_turns", None)
        if turns is None or amp == fp32 or not self.rule.rounds or amp in self.seen:
            return False
        try:
            if (self.over_budget(fp32) or self.over_budget(amp)
                    or self.programs.program(amp) == self.programs.program(fp32)):
                return False
            epochs = turns([fp32, amp])
        except PlanFailedError:  # AMP's plan does not build: one after the other, where its failure is recorded
            return False
        if epochs is None:
            return False
        base, first = Outcome(fp32, SampleStatus.REJECTED), Outcome(amp, SampleStatus.REJECTED)
        for outcome in (base, first):
            nbytes = self._bytes.get(outcome.plan)
            if nbytes is not None:
                outcome.extra[SAVED_BYTES] = nbytes
        saves_less = self.saves_less(fp32, amp)
        try:
            verdict = self._run_in_turns(epochs, base, first, saves_less)
        finally:
            for epoch in epochs:
                epoch.close()
        pairs = 0 if verdict is None else len(verdict.seconds[0])
        if (verdict is not None and first.status is SampleStatus.REJECTED and base.loss is not None
                and is_accepted(first.loss, base.loss, self.threshold)):  # a plan the guard rejects needs no duel
            verdict = self._more_blocks(verdict.seconds, amp, fp32, saves_less)
        self.seen.update((fp32, amp))
        self.programs.earlier_twin(fp32)
        self.programs.earlier_twin(amp)
        self._settle_baseline(base)
        self._settle_first_in_turns(first, verdict)
        self._incumbent_in_turns = True
        if verdict is not None:
            log_duel(self.report, Stage.STAGE1, verdict, amp, fp32, self.rule.rounds, epoch_pairs=pairs)
            self.duels.append((amp, fp32, verdict))
        return True

    def _incumbent_alone(self) -> None:
        """Before the first candidate's epoch after FP32's and AMP's took turns: the incumbent's epoch once more,
        alone, which the candidates' epochs (run alone) are then compared with.

        A step taking turns with another plan's runs a few percent slower than
        one in an epoch alone (caches, the other program's kernels): about the
        margin, on a small model. Compared with the incumbent's epoch in turns, a
        candidate's epoch alone would pass the screen and escape the pruning bar
        by that much, and costs duels and whole epochs that cannot win. The
        epoch runs only when a candidate does (a search the profiles stop at once
        pays nothing), and is logged as the incumbent's sample, again.
        """
        best = self.best
        if not self._incumbent_in_turns or best is None:
            return
        self._incumbent_in_turns = False
        alone = self.sample(best.plan)
        if alone.status is not SampleStatus.REJECTED or alone.loss is None:  # failed alone: the figures in turns stand
            note(self.report, Stage.STAGE1, f"the incumbent {best.plan}'s epoch alone did not finish "
                 f"({alone.reason}); candidates are compared with its epoch in turns", plan=str(best.plan))
            return
        in_turns = best.cost
        best.batch_seconds, best.seconds, best.cost = alone.batch_seconds, alone.seconds, alone.cost
        alone.status, alone.artifact = SampleStatus.ACCEPTED, None
        alone.reason = (f"the incumbent, its epoch again, alone: cost {alone.cost:.6g} ({in_turns:.6g} taking turns "
                        "with FP32's or AMP's); the candidates' epochs, run alone, are compared with this one")
        alone.extra[INCUMBENT_AGAIN] = "alone"
        self.report(alone.record(Stage.STAGE1))

    def _run_in_turns(self, epochs, base: Outcome, first: Outcome, saves_less: bool) -> Verdict | None:
        """Advance the two epochs in turns to their ends; the verdict of FP32's plan against AMP's on their pairs."""
        outcomes, running = (base, first), [True, True]
        verdict = None
        round_index = 0
        while any(running):
            for j in interleaved_order(2, round_index):
                if running[j]:
                    running[j] = self._turn(epochs[j], outcomes[j], stops_search=j == 0)
            round_index += 1
            pairs = min(base.batches, first.batches) - _TURNS_WARMUP
            if running[1] and pairs > 0 and pairs % self.rule.rounds == 0:
                verdict = self._verdict_on_pairs(_Paired(first, base, saves_less))
                if verdict.replaces and self.rule.decided(verdict):  # FP32's plan has won: AMP's epoch stops
                    first.status = SampleStatus.PRUNED
                    first.reason = (f"FP32's plan is faster by more than the margin after {first.batches} of its "
                                    "batches, the plans taking turns")
                    running[1] = False
                    epochs[1].close()
            if not running[0] and base.status is not SampleStatus.REJECTED:  # the baseline failed: nothing to judge
                return None
        if first.batches and first.status is SampleStatus.REJECTED:
            verdict = self._verdict_on_pairs(_Paired(first, base, saves_less))
        return verdict

    def _more_blocks(self, measured, incumbent: Assignment, candidate: Assignment, saves_less: bool) -> Verdict:
        """The duel of two epochs' pairs (``measured``: the incumbent's and the candidate's seconds), with blocks of
        ``rule.rounds`` pairs more while it is undecided (as any duel takes them:
        :func:`~compfx.search.compare.duel`), up to :data:`~compfx.search.compare.MAX_DUEL_BLOCKS` blocks' worth
        in all. A further block that fails ends it on the pairs so far (noted)."""
        def failed(error: PlanFailedError) -> None:
            note(self.report, Stage.STAGE1, f"a further block of the duel of {candidate} with the incumbent "
                 f"{incumbent} failed ({failure_reason(error)}); decided on the pairs so far", plan=str(candidate))

        return duel(self.evaluator, self.rule, incumbent, candidate, saves_less=saves_less, measured=measured,
                    failed=failed)

    def _turn(self, epoch, outcome: Outcome, *, stops_search: bool) -> bool:
        """One batch of ``outcome``'s epoch; False when its epoch ended (finished, failed, or pruned)."""
        start = time.perf_counter()
        try:
            loss, seconds = next(epoch)
        except StopIteration as stop:
            outcome.artifact = stop.value
            self._finished(outcome)
            return False
        except PlanFailedError as error:
            outcome.status, outcome.reason = SampleStatus.ERROR, failure_reason(error)
            return False
        finally:
            outcome.duration += time.perf_counter() - start
        return self._took_batch(outcome, loss, seconds, prune=self.prune or stops_search)

    def _settle_first_in_turns(self, outcome: Outcome, verdict: Verdict | None) -> None:
        """AMP's epoch, run in turns with FP32's: the incumbent when its loss holds and FP32's plan did not win."""
        self._predicted_extra(outcome)
        if outcome.status is SampleStatus.PRUNED and outcome.loss is None:  # FP32's plan won on the pairs
            outcome.reason = f"AMP's plan, the first incumbent: {outcome.reason}"
            self._record(outcome)
            return
        if outcome.status is not SampleStatus.REJECTED:  # failed, or a non-finite loss
            outcome.reason = "AMP's plan: " + outcome.reason
            self._record(outcome)
            return
        if not is_accepted(outcome.loss, self.loss0, self.threshold):
            outcome.reason = "AMP's plan: " + self._loss_reason(outcome)
        elif verdict is not None and verdict.replaces:
            outcome.status = SampleStatus.ACCEPTED
            outcome.reason = "AMP's plan, the first incumbent: FP32's plan is faster by more than the margin"
        else:
            outcome.status = SampleStatus.ACCEPTED
            outcome.reason = "AMP's plan: the incumbent"
            self._promote(outcome)
        self._record(outcome)

    def first_incumbent(self, amp: Assignment) -> None:
        """AMP's plan, the first incumbent: it stays unless FP32's plan beats it under the rule.

        Its epoch stops once FP32's plan is sure to pass the screen against it
        (exact pruning), but only within its first three quarters: if the duel
        then keeps AMP's plan after all, its epoch runs again in full, for its
        loss. A stop at batch k of n saves n - k batches when FP32's plan wins
        and costs k when AMP's stays. An epoch that crosses the bar in its last
        quarter ran under 1.38x FP32's pace, a near tie that the duel often
        settles for AMP's plan, where a stop would save under n/4 batches and
        risk over 3n/4. There the epoch runs to its end and is judged on the
        batches up to where it crossed the bar, as a stopped one would be (the
        same decision). A plan that crosses earlier is clearly slower and stops.
        """
        if amp in self.seen:
            return
        self.seen.add(amp)
        if self._same_program_sampled(amp):
            return
        over = self.over_budget(amp)
        if over:
            self._record(Outcome(amp, SampleStatus.REJECTED, reason=f"AMP's plan {over}"))
            return
        fp32 = self.best  # the FP32 baseline, or None when it is over the budget
        # FP32 passes the screen against AMP once AMP costs more than fp32.cost / ratio bar: AMP's epoch stops there
        bar = math.inf if fp32 is None else fp32.cost / self.rule.ratio_bar(self.saves_less(fp32.plan, amp))
        early_stop, self.early_stop = self.early_stop, None  # not on pace: only the exact bar stops the first incumbent
        try:
            outcome = self.sample(amp, math.nextafter(bar, math.inf) if math.isfinite(bar) else bar,
                                  bar_until=None if fp32 is None else 3 * fp32.batches // 4)
        finally:
            self.early_stop = early_stop
        self._predicted_extra(outcome)
        if outcome.status is SampleStatus.PRUNED and PRUNED_AT not in outcome.extra:  # a non-finite loss
            outcome.reason = "AMP's plan: " + outcome.reason
            self._record(outcome)
            return
        if outcome.status is SampleStatus.PRUNED:  # FP32 passes the screen against its cost so far; the duel decides
            if self.judge(outcome, fp32):  # the batches it ran: up to where it crossed the bar
                outcome.reason = f"AMP's plan, the first incumbent: FP32's plan is faster by more than the margin " \
                                 f"({outcome.reason})"
                self._record(outcome)
                return
            note(self.report, Stage.STAGE1, f"the duel kept AMP's plan {amp} against FP32's, although its pruned "
                 "epoch cost more: its epoch runs again in full, for its loss", plan=str(amp))
            outcome = self.sample(amp)
            self._predicted_extra(outcome)
            return self._settle_amp(outcome, fp32, bar, dueled=True)
        self._settle_amp(outcome, fp32, bar, dueled=False)

    def _settle_amp(self, outcome: Outcome, fp32: Outcome | None, bar: float, *, dueled: bool) -> None:
        if outcome.status is SampleStatus.REJECTED:
            if is_accepted(outcome.loss, self.loss0, self.threshold):
                outcome.status = SampleStatus.ACCEPTED
                if fp32 is not None and not dueled and self.judge(outcome, fp32, prefix=self._crossing(outcome, bar)):
                    outcome.reason = "AMP's plan, the first incumbent: FP32's plan is faster by more than the margin"
                else:
                    outcome.reason = "AMP's plan: the incumbent"
                    self._promote(outcome)
            else:
                outcome.reason = "AMP's plan: " + self._loss_reason(outcome)
        self._record(outcome)

    def _crossing(self, outcome: Outcome, bar: float) -> int:
        """How many batches ``outcome``'s epoch had run when its running cost passed ``bar`` (all: never): the batches
        a run that stopped it at the bar would have."""
        running = 0.0
        for i, seconds in enumerate(outcome.batch_seconds, 1):
            running += seconds
            if self.cost(outcome.plan, running) >= math.nextafter(bar, math.inf):
                return i
        return len(outcome.batch_seconds)

    def _promote(self, outcome: Outcome) -> None:
        if self.best is not None:
            self.best.artifact = None  # only the incumbent's trained state is kept
        self.best = outcome

    def _record(self, outcome: Outcome) -> None:
        if outcome is not self.best:
            outcome.artifact = None
        self.samples.append(outcome)
        self.report(outcome.record(Stage.STAGE1))

    def _loss_reason(self, outcome: Outcome) -> str:
        return (f"loss {outcome.loss:.6g} not below {loss_limit(self.loss0, self.threshold):.6g} "
                f"(loss_0 {self.loss0:.6g} x threshold {self.threshold})")

    def _predicted_extra(self, outcome: Outcome) -> None:
        """The predicted cost on the sample's record, where the search priced the plan (pricing costs a rewrite)."""
        priced = self.predicted.get(outcome.plan)
        if priced is not None and math.isfinite(priced):
            outcome.extra["predicted_cost"] = priced

    def _prices_current(self) -> None:
        """Forget every figure priced before the cost model's prices changed (a duel scaled them down)."""
        if self.prices.moved():
            self.predicted.clear()
            self.bounds.clear()
            self.bounds_against.clear()

    def predicted_cost(self, plan: Assignment) -> float | None:
        """``cost(plan, predicted epoch seconds)``; None without a predictor, NaN when it cannot price ``plan``."""
        self._prices_current()
        return None if self.predict is None else self._priced(self.predict, self.predicted, plan)

    def bound_cost(self, plan: Assignment) -> float:
        """``cost(plan, lower bound of the predicted seconds)``: the full prediction when there is no bound.

        With ``bound_against``, the bound read off the incumbent's priced graph (tighter for a plan that differs
        from it in a few ops), where it can be had."""
        if self.bound is None:
            return self.predicted_cost(plan)
        self._prices_current()
        if self.bound_against is not None and self.best is not None:
            key = (plan, self.best.plan, len(self.predicted))  # each plan priced may tighten the bound
            if key not in self.bounds_against:
                seconds = float(self.bound_against(plan, self.best.plan))
                self.bounds_against[key] = self.cost(plan, seconds) if math.isfinite(seconds) else math.nan
            if math.isfinite(self.bounds_against[key]):
                return self.bounds_against[key]
        return self._priced(self.bound, self.bounds, plan)

    def _priced(self, estimate: Predict, cache: dict[Assignment, float], plan: Assignment) -> float:
        """``cost(plan, estimate(plan))``, computed once per plan; NaN when ``plan`` cannot be priced."""
        if plan not in cache:
            seconds = float(estimate(plan))
            cache[plan] = self.cost(plan, seconds) if math.isfinite(seconds) else math.nan
        return cache[plan]

    def cannot_win(self, plan: Assignment, *, price: bool = True) -> tuple[bool, float, float]:
        """Does the cost model show that ``plan`` cannot beat the incumbent by more than the margin?

        Like for like: ``plan``'s predicted cost against the rule's bar on the
        incumbent's *predicted* cost (both from the same profiles and
        calibration). The cheap lower bound of the prediction (casts free,
        follow ops at their faster dtype) is tried first; only when it is under
        the bar is the plan priced in full (a rewrite), and its prediction
        decides (``price=False``: a prediction already made, else the bound).
        Returns (cannot win, the figure that decided, bar); never true for a plan
        or an incumbent that cannot be priced.
        """
        if self.predict is None or self.best is None:
            return False, math.nan, math.nan
        reference = self.predicted_cost(self.best.plan)
        bound = self.bound_cost(plan)
        if not (math.isfinite(reference) and math.isfinite(bound)):
            return False, bound, math.nan
        bar = self.rule.bar(reference, saves_less=False)
        if bound >= bar or self.bound is None:
            return bound >= bar, bound, bar
        if not price and plan not in self.predicted:
            return False, bound, bar
        predicted = self.predicted_cost(plan)
        return math.isfinite(predicted) and predicted >= bar, predicted, bar

    def nothing_can_win(self, candidates: Sequence[Assignment]) -> bool:
        """True (and a note) when the cost model shows that none of ``candidates`` not yet seen can beat the incumbent
        by more than the margin (:meth:`cannot_win`, on their bounds and the predictions already made; a plan
        still in doubt is priced when its turn comes): Stage 1 stops instead of sampling them."""
        left = [plan for plan in candidates if plan not in self.seen]
        if not left or self.predict is None or self.best is None:
            return False
        # the next candidate usually can win: asked first, it settles the question without pricing the rest
        if not all(self.cannot_win(plan, price=False)[0] for plan in left):
            return False
        verdicts = [self.cannot_win(plan, price=False) for plan in left]  # cached now: for the note's figures
        bar = verdicts[0][2]
        note(self.report, Stage.STAGE1, f"stopped: the profiles show that none of the {len(left)} plans left can "
             f"beat the incumbent {self.best.plan} by more than the margin (the lowest of their predicted costs, "
             f"{min(b for _, b, _ in verdicts):.6g}, is not below {bar:.6g}, {1 - self.rule.margin:g} x the "
             "incumbent's predicted cost); not sampled", **{NOTHING_CAN_WIN: len(left)})
        return True

    def skipped(self, plan: Assignment) -> bool:
        """Log and skip ``plan`` when the profiles show it cannot beat the incumbent (:meth:`cannot_win`, like for
        like); where the incumbent cannot be priced, when its predicted cost exceeds ``margin`` x the incumbent's
        measured cost.

        Predicted and measured costs are compared only when nothing else can
        be: the profiles' seconds are not the epochs' (they are taken in
        another phase, and scaled only once a duel has measured both), and a
        plan predicted 5% faster than the incumbent can read 30% slower than the
        incumbent's measured epoch. Compared so, the same plan would be sampled
        in one run and skipped in the next. The cheap lower bound is tried
        first: when even it is over, the full prediction (which can only be
        higher) is not computed.
        """
        if self.predict is None or self.best is None:
            return False
        cannot, figure, bar = self.cannot_win(plan)
        if cannot:
            bounded = self.bound is not None and figure == self.bound_cost(plan)  # the cheap bound sufficed
            name = "predicted_cost_lower_bound" if bounded else "predicted_cost"
            outcome = Outcome(plan, SampleStatus.SKIPPED, extra={name: figure, CANNOT_WIN: bar},
                              reason=cannot_win_message(figure, bar, self.rule.margin, cost_unit(self.evaluator)))
            self.report(outcome.record(Stage.STAGE1))
            return True
        if math.isfinite(bar):  # priced like for like, and it can win
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
        """Stop a sample whose pace, batch for batch against the incumbent's, projects it well over the rule's bar.

        Not exact (pruning is): the projection is the incumbent's epoch seconds
        times the median per-batch ratio so far, after
        :data:`EARLY_STOP_MIN_BATCHES` batches; the sample stops when that
        projected cost exceeds the bar it must get under (``1 - margin`` x the
        incumbent's cost, or ``1 + margin`` x when it saves less memory) by more
        than ``early_stop``: such a plan could only win by noise.
        """
        best, k = self.best, outcome.batches
        if self.early_stop is None or best is None or k < EARLY_STOP_MIN_BATCHES or len(best.batch_seconds) < k:
            return False
        ratios = [mine / theirs for mine, theirs in zip(outcome.batch_seconds, best.batch_seconds) if theirs > 0]
        if len(ratios) < EARLY_STOP_MIN_BATCHES:
            return False
        projected = self.cost(outcome.plan, statistics.median(ratios) * best.seconds)
        bar = self.bar(outcome.plan)
        if not projected > (1.0 + self.early_stop) * bar:
            return False
        outcome.status, outcome.cost = SampleStatus.PRUNED, projected
        outcome.extra[STOPPED_EARLY] = True
        outcome.reason = (f"stopped early: projected cost {projected:.6g} after {k} batches is over "
                          f"{1.0 + self.early_stop:g} x {bar:.6g}, the most it may cost to challenge the incumbent "
                          f"{best.plan} (cost {best.cost:.6g})")
        return True

    # -- a candidate's epoch taking turns with the incumbent's -------------------------------------------------
    def _sample_taking_turns(self, plan: Assignment) -> "_Paired | None":
        """``plan``'s epoch and the incumbent's again, their steps taking turns on the same batches (each plan
        training a copy of the state of its own); None, having run nothing, where they cannot take turns (then
        ``plan``'s epoch runs alone and is compared with the incumbent's epoch alone).

        A candidate's epoch alone is compared with the incumbent's from
        another phase: on a shared machine the steps drift 10-35% for a
        fraction of a second, and a near tie then goes one way in one run and
        the other way in the next. Taking turns, every pair of steps sees the
        same drift, and the pairs are the duel's first pairs. What would prune
        the candidate alone is judged on the pairs instead, by the rule itself:
        after each block of ``rule.rounds`` pairs, a median ratio at or over the
        bar stops it (the duel would keep the incumbent there too); one whose pairs
        show it faster by more than the margin, with confidence, goes on alone
        to the end of its epoch, for its loss. With ``early_stop``, a candidate
        whose pairs' median is more than that over the bar after
        :data:`EARLY_STOP_MIN_BATCHES` pairs stops before its first block. The
        incumbent's steps stop once the duel is decided or has taken
        :data:`~compfx.search.compare.MAX_DUEL_BLOCKS` blocks' worth of pairs,
        as a duel does.
        """
        best, turns = self.best, getattr(self.evaluator, "run_epochs_taking_turns", None)
        if best is None or turns is None or not self.rule.rounds:
            return None
        try:
            epochs = turns([best.plan, plan])
        except PlanFailedError:  # the candidate does not build: alone, where its failure is recorded
            return None
        if epochs is None:
            return None
        paired = _Paired(Outcome(best.plan, SampleStatus.ACCEPTED), Outcome(plan, SampleStatus.REJECTED),
                         self.saves_less(plan))
        for outcome in (paired.incumbent, paired.outcome):
            nbytes = self._bytes.get(outcome.plan)
            if nbytes is not None:
                outcome.extra[SAVED_BYTES] = nbytes
        try:
            self._advance_paired(epochs, paired)
        finally:
            for epoch in epochs:
                epoch.close()
        return paired

    def _advance_paired(self, epochs, paired: "_Paired") -> None:
        """Run the two epochs in turns: the incumbent's until the pairs decide, the candidate's to its end (or until
        its pairs show it cannot win). The caller closes both."""
        outcomes, running = (paired.incumbent, paired.outcome), [True, True]
        round_index = 0
        while running[1]:
            for j in interleaved_order(2, round_index):
                if running[j]:
                    running[j] = self._turn(epochs[j], outcomes[j], stops_search=False)
            round_index += 1
            if running[0] and running[1]:
                running[1], running[0] = self._after_pair(paired)
                if not running[0]:
                    epochs[0].close()

    def _after_pair(self, paired: "_Paired") -> tuple[bool, bool]:
        """After a round of both epochs: (does the candidate's epoch go on, do the incumbent's steps go on)?"""
        if self._paired_too_slow(paired):
            return False, False
        pairs = len(paired.pairs()[0])
        if not pairs or pairs % self.rule.rounds:
            return True, True
        paired.verdict = self._verdict_on_pairs(paired)
        if self.prune and not paired.verdict.comparison.median < paired.verdict.bar:
            self._cannot_win_on_pairs(paired)
            return False, False
        # decided, or as many pairs as a duel takes: the candidate goes on alone, for its loss
        decided = self.rule.decided(paired.verdict) or pairs >= MAX_DUEL_BLOCKS * self.rule.rounds
        return True, not decided

    def _pair_comparison(self, paired: "_Paired") -> Comparison:
        """The pairs' costs, incumbent's and candidate's (the first pair, which creates the optimizer's state
        again, is the duel's warm-up: :meth:`_Paired.pairs`)."""
        incumbent, candidate = paired.pairs()
        return Comparison.of([self.cost(paired.incumbent.plan, s) for s in incumbent],
                             [self.cost(paired.outcome.plan, s) for s in candidate])

    def _verdict_on_pairs(self, paired: "_Paired") -> Verdict:
        """The rule's verdict of the candidate against the incumbent on their pairs."""
        verdict = self.rule.verdict(self._pair_comparison(paired), saves_less=paired.saves_less)
        return replace(verdict, seconds=tuple(map(tuple, paired.pairs())))

    def _paired_too_slow(self, paired: "_Paired") -> bool:
        """Early stop on pace, on the pairs: their median ratio more than ``early_stop`` over the bar after
        :data:`EARLY_STOP_MIN_BATCHES` pairs (before the first block can decide)."""
        pairs = len(paired.pairs()[0])
        if self.early_stop is None or not self.prune or not EARLY_STOP_MIN_BATCHES <= pairs < self.rule.rounds:
            return False
        ratio, bar = self._pair_comparison(paired).median, self.rule.ratio_bar(paired.saves_less)
        if not ratio > (1.0 + self.early_stop) * bar:
            return False
        outcome = paired.outcome
        outcome.status, outcome.extra[STOPPED_EARLY] = SampleStatus.PRUNED, True
        outcome.cost = self.cost(outcome.plan, outcome.seconds)
        outcome.reason = (f"stopped early: taking turns with the incumbent {paired.incumbent.plan}, its cost is "
                          f"{ratio:.3f} x the incumbent's (median over {pairs} pairs), over "
                          f"{1.0 + self.early_stop:g} x {bar:g}, the most it may cost to challenge it")
        return True

    def _cannot_win_on_pairs(self, paired: "_Paired") -> None:
        outcome, verdict = paired.outcome, paired.verdict
        outcome.status, outcome.cost = SampleStatus.PRUNED, self.cost(outcome.plan, outcome.seconds)
        outcome.extra[PRUNED_AT] = verdict.bar
        outcome.reason = (f"taking turns with the incumbent {paired.incumbent.plan}, its cost is "
                          f"{verdict.comparison.median:.3f} x the incumbent's (median over "
                          f"{len(verdict.comparison.ratios)} pairs), not below {verdict.bar:g}: it cannot win")

    def _judge_pairs(self, paired: "_Paired") -> bool:
        """Does the candidate (accepted, its epoch run in turns with the incumbent's) replace the incumbent? The
        verdict on their pairs, with blocks of ``rule.rounds`` pairs more while it is undecided (a duel); logged.

        The screen first: pairs whose median ratio is not below the bar run no
        duel (they would decide it at its first look). Fewer pairs than a block
        (a short epoch) screen, but the duel times blocks of its own: a verdict
        on them would be less sure than the rule's ``confidence``.
        """
        pairs = paired.pairs()
        if pairs[0]:
            screen = self._verdict_on_pairs(paired)
            if not screen.comparison.median < screen.bar:
                paired.outcome.extra[BATCH_VERDICT] = (
                    f"taking turns with the incumbent, its cost is {screen.comparison.median:.3f} x the incumbent's "
                    f"(median over {len(pairs[0])} pairs), not below {screen.bar:g}: no duel")
                return False
        measured = pairs if len(pairs[0]) >= self.rule.rounds else ((), ())
        try:
            verdict = self._more_blocks(measured, paired.incumbent.plan, paired.outcome.plan, paired.saves_less)
        except PlanFailedError as error:
            note(self.report, Stage.STAGE1, f"duel of {paired.outcome.plan} with incumbent {paired.incumbent.plan} "
                 f"failed ({failure_reason(error)}); incumbent kept", plan=str(paired.outcome.plan))
            return False
        log_duel(self.report, Stage.STAGE1, verdict, paired.incumbent.plan, paired.outcome.plan, self.rule.rounds,
                 epoch_pairs=len(measured[0]))
        self.duels.append((paired.incumbent.plan, paired.outcome.plan, verdict))
        return verdict.replaces

    def _record_incumbent_again(self, paired: "_Paired") -> None:
        """Log the incumbent's epoch in turns (its batches, for a resumed search to replay): not a new sample."""
        again = paired.incumbent
        again.artifact = None
        again.cost = self.cost(again.plan, again.seconds)
        again.reason = (f"the incumbent, its epoch again, taking turns with {paired.outcome.plan}'s for "
                        f"{again.batches} batches: their pairs are the duel's")
        again.extra[INCUMBENT_AGAIN] = str(paired.outcome.plan)
        self.report(again.record(Stage.STAGE1))

    def try_plan(self, plan: Assignment) -> bool:
        """Sample ``plan`` (once); True when it replaced the incumbent."""
        if plan in self.seen:
            return False
        self.seen.add(plan)
        if self.skipped(plan) or self._same_program_sampled(plan):
            return False
        over = self.over_budget(plan)
        if over:
            self._record(Outcome(plan, SampleStatus.REJECTED, reason=over, extra={SAVED_BYTES: self.saved_bytes(plan)}))
            return False
        incumbent = self.best
        paired = self._sample_taking_turns(plan)
        if paired is None:
            self._incumbent_alone()
            outcome = self.sample(plan, self.bar(plan))
        else:
            outcome = paired.outcome
        self._predicted_extra(outcome)
        replaced = False
        if outcome.status is SampleStatus.REJECTED:
            if is_accepted(outcome.loss, self.loss0, self.threshold):
                outcome.status = SampleStatus.ACCEPTED
                if paired is not None:
                    replaced = self._judge_pairs(paired)
                else:
                    replaced = incumbent is None or self.judge(incumbent, outcome)
                if replaced:
                    outcome.reason = "new incumbent" if incumbent is not None else "the first plan within the budget"
                else:
                    outcome.reason = (f"accepted; not faster than the incumbent {incumbent.plan} by more than the "
                                      "margin")
            else:
                outcome.reason = self._loss_reason(outcome)
        if replaced:
            self._promote(outcome)
        if paired is not None:  # logged with the candidate's: a resumed search replays both epochs or neither
            self._record_incumbent_again(paired)
        self._record(outcome)
        return replaced


@dataclass
class Stage1Result:
    best: Outcome
    baseline: Outcome
    samples: list[Outcome]
    mode: str
    #: each duel Stage 1 ran: (incumbent's plan, challenger's plan, verdict with the seconds of every round)
    duels: list[tuple[Assignment, Assignment, Verdict]] = field(default_factory=list)
    #: FP32's and AMP's epochs took turns on the same batches (their pairs were their duel)
    first_epochs_in_turns: bool = False

    @property
    def loss0(self) -> float:
        return self.baseline.loss


def run_stage1(space: SearchSpace, evaluator, *, threshold: float = 1.01, budget: int = 64, prune: bool = True,
               report: Reporter | None = None, predict: Predict | None = None, margin: float = 1.25,
               bound: Predict | None = None, early_stop: float | None = None, rule: DecisionRule = DecisionRule(),
               memory_budget: int | None = None, bound_against: BoundAgainst | None = None,
               price_version: Callable[[], int] | None = None) -> Stage1Result:
    """CoMP Algorithm 1 under compfx's decision rule, with exact pruning; ``budget`` caps samples after the baseline.

    ``evaluator`` is an :class:`~compfx.search.evaluator.Evaluator`. After the
    FP32 baseline, AMP's plan runs: it is the first incumbent, replaced by
    FP32's plan only under ``rule`` (:class:`~compfx.search.compare.DecisionRule`:
    faster by more than its margin, at its confidence). Then the other
    candidates run, most-low first, in a fixed order; each replaces the
    incumbent only under ``rule``. A sample stops as soon as its running cost
    reaches the rule's bar (it could no longer win). ``memory_budget`` (bytes a
    forward saves for backward, ``evaluator.saved_bytes``) rejects plans over
    it before they run. With ``predict(plan) -> predicted epoch seconds``
    (called only after the FP32 baseline has run, so it may calibrate on it;
    NaN when it cannot price a plan, which is then never skipped), a candidate
    whose ``cost(plan, predicted seconds)`` exceeds ``margin`` times the
    incumbent's measured cost is not run: it is logged with status
    ``skipped``, and does not count against ``budget``. An optional cheap
    ``bound(plan)`` that never exceeds ``predict(plan)`` skips without the full
    prediction when even the bound is over; it also stops Stage 1 when the
    bounds of all plans left are at the rule's bar or over (nothing can win).
    ``bound_against(plan, incumbent)``, a bound read off the incumbent's priced
    plan (never above ``predict(plan)`` either), replaces ``bound`` where it can
    be had. A plan whose bound is under the bar is priced in full, and skipped
    when its prediction is not under it (it is predicted not to win).
    ``price_version()`` moves when the predictor's prices change mid-stage (a
    duel scaled them down): figures priced before are then priced again.
    ``early_stop`` (a fraction, e.g. 0.05; None: off) stops a sample once its
    measured pace projects it more than that fraction over the incumbent;
    unlike pruning it can misjudge a near-tie.

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
    search = _Stage1(evaluator, threshold, prune, report, predict, margin, bound, early_stop, rule, memory_budget,
                     bound_against, price_version)
    amp = stage1_plan(space, {})  # AMP's plan: Tensor-Core ops low, lists as autocast has them, the rest follow
    in_turns = search.first_epochs_in_turns(space.fp32_plan, amp)
    if not in_turns:
        search.baseline(space.fp32_plan)
        search.first_incumbent(amp)
    mode = stage1_plan_space(space, budget)
    if mode == "exhaustive":
        _enumerate(search, stage1_candidates(space))
    elif mode == "grouped":
        _grouped(space, search, budget, report)
    else:
        _greedy(space, search, budget, report)
    if search.best is None:
        raise SearchError(f"no plan fits memory_budget={memory_budget} (activation bytes saved for backward): "
                          f"FP32's saves {search.saved_bytes(space.fp32_plan)}, AMP's {search.saved_bytes(amp)}. "
                          "Raise the budget, or train with smaller batches.")
    return Stage1Result(search.best, search.baseline_outcome, search.samples, mode, search.duels, in_turns)


def _enumerate(search: _Stage1, candidates: Sequence[Assignment]) -> bool:
    """Try ``candidates`` in order, stopping when the profiles show none left can win; False when it stopped."""
    for position, plan in enumerate(candidates):
        if plan in search.seen:
            continue
        if search.nothing_can_win(candidates[position:]):
            return False
        search.try_plan(plan)
    return True


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
    if not _enumerate(search, candidates):
        return
    best = search.best
    current = best.plan if best is not None and best is not search.samples[0] else candidates[-1]
    _refine(space, search, budget, report, current, [i for g in groups if len(g) > 1 for i in g])


def _greedy(space: SearchSpace, search: _Stage1, budget: int, report: Reporter | None) -> None:
    note(report, Stage.STAGE1, f"even the {len(space.groups_of(space.searched))} groups of same-kind, same-shape "
         f"ops exceed stage1_budget={budget}: starting from autocast's choice and changing one op at a time",
         mode="greedy")
    start = stage1_plan(space, {})  # AMP's plan, the first incumbent (already sampled)
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
