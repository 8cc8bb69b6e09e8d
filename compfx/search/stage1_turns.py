"""Stage 1's epochs taking turns with the incumbent's, on the same batches.

Where the evaluator can run epochs in turns (``run_epochs_taking_turns``),
FP32's and AMP's epochs take turns (their pairs are their duel:
:meth:`IncumbentTurns.first_epochs_in_turns`), and each candidate's epoch runs
with the incumbent's again (:meth:`IncumbentTurns.sample_taking_turns`): the
screen and the pruning look at their pairs, by the decision rule's own
verdict, and the pairs open their duel. A burst of other work then slows both
plans' steps alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from ..errors import PlanFailedError
from ..measure import interleaved_order
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage
from .compare import MAX_DUEL_BLOCKS, Comparison, Verdict, duel, log_duel
from .convergence import is_accepted
from .stage1_screen import CostModelScreen
from .log import BATCH_VERDICT, INCUMBENT_AGAIN, PRUNED_AT, SAVED_BYTES, STOPPED_EARLY
from .outcome import Outcome, failure_reason, note
from .stage1_samples import EARLY_STOP_MIN_BATCHES, Stage1Sampler

__all__ = ["IncumbentTurns", "Paired"]

#: pairs of FP32's and AMP's epochs in turns that their duel does not count (the warm-up of a duel)
_TURNS_WARMUP = 1


@dataclass
class Paired:
    """A candidate's epoch run taking turns with the incumbent's (:meth:`IncumbentTurns.sample_taking_turns`)."""

    incumbent: Outcome  # the incumbent's epoch again: its batches are the pairs' first halves
    outcome: Outcome  # the candidate's sample
    saves_less: bool  # the candidate saves fewer activation bytes than the incumbent (the rule's looser bar)
    verdict: Verdict | None = None  # on the pairs at the last block

    def pairs(self) -> tuple[list[float], list[float]]:
        """(incumbent's, candidate's) seconds of the batches both ran, but the first (the duel's warm-up)."""
        count = min(self.incumbent.batches, self.outcome.batches)
        start = _TURNS_WARMUP if count > _TURNS_WARMUP else 0
        return self.incumbent.batch_seconds[start:count], self.outcome.batch_seconds[start:count]


class IncumbentTurns:
    """Runs epochs in turns with the incumbent's for ``sampler`` (which keeps the samples and the incumbent); the
    ``screen``'s prices go on the records."""

    def __init__(self, sampler: Stage1Sampler, screen: CostModelScreen):
        self.sampler, self.screen = sampler, screen
        self._incumbent_in_turns = False  # the incumbent's epoch took turns with another's: see incumbent_alone

    def first_epochs_in_turns(self, fp32: Assignment, amp: Assignment) -> bool:
        """FP32's baseline and AMP's plan (the first incumbent) in one phase; False, having run nothing, where they
        cannot be (then the sampler's ``baseline`` and Stage 1's ``first_incumbent`` run them one after the other).

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
        sampler = self.sampler
        turns = getattr(sampler.evaluator, "run_epochs_taking_turns", None)
        if turns is None or amp == fp32 or not sampler.rule.rounds or amp in sampler.seen:
            return False
        try:
            if (sampler.over_budget(fp32) or sampler.over_budget(amp)
                    or sampler.programs.program(amp) == sampler.programs.program(fp32)):
                return False
            epochs = turns([fp32, amp])
        except PlanFailedError:  # AMP's plan does not build: one after the other, where its failure is recorded
            return False
        if epochs is None:
            return False
        base, first = Outcome(fp32, SampleStatus.REJECTED), Outcome(amp, SampleStatus.REJECTED)
        for outcome in (base, first):
            nbytes = sampler.known_bytes.get(outcome.plan)
            if nbytes is not None:
                outcome.extra[SAVED_BYTES] = nbytes
        saves_less = sampler.saves_less(fp32, amp)
        try:
            verdict = self._run_in_turns(epochs, base, first, saves_less)
        finally:
            for epoch in epochs:
                epoch.close()
        pairs = 0 if verdict is None else len(verdict.seconds[0])
        if (verdict is not None and first.status is SampleStatus.REJECTED and base.loss is not None
                and is_accepted(first.loss, base.loss, sampler.threshold)):  # a plan the guard rejects needs no duel
            verdict = self._more_blocks(verdict.seconds, amp, fp32, saves_less)
        sampler.seen.update((fp32, amp))
        sampler.programs.earlier_twin(fp32)
        sampler.programs.earlier_twin(amp)
        sampler.settle_baseline(base)
        self._settle_first_in_turns(first, verdict)
        self._incumbent_in_turns = True
        if verdict is not None:
            log_duel(sampler.report, Stage.STAGE1, verdict, amp, fp32, sampler.rule.rounds, epoch_pairs=pairs)
            sampler.duels.append((amp, fp32, verdict))
        return True

    def incumbent_alone(self) -> None:
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
        best = self.sampler.best
        if not self._incumbent_in_turns or best is None:
            return
        self._incumbent_in_turns = False
        alone = self.sampler.sample(best.plan)
        if alone.status is not SampleStatus.REJECTED or alone.loss is None:  # failed alone: the figures in turns stand
            note(self.sampler.report, Stage.STAGE1, f"the incumbent {best.plan}'s epoch alone did not finish "
                 f"({alone.reason}); candidates are compared with its epoch in turns", plan=str(best.plan))
            return
        in_turns = best.cost
        best.batch_seconds, best.seconds, best.cost = alone.batch_seconds, alone.seconds, alone.cost
        alone.status, alone.artifact = SampleStatus.ACCEPTED, None
        alone.reason = (f"the incumbent, its epoch again, alone: cost {alone.cost:.6g} ({in_turns:.6g} taking turns "
                        "with FP32's or AMP's); the candidates' epochs, run alone, are compared with this one")
        alone.extra[INCUMBENT_AGAIN] = "alone"
        self.sampler.report(alone.record(Stage.STAGE1))

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
            if running[1] and pairs > 0 and pairs % self.sampler.rule.rounds == 0:
                verdict = self._verdict_on_pairs(Paired(first, base, saves_less))
                if verdict.replaces and self.sampler.rule.decided(verdict):  # FP32's plan has won: AMP's epoch stops
                    first.status = SampleStatus.PRUNED
                    first.reason = (f"FP32's plan is faster by more than the margin after {first.batches} of its "
                                    "batches, the plans taking turns")
                    running[1] = False
                    epochs[1].close()
            if not running[0] and base.status is not SampleStatus.REJECTED:  # the baseline failed: nothing to judge
                return None
        if first.batches and first.status is SampleStatus.REJECTED:
            verdict = self._verdict_on_pairs(Paired(first, base, saves_less))
        return verdict

    def _more_blocks(self, measured, incumbent: Assignment, candidate: Assignment, saves_less: bool) -> Verdict:
        """The duel of two epochs' pairs (``measured``: the incumbent's and the candidate's seconds), with blocks of
        ``rule.rounds`` pairs more while it is undecided (as any duel takes them:
        :func:`~compfx.search.compare.duel`), up to :data:`~compfx.search.compare.MAX_DUEL_BLOCKS` blocks' worth
        in all. A further block that fails ends it on the pairs so far (noted)."""
        def failed(error: PlanFailedError) -> None:
            note(self.sampler.report, Stage.STAGE1, f"a further block of the duel of {candidate} with the incumbent "
                 f"{incumbent} failed ({failure_reason(error)}); decided on the pairs so far", plan=str(candidate))

        return duel(self.sampler.evaluator, self.sampler.rule, incumbent, candidate, saves_less=saves_less,
                    measured=measured, failed=failed)

    def _turn(self, epoch, outcome: Outcome, *, stops_search: bool) -> bool:
        """One batch of ``outcome``'s epoch; False when its epoch ended (finished, failed, or pruned)."""
        start = time.perf_counter()
        try:
            loss, seconds = next(epoch)
        except StopIteration as stop:
            outcome.artifact = stop.value
            self.sampler.finished(outcome)
            return False
        except PlanFailedError as error:
            outcome.status, outcome.reason = SampleStatus.ERROR, failure_reason(error)
            return False
        finally:
            outcome.duration += time.perf_counter() - start
        return self.sampler.took_batch(outcome, loss, seconds, prune=self.sampler.prune or stops_search)

    def _settle_first_in_turns(self, outcome: Outcome, verdict: Verdict | None) -> None:
        """AMP's epoch, run in turns with FP32's: the incumbent when its loss holds and FP32's plan did not win."""
        sampler = self.sampler
        self.screen.annotate(outcome)
        if outcome.status is SampleStatus.PRUNED and outcome.loss is None:  # FP32's plan won on the pairs
            outcome.reason = f"AMP's plan, the first incumbent: {outcome.reason}"
            sampler.record(outcome)
            return
        if outcome.status is not SampleStatus.REJECTED:  # failed, or a non-finite loss
            outcome.reason = "AMP's plan: " + outcome.reason
            sampler.record(outcome)
            return
        if not is_accepted(outcome.loss, sampler.loss0, sampler.threshold):
            outcome.reason = "AMP's plan: " + sampler.loss_reason(outcome)
        elif verdict is not None and verdict.replaces:
            outcome.status = SampleStatus.ACCEPTED
            outcome.reason = "AMP's plan, the first incumbent: FP32's plan is faster by more than the margin"
        else:
            outcome.status = SampleStatus.ACCEPTED
            outcome.reason = "AMP's plan: the incumbent"
            sampler.promote(outcome)
        sampler.record(outcome)

    # -- a candidate's epoch taking turns with the incumbent's -------------------------------------------------
    def sample_taking_turns(self, plan: Assignment) -> Paired | None:
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
        :data:`~compfx.search.stage1_samples.EARLY_STOP_MIN_BATCHES` pairs stops before its first block. The
        incumbent's steps stop once the duel is decided or has taken
        :data:`~compfx.search.compare.MAX_DUEL_BLOCKS` blocks' worth of pairs,
        as a duel does.
        """
        sampler = self.sampler
        best, turns = sampler.best, getattr(sampler.evaluator, "run_epochs_taking_turns", None)
        if best is None or turns is None or not sampler.rule.rounds:
            return None
        try:
            epochs = turns([best.plan, plan])
        except PlanFailedError:  # the candidate does not build: alone, where its failure is recorded
            return None
        if epochs is None:
            return None
        paired = Paired(Outcome(best.plan, SampleStatus.ACCEPTED), Outcome(plan, SampleStatus.REJECTED),
                        sampler.saves_less(plan))
        for outcome in (paired.incumbent, paired.outcome):
            nbytes = sampler.known_bytes.get(outcome.plan)
            if nbytes is not None:
                outcome.extra[SAVED_BYTES] = nbytes
        try:
            self._advance_paired(epochs, paired)
        finally:
            for epoch in epochs:
                epoch.close()
        return paired

    def _advance_paired(self, epochs, paired: Paired) -> None:
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

    def _after_pair(self, paired: Paired) -> tuple[bool, bool]:
        """After a round of both epochs: (does the candidate's epoch go on, do the incumbent's steps go on)?"""
        rule = self.sampler.rule
        if self._paired_too_slow(paired):
            return False, False
        pairs = len(paired.pairs()[0])
        if not pairs or pairs % rule.rounds:
            return True, True
        paired.verdict = self._verdict_on_pairs(paired)
        if self.sampler.prune and not paired.verdict.comparison.median < paired.verdict.bar:
            self._cannot_win_on_pairs(paired)
            return False, False
        # decided, or as many pairs as a duel takes: the candidate goes on alone, for its loss
        decided = rule.decided(paired.verdict) or pairs >= MAX_DUEL_BLOCKS * rule.rounds
        return True, not decided

    def _pair_comparison(self, paired: Paired) -> Comparison:
        """The pairs' costs, incumbent's and candidate's (the first pair, which creates the optimizer's state
        again, is the duel's warm-up: :meth:`Paired.pairs`)."""
        incumbent, candidate = paired.pairs()
        return Comparison.of([self.sampler.cost(paired.incumbent.plan, s) for s in incumbent],
                             [self.sampler.cost(paired.outcome.plan, s) for s in candidate])

    def _verdict_on_pairs(self, paired: Paired) -> Verdict:
        """The rule's verdict of the candidate against the incumbent on their pairs."""
        verdict = self.sampler.rule.verdict(self._pair_comparison(paired), saves_less=paired.saves_less)
        return replace(verdict, seconds=tuple(map(tuple, paired.pairs())))

    def _paired_too_slow(self, paired: Paired) -> bool:
        """Early stop on pace, on the pairs: their median ratio more than ``early_stop`` over the bar after
        :data:`~compfx.search.stage1_samples.EARLY_STOP_MIN_BATCHES` pairs (before the first block can decide)."""
        sampler = self.sampler
        pairs = len(paired.pairs()[0])
        if sampler.early_stop is None or not sampler.prune or not EARLY_STOP_MIN_BATCHES <= pairs < sampler.rule.rounds:
            return False
        ratio, bar = self._pair_comparison(paired).median, sampler.rule.ratio_bar(paired.saves_less)
        if not ratio > (1.0 + sampler.early_stop) * bar:
            return False
        outcome = paired.outcome
        outcome.status, outcome.extra[STOPPED_EARLY] = SampleStatus.PRUNED, True
        outcome.cost = sampler.cost(outcome.plan, outcome.seconds)
        outcome.reason = (f"stopped early: taking turns with the incumbent {paired.incumbent.plan}, its cost is "
                          f"{ratio:.3f} x the incumbent's (median over {pairs} pairs), over "
                          f"{1.0 + sampler.early_stop:g} x {bar:g}, the most it may cost to challenge it")
        return True

    def _cannot_win_on_pairs(self, paired: Paired) -> None:
        outcome, verdict = paired.outcome, paired.verdict
        outcome.status, outcome.cost = SampleStatus.PRUNED, self.sampler.cost(outcome.plan, outcome.seconds)
        outcome.extra[PRUNED_AT] = verdict.bar
        outcome.reason = (f"taking turns with the incumbent {paired.incumbent.plan}, its cost is "
                          f"{verdict.comparison.median:.3f} x the incumbent's (median over "
                          f"{len(verdict.comparison.ratios)} pairs), not below {verdict.bar:g}: it cannot win")

    def judge_pairs(self, paired: Paired) -> bool:
        """Does the candidate (accepted, its epoch run in turns with the incumbent's) replace the incumbent? The
        verdict on their pairs, with blocks of ``rule.rounds`` pairs more while it is undecided (a duel); logged.

        The screen first: pairs whose median ratio is not below the bar run no
        duel (they would decide it at its first look). Fewer pairs than a block
        (a short epoch) screen, but the duel times blocks of its own: a verdict
        on them would be less sure than the rule's ``confidence``.
        """
        sampler = self.sampler
        pairs = paired.pairs()
        if pairs[0]:
            screen = self._verdict_on_pairs(paired)
            if not screen.comparison.median < screen.bar:
                paired.outcome.extra[BATCH_VERDICT] = (
                    f"taking turns with the incumbent, its cost is {screen.comparison.median:.3f} x the incumbent's "
                    f"(median over {len(pairs[0])} pairs), not below {screen.bar:g}: no duel")
                return False
        measured = pairs if len(pairs[0]) >= sampler.rule.rounds else ((), ())
        try:
            verdict = self._more_blocks(measured, paired.incumbent.plan, paired.outcome.plan, paired.saves_less)
        except PlanFailedError as error:
            note(sampler.report, Stage.STAGE1, f"duel of {paired.outcome.plan} with incumbent {paired.incumbent.plan} "
                 f"failed ({failure_reason(error)}); incumbent kept", plan=str(paired.outcome.plan))
            return False
        log_duel(sampler.report, Stage.STAGE1, verdict, paired.incumbent.plan, paired.outcome.plan, sampler.rule.rounds,
                 epoch_pairs=len(measured[0]))
        sampler.duels.append((paired.incumbent.plan, paired.outcome.plan, verdict))
        return verdict.replaces

    def record_incumbent_again(self, paired: Paired) -> None:
        """Log the incumbent's epoch in turns (its batches, for a resumed search to replay): not a new sample."""
        again = paired.incumbent
        again.artifact = None
        again.cost = self.sampler.cost(again.plan, again.seconds)
        again.reason = (f"the incumbent, its epoch again, taking turns with {paired.outcome.plan}'s for "
                        f"{again.batches} batches: their pairs are the duel's")
        again.extra[INCUMBENT_AGAIN] = str(paired.outcome.plan)
        self.sampler.report(again.record(Stage.STAGE1))
