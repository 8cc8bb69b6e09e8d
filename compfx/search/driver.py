"""The driver: runs Stage 1, Stage 2 and the loss check on one evaluator, then lets a strategy decide.

:func:`run_search` is the whole CoMP search over an
:class:`~compfx.search.evaluator.Evaluator`. What happens after the check is a
:class:`Strategy`: in one process the checked plan stands
(:data:`SINGLE_PROCESS`); under ``torch.distributed`` the ranks agree on one
plan, or each gets its own (:mod:`compfx.integrations.distributed`).

:class:`Recorder` is the ``report`` callable the stages write to: it drops
records a resumed log already holds, adds the cost model's predictions, appends
to the log and moves the progress bar.

>>> from compfx.search.evaluator import FunctionEvaluator
>>> from compfx.search.config import SearchConfig
>>> from compfx.vocabulary import Category as C
>>> space = SearchSpace((C.WHITELIST, C.OTHER, C.BLACKLIST), (False,) * 3, ("a", "b", "c"))
>>> def run_epoch(plan):  # low precision is faster and never hurts the loss
...     for _ in range(2):
...         yield 1.0, 1.0 - 0.25 * str(plan).count("0")
>>> fake = FunctionEvaluator(run_epoch=run_epoch, time_step=lambda plan: 1.0 - 0.25 * str(plan).count("0"),
...                          check_loss=lambda plan, batches: 1.0)
>>> str(run_search(space, fake, SearchConfig(progress=False)).plan)  # no segment for Stage 2 to time
'0f0'
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Mapping, Protocol, Sequence

from ..errors import PlanFailedError
from ..measure import PhaseClock
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage
from .compare import AFTER_THE_SEARCH, MAX_DUEL_BLOCKS, Comparison, StepComparison, speedup_measured
from .config import SearchConfig
from .convergence import check_winner
from .evaluator import Replay
from .log import BATCHES, DUEL, SampleRecord, SearchLog
from .outcome import Reporter, failure_reason
from .space import SearchSpace
from .stage1 import Stage1Result, run_stage1
from .stage2 import Stage2Result, run_stage2

__all__ = ["Strategy", "SingleProcess", "SINGLE_PROCESS", "Decision", "Recorder", "run_search", "compare_steps",
           "comparison_of"]


class Strategy(Protocol):
    """The step after the loss check: which plan this process runs (agreement, per-device allocation)."""

    def decide(self, checked: Assignment, *, stage1: Stage1Result, evaluator, report: Reporter) -> Assignment:
        """This process's plan, from the plan that passed the check on this process."""

    def finish(self) -> None:
        """After the search has put the model in its final state (e.g. give every rank the same state)."""


class SingleProcess:
    """One process: the checked plan stands."""

    def decide(self, checked: Assignment, *, stage1: Stage1Result, evaluator, report: Reporter) -> Assignment:
        return checked

    def finish(self) -> None:
        pass


SINGLE_PROCESS = SingleProcess()


@dataclass
class Decision:
    """What :func:`run_search` found: the plan to run, and what the stages saw."""

    plan: Assignment
    stage1: Stage1Result
    stage2: Stage2Result


def run_search(space: SearchSpace, evaluator, config: SearchConfig, *, report: Reporter | None = None,
               predictor=None, strategy: Strategy = SINGLE_PROCESS) -> Decision:
    """CoMP's two stages and the loss check on ``evaluator``, then ``strategy``'s decision.

    ``predictor`` (a :class:`compfx.costmodel.SearchPredictor`, or None for the
    exact search) skips candidates, stops a stage when no plan left can win
    (:mod:`compfx.search.compare`), and enables ``config.early_stop``.
    """
    guided = predictor is not None
    rule = config.decision
    # per-device plans: each rank's budget is the allocator's to meet (the ranks' stages must decide alike)
    budget = None if config.per_device else config.memory_budget
    stage1 = run_stage1(space, evaluator, threshold=config.threshold, budget=config.stage1_budget,
                        prune=config.prune, report=report,
                        predict=predictor.epoch_seconds if guided else None,
                        bound=predictor.lower_bound_seconds if guided else None,
                        margin=config.predictor_margin, early_stop=config.early_stop if guided else None,
                        rule=rule, memory_budget=budget,
                        bound_against=predictor.lower_bound_against if guided else None,
                        price_version=_price_version(predictor) if guided else None)
    stage2 = run_stage2(space, stage1.best.plan, evaluator, budget=config.stage2_budget, report=report, rule=rule,
                        memory_budget=budget, bound=predictor.step_lower_bound if guided else None,
                        predict=predictor.step_seconds if guided else None,
                        bound_against=predictor.step_lower_bound_against if guided else None,
                        price_version=_price_version(predictor) if guided else None)
    checked = check_winner(evaluator, stage2.best.plan, stage1.best.plan, stage1.baseline,
                           batches=config.stage2_check_batches, threshold=config.threshold, report=report)
    chosen = strategy.decide(checked, stage1=stage1, evaluator=evaluator, report=report or (lambda record: None))
    return Decision(chosen, stage1, stage2)


def _price_version(predictor):
    """What moves when ``predictor``'s prices change (a duel's evidence scaled them): stages price again then."""
    return lambda: getattr(predictor, "version", 0)


