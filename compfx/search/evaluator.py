"""Evaluators: how the search measures a plan. The stages see only this interface.

An :class:`Evaluator` answers four questions about a plan (an
:class:`~compfx.plan.Assignment`) and names what it runs:

* ``run_epoch(plan)``: a generator that trains one epoch under ``plan`` and
  yields ``(batch_loss, batch_seconds)`` per batch; its ``return`` value is an
  opaque artifact (the trained state) that the search keeps for the winner.
  Closing it early must restore whatever it changed.
* ``time_step(plan)``: seconds of one training step (Stage 2).
* ``time_steps(plans, rounds)``: seconds of one training step of each plan
  per round, the plans taking turns on the same batches, warm (the duels of
  :mod:`compfx.search.compare`, and the report's step comparison).
* ``saved_bytes(plan)``: activation bytes one forward under ``plan`` saves
  for backward (:func:`compfx.memory.saved_activation_bytes`), or None when the
  evaluator cannot tell (memory then plays no part in the decision).
* ``check_loss(plan, batches)``: mean training loss over the first ``batches``
  batches, from the initial state (the loss check).
* ``cost(plan, seconds)``: what the search minimises (``cost_unit``, an
  optional attribute: ``"s"`` when costs are seconds, ``""`` when they are in a
  cost function's own units; logs and reports print them so).
* ``program(plan)``: a hashable name of what ``plan`` runs; plans with equal
  programs measure the same, so only the first is run.
* ``run_epochs_taking_turns(plans)`` (optional): one epoch per plan, their
  steps taking turns on the same batches, each plan training a copy of the
  state of its own; the caller advances them in turns. None where that cannot
  be done (a second copy of the state may not fit). Stage 1 runs FP32's and
  AMP's epochs so when it can: their pairs are their duel.

A failure that belongs to the plan is raised as
:class:`~compfx.errors.PlanFailedError`: the search records the plan as
``error`` and goes on. Anything else stops the search.

Implementations here: :class:`LocalEvaluator` trains the real model in this
process (:mod:`compfx.search.sampling`); :class:`ReplayingEvaluator` wraps
another and serves samples a resumed log already holds (:class:`Replay` reads
them from the log's records);
:class:`FunctionEvaluator` adapts plain functions (tests, custom measurement).
Under ``torch.distributed``, :class:`compfx.search.distributed.SyncedEvaluator`
wraps one so that every rank sees the same numbers.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Generator, Hashable, Iterator, Protocol, Sequence, runtime_checkable

import torch
import torch.nn as nn

from ..graph_capture.held_state import HeldState
from ..errors import BadInputError, CaptureError, PlanFailedError, SearchError, SearchReplayError
from ..measure import PhaseClock, interleaved_order
from ..plan import Assignment, Plan
from ..state import restore_grads, restore_state, state_bytes
from ..vocabulary import SampleStatus, Stage
from .log import BATCHES, DUEL, REPLAYED_STAGES, SampleRecord
from .sampling import FairSampler, from_loader

__all__ = ["Evaluator", "Epoch", "FunctionEvaluator", "ReplayingEvaluator", "Replay", "ReplayedState",
           "LocalEvaluator", "plan_failures", "measured_time", "each_batch"]

#: A Stage-1 epoch: yields (loss, seconds) per batch, returns the trained state.
Epoch = Generator[tuple[float, float], None, Any]


@runtime_checkable
class Evaluator(Protocol):
    """What the search asks of a plan (see the module docstring)."""

    def run_epoch(self, plan: Assignment) -> Epoch: ...

    def time_step(self, plan: Assignment) -> float: ...

    def time_steps(self, plans: Sequence[Assignment], rounds: int) -> list[list[float]]: ...

    def saved_bytes(self, plan: Assignment) -> int | None: ...

    def check_loss(self, plan: Assignment, batches: int) -> float: ...

    def cost(self, plan: Assignment, seconds: float) -> float: ...

    def program(self, plan: Assignment) -> Hashable: ...


def measured_time(plan, seconds: float) -> float:
    """The default cost: the measured seconds themselves."""
    return seconds


@dataclass
class FunctionEvaluator:
    """An :class:`Evaluator` made of plain functions; the ones not given refuse to be called.

    ``cost`` defaults to the measured seconds and ``program`` to the plan
    itself (every plan runs a program of its own). ``time_steps`` defaults to
    calling ``time_step`` once per plan per round, in the interleaved order
    (:func:`compfx.measure.interleaved_order`): an injected noisy timer then
    sees the calls in the order a real duel makes them. ``saved_bytes``
    defaults to None (memory unknown). Without ``run_epochs_taking_turns``, Stage 1 runs FP32's and AMP's
    epochs one after the other.

    >>> timer = FunctionEvaluator(time_step=lambda plan: 0.5 * str(plan).count("1"))
    >>> timer.time_step(Assignment.parse("11")), timer.cost(Assignment.parse("11"), 1.0)
    (1.0, 1.0)
    >>> timer.time_steps([Assignment.parse("11"), Assignment.parse("01")], 2)
    [[1.0, 1.0], [0.5, 0.5]]
    """

    run_epoch: Callable[[Assignment], Epoch] | None = None
    time_step: Callable[[Assignment], float] | None = None
    check_loss: Callable[[Assignment, int], float] | None = None
    cost: Callable[[Assignment, float], float] = measured_time
    program: Callable[[Assignment], Hashable] = lambda plan: plan  # noqa: E731
    time_steps: Callable[[Sequence[Assignment], int], list[list[float]]] | None = None
    saved_bytes: Callable[[Assignment], int | None] = lambda plan: None  # noqa: E731
    run_epochs_taking_turns: Callable[[Sequence[Assignment]], list[Epoch] | None] | None = None

    def __post_init__(self):
        for name in ("run_epoch", "time_step", "check_loss"):
            if getattr(self, name) is None:
                setattr(self, name, functools.partial(_not_given, name))
        if self.time_steps is None:
            self.time_steps = self._interleaved

    def _interleaved(self, plans: Sequence[Assignment], rounds: int) -> list[list[float]]:
        seconds: list[list[float]] = [[] for _ in plans]
        for i in range(rounds):
            for j in interleaved_order(len(plans), i):
                seconds[j].append(float(self.time_step(plans[j])))
        return seconds

    @property
    def cost_unit(self) -> str:
        return "s" if self.cost is measured_time else ""


def _not_given(name: str, *args):
    raise SearchError(f"this FunctionEvaluator has no {name}; pass {name}=... to measure it")


@contextmanager
def plan_failures():
    """Turn what goes wrong while a plan runs into :class:`PlanFailedError` (the search tries the next plan).

    Bad input, search errors, a model that cannot be captured at a batch's
    shapes and what the sample loader raises are not the plan's: they stop the
    search, as does anything that is not an ``Exception`` (Ctrl-C).
    """
    try:
        yield
    except (PlanFailedError, BadInputError, SearchError, CaptureError):
        raise
    except Exception as error:
        if from_loader(error):  # the sample loader's own error: the caller's to see, not the plan's
            raise
        raise PlanFailedError(f"{type(error).__name__}: {error}") from error


# -- replaying a resumed search's log ----------------------------------------------------------

@dataclass(frozen=True)
class ReplayedState:
    """Stands in for the trained state of a Stage-1 epoch served from the log (it was not kept)."""

    plan: Assignment


class Replay:
    """Outcomes of logged samples, keyed by stage and plan, handed back instead of re-running them.

    It also records, per Stage-1 epoch that runs live, each batch's loss and
    seconds, which :meth:`annotate` adds to the log line so that a later resume
    can replay the epoch batch by batch (pruning decisions depend on them).

    >>> from compfx.search.log import SearchLog
    >>> log = SearchLog()
    >>> log.append(SampleRecord(Stage.STAGE2, "10", SampleStatus.ACCEPTED, seconds=0.5, cost=0.5))
    >>> Replay(log.records).time_step(Assignment.parse("10"))
    0.5
    """

    def __init__(self, records=()):
        records = list(records)
        #: per (stage, plan), its logged samples in order (a Stage-1 plan may be sampled twice: the incumbent)
        self.logged: dict[tuple[Stage, str], list[SampleRecord]] = {}
        self.skipped: set[tuple[Stage, str]] = set()  # never run (the cost model skipped them): nothing to replay
        for record in records:
            key = (record.stage, record.plan)
            if record.status is SampleStatus.SKIPPED:
                self.skipped.add(key)
            elif record.is_sample and record.stage in REPLAYED_STAGES:
                self.logged.setdefault(key, []).append(record)
        self.replayed: dict[tuple[Stage, str], int] = {}  # records served from the log, not yet annotated
        self._batches: dict[str, list[list[float]]] = {}
        self._duels: dict[tuple[str, ...], list[list[list[float]]]] = {}  # plans -> blocks of seconds per plan
        self._replayed_duels: set[tuple[str, ...]] = set()
        self._duels_of_epochs: set[tuple[str, ...]] = set()  # logged duels whose rounds were Stage-1 epochs
        for record in records:
            duel = record.extra.get(DUEL) if not record.is_sample else None
            if duel:
                rounds, seconds = int(duel["rounds"]), duel["seconds"]
                epoch_pairs = int(duel.get("epoch_pairs", 0))  # epochs taking turns: replayed as those epochs
                if epoch_pairs:
                    self._duels_of_epochs.add((duel["incumbent"], duel["candidate"]))
                blocks = self._duels.setdefault((duel["incumbent"], duel["candidate"]), [])
                for start in range(epoch_pairs, len(seconds[0]), rounds):
                    blocks.append([[float(s) for s in row[start:start + rounds]] for row in seconds])

    def has(self, stage: Stage, plan: Assignment) -> bool:
        """Does the log hold the plan's next sample of ``stage``? A Stage-1 epoch is served once per logged sample
        (a plan sampled twice, the incumbent, has two); a timing or a loss check as often as it is asked for."""
        return bool(self.logged.get((stage, str(plan))))

    def _take(self, stage: Stage, plan: Assignment) -> SampleRecord:
        key = (stage, str(plan))
        self.replayed[key] = self.replayed.get(key, 0) + 1
        records = self.logged[key]
        record = records.pop(0) if stage is Stage.STAGE1 or len(records) > 1 else records[0]
        if record.status is SampleStatus.ERROR:
            raise SearchReplayError(f"(replayed from the log) {record.reason}")
        return record

    def epoch(self, plan: Assignment, run_live: Callable[[], Iterator]) -> Iterator:
        """A Stage-1 epoch: the logged batches replayed, or the live epoch with its batches recorded."""
        if self.has(Stage.STAGE1, plan):
            return self._replay_epoch(plan)
        return self._record_epoch(plan, run_live())

    def _replay_epoch(self, plan: Assignment):
        record = self._take(Stage.STAGE1, plan)
        batches = record.extra.get(BATCHES)
        if batches is None:
            raise SearchError(f"the logged Stage-1 sample {plan} has no per-batch losses, so it cannot be "
                              "replayed; expected a log written by this compfx version. Search again without "
                              "resume=True.")
        for loss, seconds in batches:
            yield float(loss), float(seconds)
        return ReplayedState(plan)

    def _record_epoch(self, plan: Assignment, epoch):
        batches = self._batches[str(plan)] = []
        try:
            while True:
                loss, seconds = next(epoch)
                batches.append([loss, seconds])
                yield loss, seconds
        except StopIteration as stop:
            return stop.value
        finally:
            epoch.close()  # pruning closes this wrapper: let the live epoch restore the state

    def time_step(self, plan: Assignment) -> float:
        return float(self._take(Stage.STAGE2, plan).seconds)

    def duel_block(self, plans, rounds: int) -> list[list[float]] | None:
        """The next logged block of a duel between ``plans`` (incumbent, candidate), or None to time it live."""
        key = tuple(map(str, plans))
        blocks = self._duels.get(key)
        if not blocks or len(blocks[0][0]) != rounds:
            return None
        self._replayed_duels.add(key)
        return blocks.pop(0)

    def serve_duels(self, plans) -> None:
        """The duels of ``plans`` (in either order) are the logged ones: not logged again (epochs taking turns,
        replayed, are their own duel)."""
        names = tuple(map(str, plans))
        self._replayed_duels.update(key for key in (names, names[::-1]) if key in self._duels_of_epochs)

    def check_loss(self, plan: Assignment) -> float:
        return float(self._take(Stage.CHECK, plan).loss)

    def annotate(self, record: SampleRecord) -> SampleRecord | None:
        """The record to log: None when it was replayed (already in the log), with per-batch data for Stage 1."""
        key = (record.stage, record.plan)
        if self.replayed.get(key):
            self.replayed[key] -= 1  # this record came from the log: it is there already
            return None
        if record.status is SampleStatus.SKIPPED and key in self.skipped:
            return None
        duel = record.extra.get(DUEL) if not record.is_sample else None
        if duel and (duel["incumbent"], duel["candidate"]) in self._replayed_duels:
            return None  # its seconds came from the log, which holds this note already
        if record.stage is Stage.STAGE1 and record.plan in self._batches:
            batches = self._batches.pop(record.plan)
            return replace(record, extra={**record.extra, BATCHES: batches})
        return record


class ReplayingEvaluator:
    """Serves the samples a resumed search log already holds; runs the others on ``inner``.

    Stage-1 epochs that run live have their batches recorded, so the log line
    written for them can be replayed by a later resume (see :class:`Replay`).
    """

    def __init__(self, inner: Evaluator, replay: Replay):
        self.inner, self.replay = inner, replay

    def run_epoch(self, plan: Assignment) -> Epoch:
        return self.replay.epoch(plan, lambda: self.inner.run_epoch(plan))

    def run_epochs_taking_turns(self, plans: Sequence[Assignment]) -> list[Epoch] | None:
        """The logged epochs when the log holds every one of them (and their duel is not logged again), the
        inner evaluator's, recorded, when it holds none of them; None otherwise (one after the other, as logged)."""
        logged = [self.replay.has(Stage.STAGE1, plan) for plan in plans]
        if all(logged):
            self.replay.serve_duels(plans)
            return [self.replay.epoch(plan, None) for plan in plans]
        inner = getattr(self.inner, "run_epochs_taking_turns", None)
        epochs = inner(plans) if inner is not None and not any(logged) else None
        if epochs is None:
            return None
        return [self.replay.epoch(plan, lambda epoch=epoch: epoch) for plan, epoch in zip(plans, epochs)]

    def time_step(self, plan: Assignment) -> float:
        if self.replay.has(Stage.STAGE2, plan):
            return self.replay.time_step(plan)
        return self.inner.time_step(plan)

    def time_steps(self, plans: Sequence[Assignment], rounds: int) -> list[list[float]]:
        logged = self.replay.duel_block(plans, rounds)
        return logged if logged is not None else self.inner.time_steps(plans, rounds)

    def saved_bytes(self, plan: Assignment) -> int | None:
        return self.inner.saved_bytes(plan)

    def check_loss(self, plan: Assignment, batches: int) -> float:
        if self.replay.has(Stage.CHECK, plan):
            return self.replay.check_loss(plan)
        return self.inner.check_loss(plan, batches)

    def cost(self, plan: Assignment, seconds: float) -> float:
        return self.inner.cost(plan, seconds)

    @property
    def cost_unit(self) -> str:
        return getattr(self.inner, "cost_unit", "s")

    def program(self, plan: Assignment) -> Hashable:
        return self.inner.program(plan)


