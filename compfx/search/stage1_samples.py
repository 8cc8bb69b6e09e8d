"""Stage 1's samples: one epoch per plan, pruned exactly, judged against the incumbent it keeps.

**Exact-safe pruning.** A sample run alone stops as soon as its running cost,
``evaluator.cost(plan, seconds so far)``, reaches the rule's bar (:meth:`Stage1Sampler.bar`,
the cost it must stay below to challenge the incumbent: it cannot win, as
costs only grow and ties keep the incumbent), or as soon as
a batch loss is NaN/inf (the epoch mean cannot be finite). This is exact --
the same plan wins as without pruning -- provided ``cost`` never decreases as
the seconds grow, as every cost of the form "seconds times or plus something
that depends on the plan" does.

**Judging.** An accepted plan (:func:`~compfx.search.convergence.is_accepted`)
replaces the incumbent only under the decision rule
(:class:`~compfx.search.compare.DecisionRule`: its screen, the batches, the
duel), and ties keep the incumbent. A plan whose program
(``evaluator.program``) was already sampled is not run again, and one over the
memory budget is rejected before it runs. ``early_stop`` also ends a sample
whose measured pace projects it over the incumbent; unlike pruning it is not
exact.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from ..errors import PlanFailedError, SearchError
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage
from .compare import COMP_RULE, Comparison, DecisionRule, Verdict, duel, log_duel
from .convergence import loss_limit
from .log import BATCH_VERDICT, PRUNED_AT, SAVED_BYTES, STOPPED_EARLY
from .outcome import Outcome, ProgramIndex, Reporter, checked_cost, failure_reason, note

__all__ = ["Stage1Settings", "Stage1Sampler", "EARLY_STOP_MIN_BATCHES"]

#: batches a Stage-1 sample runs before an early stop may judge its pace
EARLY_STOP_MIN_BATCHES = 3


@dataclass(frozen=True)
class Stage1Settings:
    """How Stage 1 decides (see :func:`~compfx.search.stage1.run_stage1`): the loss ``threshold`` of the
    convergence guard, exact pruning (``prune``), the pace stop (``early_stop``), the decision ``rule``, and the
    ``memory_budget`` (activation bytes saved for backward)."""

    threshold: float = 1.01
    prune: bool = True
    early_stop: float | None = None
    rule: DecisionRule = COMP_RULE
    memory_budget: int | None = None


class Stage1Sampler:
    """Runs samples and keeps the incumbent (the best accepted plan under the decision rule)."""

    def __init__(self, evaluator, settings: Stage1Settings, report: Reporter | None):
        self.evaluator, self.threshold, self.prune = evaluator, settings.threshold, settings.prune
        self.report = report or (lambda record: None)
        self.early_stop = settings.early_stop
        self.rule, self.memory_budget = settings.rule, settings.memory_budget
        self.samples: list[Outcome] = []
        self.seen: set[Assignment] = set()
        self.programs = ProgramIndex(evaluator.program)
        self.best: Outcome | None = None  # the incumbent; None while no accepted plan fits the memory budget
        self.baseline_outcome: Outcome | None = None
        self.duels: list[tuple[Assignment, Assignment, Verdict]] = []  # (incumbent, challenger, verdict), in order
        self.loss0: float | None = None
        self.known_bytes: dict[Assignment, int | None] = {}  # plan -> activation bytes it saves, once asked

    def cost(self, plan: Assignment, seconds: float) -> float:
        return checked_cost(self.evaluator, plan, seconds)

    # -- memory ------------------------------------------------------------------------
    def saved_bytes(self, plan: Assignment) -> int | None:
        """The activation bytes ``plan`` saves (None: unknown, or the plan failed; its sample will say why)."""
        if plan not in self.known_bytes:
            try:
                found = self.evaluator.saved_bytes(plan)
            except PlanFailedError:
                found = None
            self.known_bytes[plan] = None if found is None else int(found)
        return self.known_bytes[plan]

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
        nbytes = self.known_bytes.get(plan)
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

    def took_batch(self, outcome: Outcome, loss: float, seconds: float, *, prune: bool) -> bool:
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

    def finished(self, outcome: Outcome) -> None:
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
            if not self.took_batch(outcome, loss, seconds, prune=self.prune):
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
        self.finished(outcome)
        return artifact

    def _bar_words(self) -> str:
        return f"the incumbent {self.best.plan} (cost {self.best.cost:.6g})" if self.best is not None else "it"

    def baseline(self, plan: Assignment) -> Outcome:
        self.saved_bytes(plan)
        return self.settle_baseline(self.sample(plan))

    def settle_baseline(self, outcome: Outcome) -> Outcome:
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

    def promote(self, outcome: Outcome) -> None:
        if self.best is not None:
            self.best.artifact = None  # only the incumbent's trained state is kept
        self.best = outcome

    def record(self, outcome: Outcome) -> None:
        if outcome is not self.best:
            outcome.artifact = None
        self.samples.append(outcome)
        self.report(outcome.record(Stage.STAGE1))

    def loss_reason(self, outcome: Outcome) -> str:
        return (f"loss {outcome.loss:.6g} not below {loss_limit(self.loss0, self.threshold):.6g} "
                f"(loss_0 {self.loss0:.6g} x threshold {self.threshold})")

    def same_program_sampled(self, plan: Assignment) -> bool:
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
