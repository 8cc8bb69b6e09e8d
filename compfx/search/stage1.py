"""CoMP Stage 1 (Algorithm 1): one epoch per plan of the Stage-1 ops, kept only if its loss tracks FP32's.

An FP32 epoch gives ``loss_0`` (and is the fallback plan); it and AMP's epoch take
turns on the same batches where the evaluator can run them so (their pairs are
their duel). Tensor-Core-eligible
whitelist ops are fixed to low and "other" ops to follow; the adjustable ops
(blacklist, and whitelist without Tensor Cores) are tried at both precisions.
With FP8 in the space (``SearchConfig(fp8=True)``), an op that can run FP8 also
tries it, as a third level (:meth:`SearchSpace.levels`); the guard is the same.
A plan is accepted when :func:`~compfx.search.convergence.is_accepted`; an
accepted plan replaces the incumbent (AMP's plan first) only under the
decision rule (:class:`~compfx.search.compare.DecisionRule`), and ties keep
the incumbent.

This module runs the stage (:func:`run_stage1`: the first incumbent, then one
trial per candidate); its parts are modules of their own:

* :mod:`~compfx.search.stage1_space`: the candidates, and how the stage
  covers them within its budget;
* :mod:`~compfx.search.stage1_samples`: sampling, exact pruning, and judging
  against the incumbent;
* :mod:`~compfx.search.stage1_screen`: the cost-model screen, which skips
  candidates the profiles show cannot win;
* :mod:`~compfx.search.stage1_turns`: epochs taking turns with the incumbent's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import SearchError
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage
from .compare import COMP_RULE, DecisionRule, Verdict
from .convergence import is_accepted
from .stage1_screen import (BoundAgainst, CostModelScreen, Predict, Pricing, cannot_win_message, should_skip,
                                skip_message)
from .log import PRUNED_AT, SAVED_BYTES
from .outcome import Outcome, Reporter, note
from .space import SearchSpace
from .stage1_space import stage1_candidates, stage1_plan, stage1_plan_space, try_candidates
from .stage1_samples import EARLY_STOP_MIN_BATCHES, Stage1Sampler, Stage1Settings
from .stage1_turns import IncumbentTurns

__all__ = [
    "Stage1Result", "run_stage1", "stage1_plan", "stage1_plan_space", "stage1_candidates", "should_skip",
    "skip_message", "cannot_win_message", "EARLY_STOP_MIN_BATCHES",
]


class _Stage1(Stage1Sampler):
    """Stage 1's trials: the first incumbent, then each candidate screened, sampled (in turns with the incumbent
    where it can be) and judged."""

    def __init__(self, evaluator, settings: Stage1Settings, pricing: Pricing, report: Reporter | None):
        super().__init__(evaluator, settings, report)
        self.screen = CostModelScreen(pricing, evaluator, self.rule, self.report)
        self.turns = IncumbentTurns(self, self.screen)

    def nothing_can_win(self, candidates: Sequence[Assignment]) -> bool:
        """True (and a note) when the profiles show that none of ``candidates`` not yet seen can win (see
        :meth:`CostModelScreen.nothing_can_win`): Stage 1 stops instead of sampling them."""
        return self.screen.nothing_can_win([plan for plan in candidates if plan not in self.seen], self.best)

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
        if self.same_program_sampled(amp):
            return
        over = self.over_budget(amp)
        if over:
            self.record(Outcome(amp, SampleStatus.REJECTED, reason=f"AMP's plan {over}"))
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
        self.screen.annotate(outcome)
        if outcome.status is SampleStatus.PRUNED and PRUNED_AT not in outcome.extra:  # a non-finite loss
            outcome.reason = "AMP's plan: " + outcome.reason
            self.record(outcome)
            return
        if outcome.status is SampleStatus.PRUNED:  # FP32 passes the screen against its cost so far; the duel decides
            if self.judge(outcome, fp32):  # the batches it ran: up to where it crossed the bar
                outcome.reason = f"AMP's plan, the first incumbent: FP32's plan is faster by more than the margin " \
                                 f"({outcome.reason})"
                self.record(outcome)
                return
            note(self.report, Stage.STAGE1, f"the duel kept AMP's plan {amp} against FP32's, although its pruned "
                 "epoch cost more: its epoch runs again in full, for its loss", plan=str(amp))
            outcome = self.sample(amp)
            self.screen.annotate(outcome)
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
                    self.promote(outcome)
            else:
                outcome.reason = "AMP's plan: " + self.loss_reason(outcome)
        self.record(outcome)

    def _crossing(self, outcome: Outcome, bar: float) -> int:
        """How many batches ``outcome``'s epoch had run when its running cost passed ``bar`` (all: never): the batches
        a run that stopped it at the bar would have."""
        running = 0.0
        for i, seconds in enumerate(outcome.batch_seconds, 1):
            running += seconds
            if self.cost(outcome.plan, running) >= math.nextafter(bar, math.inf):
                return i
        return len(outcome.batch_seconds)

    def try_plan(self, plan: Assignment) -> bool:
        """Sample ``plan`` (once); True when it replaced the incumbent."""
        if plan in self.seen:
            return False
        self.seen.add(plan)
        if self.screen.skipped(plan, self.best) or self.same_program_sampled(plan):
            return False
        over = self.over_budget(plan)
        if over:
            self.record(Outcome(plan, SampleStatus.REJECTED, reason=over, extra={SAVED_BYTES: self.saved_bytes(plan)}))
            return False
        incumbent = self.best
        paired = self.turns.sample_taking_turns(plan)
        if paired is None:
            self.turns.incumbent_alone()
            outcome = self.sample(plan, self.bar(plan))
        else:
            outcome = paired.outcome
        self.screen.annotate(outcome)
        replaced = False
        if outcome.status is SampleStatus.REJECTED:
            if is_accepted(outcome.loss, self.loss0, self.threshold):
                outcome.status = SampleStatus.ACCEPTED
                if paired is not None:
                    replaced = self.turns.judge_pairs(paired)
                else:
                    replaced = incumbent is None or self.judge(incumbent, outcome)
                if replaced:
                    outcome.reason = "new incumbent" if incumbent is not None else "the first plan within the budget"
                else:
                    outcome.reason = (f"accepted; not faster than the incumbent {incumbent.plan} by more than the "
                                      "margin")
            else:
                outcome.reason = self.loss_reason(outcome)
        if replaced:
            self.promote(outcome)
        if paired is not None:  # logged with the candidate's: a resumed search replays both epochs or neither
            self.turns.record_incumbent_again(paired)
        self.record(outcome)
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
               bound: Predict | None = None, early_stop: float | None = None, rule: DecisionRule = COMP_RULE,
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
    settings = Stage1Settings(threshold=threshold, prune=prune, early_stop=early_stop, rule=rule,
                              memory_budget=memory_budget)
    pricing = Pricing(predict=predict, margin=margin, bound=bound, bound_against=bound_against,
                      price_version=price_version)
    search = _Stage1(evaluator, settings, pricing, report)
    amp = stage1_plan(space, {})  # AMP's plan: Tensor-Core ops low, lists as autocast has them, the rest follow
    in_turns = search.turns.first_epochs_in_turns(space.fp32_plan, amp)
    if not in_turns:
        search.baseline(space.fp32_plan)
        search.first_incumbent(amp)
    mode = stage1_plan_space(space, budget)
    try_candidates(space, search, mode, budget, report)
    if search.best is None:
        raise SearchError(f"no plan fits memory_budget={memory_budget} (activation bytes saved for backward): "
                          f"FP32's saves {search.saved_bytes(space.fp32_plan)}, AMP's {search.saved_bytes(amp)}. "
                          "Raise the budget, or train with smaller batches.")
    return Stage1Result(search.best, search.baseline_outcome, search.samples, mode, search.duels, in_turns)