class LocalEvaluator:
    """Trains the real model in this process: each plan applied to it, each sample from the same state.

    ``cost_fn(plan, seconds)`` takes the :class:`~compfx.plan.Plan`;
    ``warmup`` untimed steps precede every timed sample and ``repeats`` timed
    steps make a Stage-2 timing (their median counts). ``clock`` (a
    :class:`~compfx.measure.PhaseClock`) is charged the time spent rewriting
    plans (``"rewrites"``) and training samples (``"samples"``).
    """

    def __init__(self, model: nn.Module, analysis, sampler: FairSampler, *, warmup: int, repeats: int,
                 cost_fn: Callable[[Plan, float], float] = measured_time, clock: PhaseClock | None = None,
                 fp8_recipe=None):
        self.model, self.analysis, self.sampler = model, analysis, sampler
        self.warmup, self.repeats, self.cost_fn = warmup, repeats, cost_fn
        self.fp8_recipe = fp8_recipe  # how the plans' fp8 ops scale (None: the default recipe)
        self.clock = clock or PhaseClock()  # where the search's time goes: "rewrites" and "samples" are counted here
        self._plans: dict[Assignment, Plan] = {}
        self._modules: dict[Plan, nn.Module] = {}  # by Plan: a plan's padding is not in its Assignment
        self._runners: dict[Plan, nn.Module] = {}
        self._saved_bytes: dict[Assignment, int] = {}
        self._captures = None  # the model's captures per input signature, shared by every plan's runner
        self._held = HeldState(model)  # the model the search began with: every sample must train that one

    # -- plans and the modules that run them -------------------------------------------
    def plan(self, plan: Assignment) -> Plan:
        """The :class:`Plan` of an assignment (built once: ``cost_fn`` sees it once per batch)."""
        if plan not in self._plans:
            self._plans[plan] = Plan.from_assignment(self.analysis, plan, fp8_recipe=self.fp8_recipe)
        return self._plans[plan]

    def module(self, plan: Assignment) -> nn.Module:
        """The model rewritten to run ``plan`` (built once per plan; it shares the model's Parameters)."""
        return self.module_of(self.plan(plan))

    def module_of(self, plan: Plan) -> nn.Module:
        """:meth:`module` for a :class:`Plan` (the cost model prices plans; the padding decision pads them)."""
        if plan not in self._modules:
            from ..planned_module import planned_graph  # the apply stage imports the passes: load it when first needed

            with self.clock.phase("rewrites"):
                self._modules[plan] = planned_graph(self.model, plan, self.analysis)
        return self._modules[plan]

    def runner(self, plan: Assignment) -> nn.Module:
        """What the samples train: a :class:`~compfx.planned_module.PlannedModule` of ``plan``, which runs it at every input
        signature the loader has (a ragged last batch, varying sequence lengths); its first graph is :meth:`module`'s."""
        return self.runner_of(self.plan(plan))

    def runner_of(self, plan: Plan) -> nn.Module:
        """:meth:`runner` for a :class:`Plan` (a padded one: what the padding decision times and the search returns)."""
        self._check_same_model()
        if plan not in self._runners:
            from ..planned_module import PlannedModule, SignatureCaptures

            graph = self.module_of(plan)
            with self.clock.phase("rewrites"):
                if self._captures is None:
                    self._captures = SignatureCaptures(self.model, self.analysis)
                self._runners[plan] = PlannedModule(self.model, plan, analysis=self.analysis,
                                                    captures=self._captures, graph=graph)
        return self._runners[plan]

    def _check_same_model(self) -> None:
        """Refuse (:class:`~compfx.errors.BadInputError`) a model whose submodules were replaced since the search
        began (a forward that swaps a layer when it is captured again): later samples would train another model,
        one whose new layers the optimizer does not hold. Tensors swapped in place by their likes (FSDP2) are not a
        change."""
        if self._held.unchanged():
            return
        change = self._held.change()
        if change.modules:
            raise BadInputError(
                f"the model's submodules were replaced during the search ({', '.join(change.modules[:3])}): its "
                "forward (run again to capture new input shapes), a hook or another thread replaced them, so the "
                "samples would no longer train the model the search began with, nor layers the optimizer holds. "
                "Create submodules in __init__ and only call them in forward.")
        self._held = HeldState(self.model)

    def result_module(self, plan: Plan) -> nn.Module:
        """What the search returns for its chosen ``plan`` (``result.module``): the module its samples trained."""
        return self.runner_of(plan)

    def measuring(self) -> ContextManager:
        """What must hold while the search measures with this evaluator (here, nothing)."""
        return nullcontext()

    def specializations(self) -> tuple[int, list]:
        """(input signatures captured, every :class:`~compfx.planned_module.Specialization` of every plan's runner)."""
        captured = len(self._captures) if self._captures is not None else 1
        return captured, [s for runner in self._runners.values() for s in runner.specializations]

    def _calibrated(self) -> None:
        """Before the first sample with a GradScaler: one loss scale for all, found on the AMP plan
        (:meth:`~compfx.search.sampling.FairSampler.calibrate_scale`), the plan that casts what autocast casts."""
        if not self.sampler.grad_scaler or self.sampler.calibrated:
            return
        from ..plan import AMP_PRECISION

        amp = Assignment(AMP_PRECISION[op.category] for op in self.analysis.ops)
        try:
            with plan_failures():
                runner = self.runner(amp)
                with self.clock.phase("samples"):
                    self.sampler.calibrate_scale(runner)
        except PlanFailedError:  # the AMP plan fails on this model: samples start from GradScaler's own scale
            self.sampler.calibrated = True

    # -- the Evaluator interface --------------------------------------------------------
    def run_epoch(self, plan: Assignment) -> Epoch:
        self._calibrated()
        with plan_failures():
            runner = self.runner(plan)
            epoch = self.sampler.epoch(runner, warmup=self.warmup)
        charged = each_batch(epoch, lambda: self.clock.phase("samples"), close_around=True)
        return each_batch(charged, plan_failures)  # each batch's failure is the plan's

    def run_epochs_taking_turns(self, plans: Sequence[Assignment]) -> list[Epoch] | None:
        """One epoch per plan, their steps taking turns on the same batches, each plan training a copy of the state
        of its own (:meth:`~compfx.search.sampling.FairSampler.epochs_taking_turns`); None where those copies
        may not fit the device's memory."""
        if not self._copies_fit(len(plans) - 1):
            return None
        self._calibrated()
        with plan_failures():
            runners = [self.runner(plan) for plan in plans]
            with self.clock.phase("samples"):
                epochs = self.sampler.epochs_taking_turns(runners, warmup=self.warmup, switch=self._switch(plans))
        charged = [each_batch(epoch, lambda: self.clock.phase("samples"), close_around=True) for epoch in epochs]
        return [each_batch(epoch, plan_failures) for epoch in charged]  # each batch's failure is its own plan's

    def _copies_fit(self, copies: int) -> bool:
        """Do ``copies`` more copies of the training state fit the device, with room to spare? (Always, off CUDA.)"""
        device = self.analysis.device
        if device.type != "cuda" or copies <= 0:
            return True
        free, _ = torch.cuda.mem_get_info(device)
        return copies * state_bytes(self.sampler.initial) <= free // 2

    def time_step(self, plan: Assignment, *, repeats: int | None = None, warmup: int | None = None) -> float:
        """Median seconds of ``repeats`` timed steps after ``warmup`` untimed ones (default: the evaluator's)."""
        self._calibrated()
        with plan_failures():
            runner = self.runner(plan)
            with self.clock.phase("samples"):
                seconds = self.sampler.step_time(runner, warmup=self.warmup if warmup is None else warmup,
                                                 repeats=repeats or self.repeats).median
        return seconds

    def time_steps(self, plans: Sequence[Assignment], rounds: int, *, warmup: int | None = None
                   ) -> list[list[float]]:
        """Per plan, the seconds of one step per round, the plans taking turns on the same batches (warm)."""
        with plan_failures():
            runners = [self.runner(plan) for plan in plans]
            with self.clock.phase("samples"):
                seconds = self.sampler.interleaved_step_times(
                    runners, rounds=rounds, warmup=self.warmup if warmup is None else warmup, switch=self._switch(plans))
        return seconds

    def _switch(self, plans: Sequence[Assignment]) -> Callable[[int], object] | None:
        """What runs before a step of ``plans[j]`` in an interleaved timing (nothing: each plan is its own module)."""
        return None

    def saved_bytes(self, plan: Assignment) -> int:
        """Activation bytes one forward of ``plan`` saves for backward, on the loader's first batch (measured once)."""
        if plan not in self._saved_bytes:
            from ..memory import saved_activation_bytes  # memory reads the sampling helpers: imported when used

            with plan_failures():
                runner = self.runner(plan)
                with self.clock.phase("samples"):
                    args, kwargs = self.sampler.first_inputs(runner)
                    self._saved_bytes[plan] = saved_activation_bytes(runner, args, kwargs)
        return self._saved_bytes[plan]

    def time_plan(self, plan: Plan, *, repeats: int | None = None, warmup: int | None = None) -> float:
        """:meth:`time_step` for a :class:`Plan` (the padding decision times padded plans)."""
        with plan_failures():
            runner = self.runner_of(plan)
            with self.clock.phase("samples"):
                return self.sampler.step_time(runner, warmup=self.warmup if warmup is None else warmup,
                                              repeats=repeats or self.repeats).median

    def settle(self, plan: Assignment, runs: Plan) -> None:
        """From now on ``plan`` runs ``runs`` (the padding decision's padded version of it), so what is timed and
        measured of it afterwards (the report's step comparison) is what the search returns."""
        self._plans[plan] = runs
        self._saved_bytes.pop(plan, None)

    def check_loss(self, plan: Assignment, batches: int) -> float:
        self._calibrated()
        with plan_failures():
            runner = self.runner(plan)
            with self.clock.phase("samples"):
                return self.sampler.mean_loss(runner, batches)

    def cost(self, plan: Assignment, seconds: float) -> float:
        return self.cost_fn(self.plan(plan), seconds)  # the stages check it (outcome.checked_cost)

    @property
    def cost_unit(self) -> str:
        return "s" if self.cost_fn is measured_time else ""

    def program(self, plan: Assignment) -> Hashable:
        """The rewritten module's structure and code: equal text, equal program."""
        with plan_failures():
            return str(self.module(plan))

    # -- after the search ---------------------------------------------------------------
    def leave_state(self, winner, *, keep_training: bool) -> None:
        """Leave the model as the Stage-1 epoch of ``winner`` (an Outcome) trained it, or as it started.

        A winner served from a resumed log has no state of its own: its epoch is trained again. Either way the
        gradients are the user's from before the search (None where there were none), not the epoch's last step's:
        a training loop's next step replaces them, and kept they would hold a gradient-sized block of memory the
        user had freed (``optimizer.zero_grad()``).
        """
        artifact = winner.artifact if keep_training else None
        if isinstance(artifact, ReplayedState):
            artifact = self._retrained(artifact.plan)
        if artifact is None:
            self.sampler.restore()
        else:
            restore_state(artifact)
            restore_grads(self.sampler.initial)

    def _retrained(self, plan: Assignment):
        """Train the Stage-1 epoch of ``plan`` again (same seed, same start) and return its final state."""
        epoch = self.sampler.epoch(self.runner(plan), warmup=self.warmup)
        while True:
            try:
                next(epoch)
            except StopIteration as stop:
                return stop.value


def each_batch(epoch: Epoch, around: Callable[[], ContextManager], *, close_around: bool = False) -> Epoch:
    """``epoch``, with each of its batches (each ``next``) run inside ``around()``; closing it closes ``epoch``
    (inside ``around()`` too when ``close_around``: closing a pruned epoch restores the model)."""
    try:
        while True:
            with around():
                try:
                    item = next(epoch)
                except StopIteration as stop:
                    return stop.value
            yield item
    finally:
        with around() if close_around else nullcontext():
            epoch.close()