class Recorder:
    """The ``report`` callable of a search: replayed records dropped, predictions added, the log written.

    ``replay`` knows which records a resumed log already holds; ``predictor``
    (optional) calibrates on the FP32 baseline and annotates measured samples,
    charged to ``clock``'s "profiling" phase; ``progress`` is a tqdm bar (or None).
    """

    def __init__(self, log: SearchLog, *, replay: Replay | None = None, predictor=None, progress=None,
                 clock: PhaseClock | None = None):
        self.log, self.replay, self.predictor, self.progress = log, replay, predictor, progress
        self.clock = clock  # the cost model's work here (calibrating, profiling again) is charged to "profiling"

    def __call__(self, record: SampleRecord) -> None:
        fresh = self.replay.annotate(record) if self.replay is not None else record  # None: already logged
        record = fresh or record
        if self.predictor is not None and record.is_sample and record.plan:
            record = self._annotated(record, lambda: self.predictor.observe(
                record.stage, Assignment.parse(record.plan), record.status, record.seconds, record.batches,
                batch_seconds=[s for _, s in record.extra.get(BATCHES, [])]))
        elif self.predictor is not None and DUEL in record.extra:  # a duel checks the predicted ratio of its plans
            duel = record.extra[DUEL]
            record = self._annotated(record, lambda: self.predictor.observe_duel(
                Assignment.parse(duel["incumbent"]), Assignment.parse(duel["candidate"]), *duel["seconds"]))
        if fresh is not None:
            self.log.append(record)
        if record.is_sample and self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(f"{record.stage} {record.status}", refresh=False)

    def _annotated(self, record: SampleRecord, observe) -> SampleRecord:
        """``record`` with what ``observe()`` (the cost model's work, charged to "profiling") adds to its extra."""
        with self.clock.phase("profiling") if self.clock is not None else nullcontext():
            extra = observe()
        return replace(record, extra={**record.extra, **extra}) if extra else record


def compare_steps(time_steps, saved_bytes, plans: Mapping[str, Assignment], log: SearchLog, *, rounds: int,
                  confidence: float, margin: float | None = None) -> StepComparison:
    """The report's step comparison: the named plans take turns on the same batches, warm, in one phase.

    ``time_steps(plans, rounds)`` (an evaluator's) times each distinct plan
    once per round (a name that shares another's plan shares its timings), and
    ``saved_bytes(plan)`` measures each one's saved activations. A plan that
    fails is logged and left out, the others timed again together (the
    comparison is informative only, never a reason to fail the search). As an
    undecided duel does, the plans take another block of ``rounds`` rounds
    while the chosen plan's speed-up over FP32's or AMP's is unclear (its
    interval holds 1 while its median is more than ``margin`` from 1: one burst
    of other work on the machine in a round of seven does that), up to
    :data:`~compfx.search.compare.MAX_DUEL_BLOCKS` blocks (``margin=None``:
    one block, as ranks of ``torch.distributed`` must all take the same steps).
    Each plan's rounds are logged as a ``compare`` record.
    """
    timed = list(dict.fromkeys(plans.values()))
    try:
        rows = time_steps(timed, rounds)
    except PlanFailedError:
        for plan in list(timed):  # which one failed: each alone, one step
            try:
                time_steps([plan], 1)
            except PlanFailedError as error:
                timed.remove(plan)
                log.append(SampleRecord(Stage.COMPARE, str(plan), SampleStatus.ERROR, reason=failure_reason(error)))
        rows = time_steps(timed, rounds) if timed else []
    seconds = {plan: list(row) for plan, row in zip(timed, rows)}
    for _ in range(MAX_DUEL_BLOCKS - 1 if margin is not None else 0):
        if not _speedup_unclear(seconds, plans, confidence, margin):
            break
        try:
            more = time_steps(timed, rounds)
        except PlanFailedError:  # it ran a block already: the comparison stands on that
            break
        for plan, row in zip(timed, more):
            seconds[plan].extend(row)
    return comparison_of(seconds, saved_bytes, plans, log, confidence=confidence)


def _speedup_unclear(seconds: Mapping[Assignment, Sequence[float]], plans: Mapping[str, Assignment],
                     confidence: float, margin: float) -> bool:
    """Is the chosen plan's speed-up over FP32's or AMP's not measured (:func:`~compfx.search.compare.speedup_measured`:
    the report would say "no measurable difference") while its median is more than ``margin`` from 1?"""
    chosen = seconds.get(plans.get("chosen"))
    for name in ("fp32", "amp"):
        other = seconds.get(plans.get(name))
        if not chosen or not other or plans.get(name) == plans.get("chosen"):
            continue
        middle, low, high = Comparison.of(other, chosen).speedup(confidence)
        if not speedup_measured(low, high) and abs(middle - 1.0) > margin:
            return True
    return False


def comparison_of(seconds_by_plan: Mapping[Assignment, Sequence[float]], saved_bytes,
                  plans: Mapping[str, Assignment], log: SearchLog, *, confidence: float,
                  phase: str = AFTER_THE_SEARCH) -> StepComparison:
    """The report's step comparison of ``plans`` from one interleaved phase's seconds per round of each distinct
    plan (a plan missing from it failed), with each plan's saved activations; each plan's rounds logged as a
    ``compare`` record."""
    seconds = {plan: tuple(map(float, row)) for plan, row in seconds_by_plan.items()}
    saved: dict[str, int] = {}
    for name, plan in plans.items():
        try:
            nbytes = saved_bytes(plan)
        except PlanFailedError:
            nbytes = None
        if nbytes is not None:
            saved[name] = int(nbytes)
    comparison = StepComparison({name: str(plan) for name, plan in plans.items()},
                                {name: seconds[plan] for name, plan in plans.items() if plan in seconds},
                                confidence, saved, phase)
    for plan, row in seconds.items():
        names = [name for name, p in plans.items() if p == plan]
        log.append(SampleRecord(Stage.COMPARE, str(plan), SampleStatus.ACCEPTED, seconds=statistics.median(row),
                                reason=", ".join(names), extra={"round_seconds": list(row), "phase": phase}))
    return comparison
