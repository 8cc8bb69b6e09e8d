"""The search's predictor: Stage-1 epochs of assignments priced, and calibrated on the search's measurements.

:class:`SearchPredictor` is the predictor as the search uses it: it calibrates
a :class:`~compfx.costmodel.pricing.Predictor` (which prices a plan's
rewritten graph) on the FP32 baseline epoch, checks the profiles against
AMP's measured batches and later evidence, predicts epochs of
:class:`~compfx.plan.Assignment` s and cheap lower bounds of them, and says
what to add to a log record. It knows nothing of the search or its log; the
search sees only its methods.

>>> import torch, compfx
>>> from compfx.plan import Assignment
>>> from compfx.vocabulary import SampleStatus, Stage
>>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8))
>>> p = SearchPredictor.build(a, repeats=1, use_cache=False)
>>> fp32 = Assignment.parse("1")
>>> extra = p.observe(Stage.STAGE1, fp32, SampleStatus.ACCEPTED, seconds=0.4, batches=4)  # the FP32 baseline
>>> extra["calibration"], round(extra[MEASURED_STEP], 6), round(p.epoch_seconds(fp32), 6)
(True, 0.1, 0.4)
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.fx as fx

from ..cast_policy import castable_inputs, low_runs_under_autocast
from ..errors import BadInputError, SearchError
from ..measure import REFERENCE_TOLERANCE, median_interval
from ..opkey import KEY_META, OpKey
from ..passes import CastInfo
from ..plan import AMP_PRECISION, Assignment, Plan
from ..vocabulary import Precision, SampleStatus, Stage
from .compile_spec import CompileSpec
from .compiled_pricing import CompiledPredictor
from .compiled_profile import profile_compiled_ops
from .pricing import Prediction, Predictor, cast_sizes  # noqa: F401 (cast_sizes: still importable from here)
from .profile import OpProfiles, profile_ops

__all__ = ["SearchPredictor", "PREDICTED_STEP", "MEASURED_STEP", "PREDICTION_SCALE",
           "SCALE_EVIDENCE", "STALE_PROFILES", "STALE_PROFILE_RATIO", "STALE_CONDITIONS", "STALE_CONDITIONS_REASON",
           "SPOT_CHECK_OPS", "STALE_RATIO_KEPT", "CONTRADICTED_PROFILES", "EVIDENCE_SCALE"]

#: keys of a log record's ``extra`` that the report compares: predicted and measured seconds of one step
PREDICTED_STEP, MEASURED_STEP = "predicted_step_seconds", "measured_step_seconds"
#: key of AMP's Stage-1 record's ``extra``: how much of the predicted difference from FP32 its measurement bore out
PREDICTION_SCALE = "prediction_scale"
#: key of AMP's Stage-1 record's ``extra``: what the scale was fitted on -- the predicted AMP / FP32 step ratio, the
#: measured median of the paired batch ratios and its interval at the rule's confidence (see ``_fit_scale``)
SCALE_EVIDENCE = "prediction_scale_evidence"
#: key of a sample's or a duel's log record's ``extra``: with it, the plans measured so far were confidently slower
#: against their references than predicted, and the predictions were scaled down (``SearchPredictor._weigh_evidence``)
EVIDENCE_SCALE = "evidence_scale"
#: the scale falls in steps of 1/this of its value when the evidence demands it (see ``_weigh_evidence``)
EVIDENCE_SCALE_STEPS = 20
#: key of AMP's Stage-1 record's ``extra``: profiles measured again because AMP's measured batches contradicted
#: the prediction they made and a fresh timing of the ops behind it disagreed with them (cached over fresh seconds)
CONTRADICTED_PROFILES = "profiles_contradicted"
#: how many plans priced already (besides the one asked for) a bound relative to a priced plan is also read off
NEAREST_REFERENCES = 3
#: key of the calibration record's ``extra``: the ratio that made cached profiles be measured again
STALE_PROFILES = "stale_profile_ratio"
#: keys of the calibration record's ``extra``: how many cached profiles were measured again because their
#: recorded conditions differ from now's (:class:`compfx.measure.Conditions`), and why the first one was
STALE_CONDITIONS, STALE_CONDITIONS_REASON = "profiles_stale", "profiles_stale_reason"
#: Cached profiles summing to more than this multiple of the measured FP32 step are suspect: fresh profiles
#: of the CPU benchmark models sum to 0.65-1.4x the step (isolated ops pay their own dispatch), so more
#: suggests profiles taken under other conditions (a loaded shared machine, another clock). But the
#: multiple is the device's: on a GPU each isolated op pays a launch and a synchronisation that a pipelined
#: step overlaps, and fresh profiles can sum to several times the step. So over it, the costliest cached
#: ops are timed again first (:data:`SPOT_CHECK_OPS`); only when they disagree with the cache (beyond
#: :data:`~compfx.measure.REFERENCE_TOLERANCE`) is everything measured again. Far below is normal where the
#: loss, the optimizer and Python dominate a small model's step.
STALE_PROFILE_RATIO = 2.0
#: How many of the costliest cached ops the staleness check times again.
SPOT_CHECK_OPS = 3
#: key of the calibration record's ``extra``: cached profiles over STALE_PROFILE_RATIO x the step that a
#: spot check found true to this machine, so they were kept: the ratio, and the cached over fresh spot times
STALE_RATIO_KEPT = "profile_step_ratio_kept"


class SearchPredictor:
    """A :class:`Predictor` that calibrates itself on the FP32 baseline and prices Stage-1 epochs of assignments.

    Build it with :meth:`build`, feed it every sample the search records
    (:meth:`observe`), and ask :meth:`epoch_seconds` and
    :meth:`lower_bound_seconds` once it is calibrated.
    """

    def __init__(self, predictor: Predictor, build_seconds: float = 0.0,
                 remeasure: Callable[[], Predictor] | None = None,
                 spot_check: Callable[[list[OpKey]], OpProfiles] | None = None, annotate_all: bool = True,
                 confidence: float = 0.95):
        self.predictor = predictor
        #: how sure AMP's and FP32's batches must be that they contradict the profiles before predictions are scaled
        #: (the decision rule's confidence)
        self.confidence = confidence
        #: price every measured sample for its log record (cheap when ``rewrite`` hands over the modules the samples
        #: ran); False: only the plans the search had priced anyway
        self.annotate_all = annotate_all
        self.build_seconds = build_seconds
        self.remeasure = remeasure  # builds the predictor again from fresh profiles (None: never)
        self.spot_check = spot_check  # fresh, uncached profiles of some ops (None: a high ratio remeasures all)
        self.stale_ratio: float | None = None  # set when cached profiles were measured again
        self.kept_ratio: tuple[float, float] | None = None  # (ratio, cached / fresh spot times) when kept
        profiles = predictor.profiles  # entries measured again at build time: taken under other conditions
        self.stale_conditions = (profiles.stale, profiles.stale_reason) if profiles.stale else None
        self.batches: int | None = None  # batches per Stage-1 epoch, known once the baseline ran
        self._steps: dict[Assignment, float] = {}
        self._dtype_decided: dict[tuple[OpKey, Precision], bool] | None = None  # see _bound_seconds
        self._flow: _Dataflow | None = None  # the analysis graph's dataflow, for bounds relative to a priced plan
        self._references: dict[Assignment, _Reference] = {}  # priced plans that bounds are taken relative to
        self._against: dict[tuple[Assignment, Assignment], float] = {}  # (plan, priced plan) -> bound read off it
        #: how much of the profiles' predicted difference from FP32 the measurements bear out (see observe)
        self.scale = 1.0
        self.fp32_step: float | None = None  # the measured FP32 step the predictor is calibrated on
        self._amp = Assignment(AMP_PRECISION[op.category] for op in predictor.analysis.ops) \
            if predictor.analysis is not None else None
        self._scale_fitted = False
        #: counts the changes of :attr:`scale` and of the profiles: a search's cached prices are void when it moves
        self.version = 0
        self._fp32_batches: list[float] = []
        self._amp_batches: list[float] = []  # AMP's latest Stage-1 epoch: the reference of later samples' batches
        #: (kind, plan, reference, measured ratios plan / reference) of every sample and duel seen: _weigh_evidence
        self._evidence: list[tuple[str, Assignment, Assignment, list[float]]] = []
        self.scale_evidence: dict[str, Any] = {}  # what the scale was fitted on (SCALE_EVIDENCE)
        self.contradicted: dict[str, list[float]] = {}  # op -> cached / fresh (fp32, low) seconds, when re-measured

    @classmethod
    def build(cls, analysis, *, rewrite: Callable[[Plan], fx.GraphModule] | None = None,
              cache_dir: str | os.PathLike | None = None, annotate_all: bool | None = None,
              confidence: float = 0.95, compiled=None, **profile_kwargs) -> "SearchPredictor":
        """Profile ``analysis`` and fit cast costs (:meth:`Predictor.build`), timing what that costs.

        ``rewrite(plan)`` makes the graph a plan runs as (the search passes the
        modules it trains, so each plan is rewritten once, and every measured
        sample is priced for its log record); without it each plan is rewritten
        here, and only the plans the search asks about are priced (``annotate_all``
        says otherwise); ``confidence`` is the decision rule's (see :meth:`observe`); ``profile_kwargs``
        go to :func:`~compfx.costmodel.profile_ops` (``use_cache`` and
        ``refresh`` to the caches too).

        ``compiled``: the compile options the plans train with (anything
        :meth:`CompileSpec.of` takes) prices the compiled program instead
        (:class:`~compfx.costmodel.CompiledPredictor`; ``profile_kwargs`` then go
        to :func:`~compfx.costmodel.profile_compiled_ops`, ``fp8_recipes`` among
        them); ``rewrite`` must then return the planned ``GraphModule``.
        """
        refresh = profile_kwargs.pop("refresh", False)  # the re-measure of stale profiles always refreshes
        spec = CompileSpec.of(compiled)
        start = time.perf_counter()
        if spec is None:
            make, profile = functools.partial(Predictor.build, analysis), functools.partial(profile_ops, analysis)
        else:
            make = functools.partial(CompiledPredictor.build, analysis, spec)
            profile = functools.partial(profile_compiled_ops, analysis, spec)
        predictor = make(rewrite=rewrite, cache_dir=cache_dir, refresh=refresh, **profile_kwargs)
        remeasure = functools.partial(make, rewrite=rewrite, cache_dir=cache_dir, refresh=True, **profile_kwargs)
        spot_kwargs = {k: v for k, v in profile_kwargs.items() if k != "use_cache"}
        spot_check = lambda keys: profile(keys=keys, use_cache=False, **spot_kwargs)  # noqa: E731
        return cls(predictor, time.perf_counter() - start, remeasure, spot_check,
                   annotate_all=rewrite is not None if annotate_all is None else annotate_all, confidence=confidence)

    @property
    def profiles(self) -> OpProfiles:
        return self.predictor.profiles

    @property
    def calibrated(self) -> bool:
        return self.batches is not None

    # -- predictions ---------------------------------------------------------------------
    def step_seconds(self, plan: Assignment) -> float:
        """Predicted seconds of one step; NaN when the plan's graph cannot be priced (it is then measured).

        Differences from the FP32 step are scaled by :attr:`scale` (see :meth:`observe`)."""
        return self._scaled(self._raw_step(plan))

    def _raw_step(self, plan: Assignment) -> float:
        plan = _assignment(plan)
        if plan not in self._steps:  # each prediction rewrites the graph: do it once per plan
            seen = self._reference(plan)
            self._steps[plan] = math.nan if seen is None else seen.priced + self.predictor.overhead
        return self._steps[plan]

    def _scaled(self, step: float) -> float:
        """``step`` with its difference from the measured FP32 step scaled by :attr:`scale`."""
        return self._at_scale(step, self.scale)

    def _at_scale(self, step: float, scale: float) -> float:
        if scale == 1.0 or self.fp32_step is None:
            return step
        return self.fp32_step + scale * (step - self.fp32_step)

    def epoch_seconds(self, plan: Assignment) -> float:
        """Predicted seconds of one Stage-1 epoch under ``plan`` (step time x the baseline's batches); NaN: unknown."""
        return self.step_seconds(plan) * self._batches()

    def lower_bound_seconds(self, plan: Assignment) -> float:
        """A cheap lower bound of :meth:`epoch_seconds`: no graph rewrite, no casts.

        An op costs its profile at the dtype its precision gives it where that
        precision alone decides the dtype (it has castable inputs, or runs
        under autocast), otherwise the cheaper of its two profiles ("follow"
        ops, ops whose only inputs are written in place). Casts cost nothing.
        So the bound never exceeds the full prediction while every fitted cast
        cost is non-negative; otherwise the full prediction is returned.
        """
        plan, batches = _assignment(plan), self._batches()
        if not self._casts_non_negative():
            return self.epoch_seconds(plan)
        total = self.predictor.overhead
        for op, precision in zip(self.predictor.analysis.ops, plan, strict=True):
            profile = self.profiles.get(op.key)
            if profile is None:
                continue
            total += self._least_seconds(op.key, profile, precision)
        return self._scaled(total) * batches

    def step_lower_bound(self, plan: Assignment) -> float:
        """:meth:`lower_bound_seconds` of one step (Stage 2 times steps, not epochs)."""
        return self.lower_bound_seconds(plan) / self._batches()

    def lower_bound_against(self, plan: Assignment, reference: Assignment) -> float:
        """A lower bound of :meth:`epoch_seconds` for ``plan``, read off ``reference``'s priced graph: tighter than
        :meth:`lower_bound_seconds` when the two plans differ in a few ops, and never above the prediction.

        Only what ``plan``'s precisions can reach may differ from
        ``reference``: an op whose precision differs, and what its dtype flows
        into up to an op whose precision casts its inputs
        (:class:`_Dataflow`). Every other op costs what it costs in
        ``reference``'s graph, and every cast of that graph whose input and
        consumers are out of reach is in ``plan``'s graph too. An op within
        reach costs as in :meth:`lower_bound_seconds`, and ``plan``'s own new
        casts nothing. One rewrite of ``reference`` (made once) prices every
        ``plan`` against it; the bound is the larger of this and
        :meth:`lower_bound_seconds` (NaN when ``reference`` cannot be priced).
        """
        plan, reference = _assignment(plan), _assignment(reference)
        if not self._casts_non_negative():
            return self.epoch_seconds(plan)
        if self._reference(reference) is None:
            return math.nan
        return max(self._bound_read_off(plan, other) for other in [reference, *self._nearest_priced(plan, reference)])

    def _nearest_priced(self, plan: Assignment, reference: Assignment) -> list[Assignment]:
        """Up to :data:`NEAREST_REFERENCES` plans priced already that differ from ``plan`` in fewer ops than
        ``reference`` does, the nearest first: each gives a lower bound as valid as the reference's, and a nearer
        one is usually tighter (a plan that differs from it less is not read off it: it would rarely add)."""
        distance = lambda other: sum(a is not b for a, b in zip(plan, other))  # noqa: E731
        limit = distance(reference)
        nearer = [(d, i, other) for i, (other, seen) in enumerate(self._references.items())
                  if seen is not None and (d := distance(other)) < limit]
        return [other for _, _, other in sorted(nearer)[:NEAREST_REFERENCES]]

    def _bound_read_off(self, plan: Assignment, reference: Assignment) -> float:
        """:meth:`lower_bound_against` ``reference`` alone (priced already); cached per pair of plans."""
        key = (plan, reference)
        if key in self._against:
            return self._against[key]
        seen, batches = self._references[reference], self._batches()
        if self._flow is None:
            self._flow = _Dataflow(self.predictor.analysis)
        reached = self._flow.reached(plan, reference)
        total = self.predictor.overhead
        for op, precision, node in zip(self.predictor.analysis.ops, plan, self._flow.op_nodes, strict=True):
            profile = self.profiles.get(op.key)
            if profile is None:
                continue
            if node not in reached:
                total += (_fp8_floor(profile) if op.key in seen.fp8_ops
                          else profile.seconds(op.key in seen.low_ops))
            else:
                total += self._least_seconds(op.key, profile, precision)
        total += sum(seconds for seconds, touches in seen.casts if not self._flow.touches(touches, reached))
        self._against[key] = max(self._scaled(total) * batches, self.lower_bound_seconds(plan))
        return self._against[key]

    def step_lower_bound_against(self, plan: Assignment, reference: Assignment) -> float:
        """:meth:`lower_bound_against` of one step (Stage 2 times steps, not epochs)."""
        return self.lower_bound_against(plan, reference) / self._batches()

    def _reference(self, plan: Assignment) -> "_Reference | None":
        """``plan`` priced: its prediction, and what :meth:`lower_bound_against` reads of its rewritten graph
        (rewritten once per plan; None when it cannot be priced)."""
        if plan not in self._references:
            try:
                graph = self.predictor._graph_of(plan)
                prediction = self.predictor._breakdown_graph(graph, self.predictor.overhead)
                self._references[plan] = _Reference.of(graph, prediction, self.predictor._cast_seconds)
            except Exception:  # noqa: BLE001 - e.g. an op with no low-precision kernel: the measurement will say so
                self._references[plan] = None
        return self._references[plan]

    def _batches(self) -> int:
        if not self.calibrated:
            raise SearchError("SearchPredictor predicts epochs only after observe() saw the accepted FP32 baseline "
                              "(the first accepted Stage-1 sample); observe it first.")
        return self.batches

    def _casts_non_negative(self) -> bool:
        return self.predictor.prices_non_negative()

    def _least_seconds(self, key: OpKey, profile, precision: Precision) -> float:
        """The least an op can cost at ``precision``, whatever dtypes reach it: its profile at the dtype the
        precision decides, else the cheaper of FP32's and the low dtype's; in FP8 the cheapest recipe profiled."""
        if precision is Precision.FP8:
            return _fp8_floor(profile)
        if self._dtype_decided_by(key, precision):
            return profile.seconds(precision is Precision.LOW)
        return min(profile.fp32_s, profile.low_s)

    def _dtype_decided_by(self, key: OpKey, precision: Precision) -> bool:
        """Does ``precision`` alone decide the dtype the op computes in (whatever dtypes reach it)?"""
        if self._dtype_decided is None:
            self._dtype_decided = {}
            for node in self.predictor.analysis.graph_module.graph.nodes:
                if KEY_META not in node.meta:
                    continue
                cast = bool(castable_inputs(node))  # castable-ness is the same in every plan's graph
                autocast = low_runs_under_autocast(node)
                self._dtype_decided[(node.meta[KEY_META], Precision.LOW)] = cast or autocast
                self._dtype_decided[(node.meta[KEY_META], Precision.FP32)] = cast
        return self._dtype_decided.get((key, precision), False)

    # -- the search's samples --------------------------------------------------------------
    def observe(self, stage: Stage | str, plan: Assignment, status: SampleStatus | str, seconds: float | None,
                batches: int, batch_seconds: Sequence[float] = ()) -> dict:
        """Calibrate on the first accepted Stage-1 sample (the FP32 baseline); say what to add to its record.

        Returns the entries for the sample's ``extra``: predicted and measured
        step seconds (:data:`PREDICTED_STEP`, :data:`MEASURED_STEP`) for a
        sample whose plan the search had the predictor price, plus ``calibration`` and the profiling
        counts on the baseline; ``{}`` when there is nothing to add. Before
        calibrating, cached profiles far above the measured FP32 step are
        measured again (:data:`STALE_PROFILE_RATIO`, :data:`STALE_PROFILES`). ``batch_seconds`` (a Stage-1
        sample's, when known) give the medians AMP's plan is compared with FP32's by (see :meth:`_fit_scale`).
        """
        stage, status, plan = Stage(stage), SampleStatus(status), _assignment(plan)
        if not self.calibrated:
            if stage is not Stage.STAGE1 or status is not SampleStatus.ACCEPTED or not batches:
                return {}
            measured = (seconds or 0.0) / batches
            self._remeasure_if_stale(measured)
            self.predictor.calibrate(measured)
            self.batches, self.fp32_step = batches, measured
            self._fp32_batches = list(batch_seconds)
            self._steps.clear()  # the overhead changed; the prices of compute and casts did not
            self._against.clear()
            return self._annotation(plan, measured, calibration=True)
        measured = _measured_step(stage, status, seconds, batches)
        if stage is Stage.STAGE1 and plan == self._amp and batch_seconds:
            self._amp_batches = list(batch_seconds)  # the latest: what later samples' batches are compared with
        if stage is Stage.STAGE1 and plan == self._amp and measured is not None and not self._scale_fitted:
            self._scale_fitted = True
            self._fit_scale(measured, list(batch_seconds))
            extra = self._annotation(plan, measured)
            if not extra:
                return {}
            extra.update({"calibration": True, PREDICTION_SCALE: self.scale, SCALE_EVIDENCE: self.scale_evidence})
            if self.contradicted:
                extra[CONTRADICTED_PROFILES] = self.contradicted
            return extra
        if measured is None or (plan not in self._steps and not self.annotate_all):
            return {}  # pricing a plan only to annotate its record would cost a rewrite of its own
        if not math.isfinite(self.step_seconds(plan)):
            return {}
        extra = self._annotation(plan, measured)  # the prediction the search went by, before this evidence
        if stage is Stage.STAGE1 and plan != self._amp and batch_seconds:
            extra.update(self._sample_evidence(plan, list(batch_seconds)))
        return extra

    def _fit_scale(self, measured_amp_step: float, amp_batches: list[float]) -> None:
        """Scale the profiles' predicted differences from FP32 by as much as AMP's measured batches demand.

        The FP32 step calibrates the predictions' level; AMP's plan, measured
        next, checks their slope. Isolated ops often run low precision faster
        than it runs inside a small model's step (where the loss, the optimizer
        and Python take their time), so predicted wins can be larger than any
        measured one. The evidence is paired, as the decision rule's is: the
        ratios AMP / FP32 of the same batches, and the interval of their median
        at the rule's :attr:`confidence` (:func:`~compfx.measure.median_interval`).

        * The predicted ratio inside that interval: the batches cannot tell the
          profiles wrong, whatever the noise; the scale stays 1 (the profiles'
          prediction stands). So does a predicted difference under 1% of the
          step, which says nothing about a slope.
        * Outside it: the batches contradict the profiles at that confidence.
          First the profiles behind the difference are timed again
          (:meth:`_recheck_contradicted`: a cached profile taken on a busy
          machine can be far off); if they were off, everything is measured
          again and the check repeats. If the contradiction stands, the
          predicted differences are scaled by the least the measurement
          demands: to the interval's end nearest the prediction, kept in
          [0, 1] (0 when the batches show AMP confidently on the other side of
          FP32). Noise widens the interval, which scales less: it never makes
          the search believe in wins the batches do not show, nor stop
          believing the profiles on a difference the batches cannot resolve.

        Without the FP32 epoch's batches (fewer than two pairs), the measured
        step's difference is compared directly (no interval).
        """
        if self.fp32_step is None:
            return
        ratios = [amp / fp32 for amp, fp32 in zip(amp_batches, self._fp32_batches) if fp32 > 0]
        if len(ratios) >= 2:
            low, high, coverage = median_interval(ratios, self.confidence)
            median = statistics.median(ratios)
        else:
            low = high = median = measured_amp_step / self.fp32_step
            coverage = 0.0
        predicted = self._predicted_amp_ratio()
        if predicted is not None and not low <= predicted <= high and self._recheck_contradicted():
            predicted = self._predicted_amp_ratio()
        self.scale_evidence = {"predicted_ratio": predicted, "median_ratio": median, "interval": [low, high],
                               "coverage": coverage, "pairs": len(ratios)}
        if predicted is None or abs(predicted - 1.0) < 0.01 or low <= predicted <= high:
            return
        nearest = high if predicted > high else low
        fitted = min(1.0, max(0.0, (nearest - 1.0) / (predicted - 1.0)))
        if fitted < self.scale:  # a duel of the two plans may have scaled it further already
            self._scale_to(fitted)

    def _scale_to(self, scale: float) -> None:
        self.scale = scale
        self._against.clear()  # bounds are scaled as predictions are
        self.version += 1

    def observe_duel(self, incumbent: Assignment, candidate: Assignment, incumbent_seconds: Sequence[float],
                     candidate_seconds: Sequence[float]) -> dict:
        """A duel's paired steps as evidence on the predictions (see :meth:`_weigh_evidence`); what to add to the
        duel's record (``{}``: the predictions stand)."""
        if not self.calibrated:
            return {}
        ratios = [c / i for i, c in zip(incumbent_seconds, candidate_seconds) if i > 0]
        return self._weigh_evidence("duel", _assignment(candidate), _assignment(incumbent), ratios)

    def _sample_evidence(self, plan: Assignment, batch_seconds: list[float]) -> dict:
        """A Stage-1 sample's batches against AMP's plan's, batch for batch (the same batches), as evidence."""
        if not self._amp_batches or plan not in self._steps:  # unpriced plans are not priced only for this
            return {}
        ratios = [mine / amp for mine, amp in zip(batch_seconds, self._amp_batches) if amp > 0]
        return self._weigh_evidence("sample", plan, self._amp, ratios)

    def _weigh_evidence(self, kind: str, plan: Assignment, reference: Assignment, ratios: list[float]) -> dict:
        """Scale the predicted differences down when the measurements so far confidently bear out less of them.

        Each measured ratio ``plan / reference`` of one pair of steps (a
        duel's, or a Stage-1 sample's batch against the same batch of AMP's
        epoch) divided by the predicted ratio of the two plans is one value,
        where the plan was predicted faster than its reference (a predicted
        win, which a scale too high overstates). Every such value the search
        has seen is pooled by ``kind`` (duels apart from samples: a sample's
        batches and AMP's ran in different phases, and a machine that drifts
        between phases moves them, never a duel's), and the interval of each
        pool's median is taken at the rule's :attr:`confidence`
        (:func:`~compfx.measure.median_interval`, as :meth:`_fit_scale` takes
        AMP's). Only when a lower end is above 1 -- the plans measured
        confidently slower against their references than predicted -- is
        :attr:`scale` lowered, in steps of :data:`EVIDENCE_SCALE_STEPS`, to the
        largest scale at which every pool's interval reaches 1 (0 when none does): the
        least the evidence demands. The scale only ever falls, so no
        measurement makes the search believe in wins the profiles did not
        predict. It is what stops a search on a noisy machine, where the
        profiles predict small wins that sample after sample does not show,
        from sampling them all.
        """
        if self.fp32_step is None or self.scale <= 0.0 or not ratios:
            return {}
        self._evidence.append((kind, plan, reference, list(ratios)))
        low, high, coverage, pairs = self._evidence_interval(kind, self.scale)
        if not low > 1.0:
            return {}
        before = self.scale
        lower = (before * (1.0 - k / EVIDENCE_SCALE_STEPS) for k in range(1, EVIDENCE_SCALE_STEPS + 1))
        kinds = {entry[0] for entry in self._evidence}
        self._scale_to(next((s for s in lower if all(not self._evidence_interval(k, s)[0] > 1.0 for k in kinds)),
                            0.0))
        return {EVIDENCE_SCALE: {"kind": kind, "measured_over_predicted": [low, high], "coverage": coverage,
                                 "pairs": pairs, "scale_before": before, "scale": self.scale}}

    def _evidence_interval(self, kind: str, scale: float) -> tuple[float, float, float, int]:
        """The interval of the median measured / predicted ratio over the evidence of ``kind``, at ``scale``; and
        how many values it is taken over."""
        values = []
        for plan, reference, measured in (entry[1:] for entry in self._evidence if entry[0] == kind):
            predicted = self._at_scale(self._raw_step(plan), scale) / self._at_scale(self._raw_step(reference), scale)
            if math.isfinite(predicted) and 0 < predicted < 1:  # a predicted win: what the scale could overstate
                values.extend(ratio / predicted for ratio in measured)
        if not values:
            return math.nan, math.nan, 0.0, 0
        return (*median_interval(values, self.confidence), len(values))

    def _forget_prices(self) -> None:
        """New profiles: every price made from the old ones is void."""
        self.version += 1
        self._steps.clear()
        self._references.clear()
        self._against.clear()

    def _predicted_amp_ratio(self) -> float | None:
        """The profiles' AMP step over the measured FP32 step (None when AMP's plan cannot be priced)."""
        predicted = self._raw_step(self._amp)
        return predicted / self.fp32_step if math.isfinite(predicted) and self.fp32_step else None

    def _recheck_contradicted(self) -> bool:
        """Time again the ops behind AMP's predicted difference from FP32; True when they disagreed with their
        profiles (beyond :data:`~compfx.measure.REFERENCE_TOLERANCE`) and every profile was measured again.

        The ops checked are the :data:`SPOT_CHECK_OPS` whose low and FP32
        profiles differ most among those AMP's plan runs low (one per distinct
        profile). A cached profile taken on a busy machine, or a first call's
        one-off cost, can be many times the op's time; such a profile makes the
        prediction, not the machine, disagree with the batches.
        """
        if self.spot_check is None or self.remeasure is None:
            return False
        amp = self._reference(self._amp)  # priced already (rewritten once): the prediction being checked
        if amp is None:  # an unpriceable plan: nothing to recheck
            return False
        seen, suspects = set(), []
        low_ops = [op.key for op in self.predictor.analysis.ops if op.key in amp.low_ops]  # in the graph's order
        for key in sorted(low_ops, key=lambda k: -abs(self.profiles[k].low_s - self.profiles[k].fp32_s)):
            times = (self.profiles[key].fp32_s, self.profiles[key].low_s)
            if times not in seen and min(times) > 0:
                seen.add(times)
                suspects.append(key)
            if len(suspects) == SPOT_CHECK_OPS:
                break
        if not suspects:
            return False
        start = time.perf_counter()
        fresh = self.spot_check(suspects)
        off = {}
        for key in suspects:
            if key not in fresh or fresh[key].skipped or min(fresh[key].fp32_s, fresh[key].low_s) <= 0:
                continue
            ratios = [self.profiles[key].fp32_s / fresh[key].fp32_s, self.profiles[key].low_s / fresh[key].low_s]
            if any(not 1 / REFERENCE_TOLERANCE <= r <= REFERENCE_TOLERANCE for r in ratios):
                off[str(key)] = ratios
        if off:
            self.predictor = self.remeasure()  # overwrites the cache entries
            self.predictor.calibrate(self.fp32_step)
            self._forget_prices()
            self.contradicted = off
        self.build_seconds += time.perf_counter() - start
        return bool(off)

    def _remeasure_if_stale(self, measured_step: float) -> None:
        """Profile again when cached profiles do not match the FP32 step this machine just measured."""
        if self.remeasure is None or not self.profiles.reused or not measured_step > 0:
            return
        ratio = self.predictor.fp32_compute_seconds() / measured_step
        if ratio <= STALE_PROFILE_RATIO:
            return
        start = time.perf_counter()
        agreement = self._spot_agreement()
        if agreement is not None and 1 / REFERENCE_TOLERANCE <= agreement <= REFERENCE_TOLERANCE:
            self.kept_ratio = (ratio, agreement)  # this device's isolated ops just sum to more than its step
        else:
            self.predictor = self.remeasure()  # overwrites the stale cache entries
            self._forget_prices()
            self.stale_ratio = ratio
        self.build_seconds += time.perf_counter() - start

    def _spot_agreement(self) -> float | None:
        """Cached over fresh seconds of the :data:`SPOT_CHECK_OPS` costliest cached ops at FP32 (None: unknown)."""
        if self.spot_check is None:
            return None
        costliest = sorted((p for p in self.profiles.values() if p.fp32_s > 0), key=lambda p: -p.fp32_s)
        keys = [p.key for p in costliest[:SPOT_CHECK_OPS]]
        if not keys:
            return None
        fresh = self.spot_check(keys)
        fresh_s = sum(fresh[key].fp32_s for key in keys if key in fresh)
        return sum(self.profiles[key].fp32_s for key in keys) / fresh_s if fresh_s > 0 else None

    def _annotation(self, plan: Assignment, measured: float, calibration: bool = False) -> dict[str, Any]:
        extra: dict[str, Any] = {PREDICTED_STEP: self.step_seconds(plan), MEASURED_STEP: measured}
        if calibration:
            extra["calibration"] = True  # predicted exactly by construction: not an accuracy figure
            extra.update(profiles_measured=self.profiles.measured, profiles_reused=self.profiles.reused,
                         predictor_build_seconds=self.build_seconds)
            if self.stale_ratio is not None:
                extra[STALE_PROFILES] = self.stale_ratio
            if self.kept_ratio is not None:
                extra[STALE_RATIO_KEPT] = list(self.kept_ratio)
            if self.stale_conditions:
                extra[STALE_CONDITIONS], extra[STALE_CONDITIONS_REASON] = self.stale_conditions
        return extra


@dataclass(frozen=True)
class _Reference:
    """What a bound relative to a priced plan needs of its graph: the ops it runs low, and each cast's seconds with
    the nodes (by name) it touches -- its input and its consumers."""

    priced: float  # the predicted step's compute and casts (the calibrated overhead is added when it is read)
    low_ops: frozenset[OpKey]
    casts: tuple[tuple[float, frozenset[str]], ...]
    fp8_ops: frozenset[OpKey] = frozenset()

    @classmethod
    def of(cls, gm: fx.GraphModule, prediction: Prediction, cast_seconds: Callable[[CastInfo], float]) -> "_Reference":
        nodes = {node.name: node for node in gm.graph.nodes}
        casts = []
        for cast in prediction.casts:
            node = nodes[cast.node]
            touches = {arg.name for arg in node.all_input_nodes} | {user.name for user in node.users}
            casts.append((cast_seconds(cast), frozenset(touches)))
        return cls(prediction.compute_s + prediction.cast_s, frozenset(prediction.low_ops), tuple(casts),
                   frozenset(prediction.fp8_ops))


class _Dataflow:
    """Which nodes of the analysis graph a change of precisions can reach (their dtype may differ).

    A node is reached when it is an op whose precision differs between the two
    plans, or when one of its inputs is reached -- except at an op whose
    precision (the same in both) casts its inputs: the inputs it casts reach it
    no further (:func:`~compfx.cast_policy.castable_inputs`). An op the low
    precision runs under autocast casts nothing itself, so its inputs reach it.
    Nodes a rewrite inserts (casts) are named apart and count as reached.
    """

    def __init__(self, analysis):
        index = {op.key: i for i, op in enumerate(analysis.ops)}
        self.nodes: list[tuple[str, tuple[str, ...], int | None, frozenset[str], bool]] = []
        op_nodes: dict[int, str] = {}
        for node in analysis.graph_module.graph.nodes:
            key = node.meta.get(KEY_META)
            i = index.get(key) if key is not None else None
            cast, autocast = frozenset(), False
            if i is not None:
                op_nodes[i] = node.name
                cast = frozenset(arg.name for _, arg in castable_inputs(node))
                autocast = low_runs_under_autocast(node)
            self.nodes.append((node.name, tuple(arg.name for arg in node.all_input_nodes), i, cast, autocast))
        self.op_nodes = [op_nodes.get(i, "") for i in range(len(analysis.ops))]
        self.names = frozenset(name for name, *_ in self.nodes)

    def reached(self, plan: Assignment, reference: Assignment) -> set[str]:
        """The names of the nodes whose dtype may differ between ``plan`` and ``reference``."""
        reached: set[str] = set()
        for name, inputs, i, cast, autocast in self.nodes:
            if i is not None and plan[i] is not reference[i]:
                reached.add(name)
                continue
            changed = [arg for arg in inputs if arg in reached]
            if not changed:
                continue
            precision = plan[i] if i is not None else None
            # FP8 ops take FP32 operands (cast_policy.precision_dtype): they cast them as FP32 does
            casts_them = (precision in (Precision.FP32, Precision.FP8)
                          or (precision is Precision.LOW and not autocast)) and cast
            if not casts_them or any(arg not in cast for arg in changed):
                reached.add(name)
        return reached

    def touches(self, names: frozenset[str], reached: set[str]) -> bool:
        """Does any of ``names`` lie within ``reached``, or outside the analysis graph (a node a rewrite inserted)?"""
        return any(name in reached or name not in self.names for name in names)


def _fp8_floor(profile) -> float:
    """The least an op costs in FP8: its cheapest recipe profiled, else 0 (unknown: a bound charges nothing)."""
    return min((seconds for _, seconds in profile.fp8_s), default=0.0)


def _assignment(plan) -> Assignment:
    if isinstance(plan, Assignment):
        return plan
    if isinstance(plan, str):
        raise BadInputError(f"the search predictor takes an Assignment, not the plan string {plan!r}; pass "
                            "Assignment.parse(...).")
    return Assignment(plan)


def _measured_step(stage: Stage, status: SampleStatus, seconds: float | None, batches: int) -> float | None:
    """A measured per-step time: Stage-1 epoch seconds / batches run (pruned ones too), Stage-2 median step."""
    if status in (SampleStatus.NOTE, SampleStatus.SKIPPED, SampleStatus.ERROR) or not seconds:
        return None
    if stage is Stage.STAGE1 and batches:
        return seconds / batches
    if stage is Stage.STAGE2:
        return seconds
    return None
