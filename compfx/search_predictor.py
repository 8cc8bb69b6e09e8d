"""The cost model as the search uses it: calibrate on the FP32 epoch, predict epochs, annotate the log.

:func:`compfx.optimize` with ``SearchConfig(predictor="on")`` builds one
:class:`SearchPredictor` (profiling counts in the search time), feeds it every
log record, and hands :meth:`SearchPredictor.epoch_seconds` to
:func:`compfx.search.run_stage1`, which runs candidates cheapest-predicted
first and skips those that cannot win. The search itself stays free of the
cost model: it only sees ``predict(bits) -> seconds``.

>>> import torch, compfx
>>> from compfx.searchlog import SampleRecord
>>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8))
>>> p = SearchPredictor.build(a, repeats=1, use_cache=False)
>>> _ = p.observe(SampleRecord("stage1", "1", "accepted", seconds=0.4, batches=4))  # the FP32 baseline
>>> round(p.epoch_seconds("1"), 6)
0.4
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Callable

from .costmodel import Predictor
from .searchlog import SampleRecord

__all__ = ["SearchPredictor", "PREDICTED_STEP", "MEASURED_STEP", "STALE_PROFILES", "STALE_PROFILE_RATIO"]

#: keys of ``SampleRecord.extra`` that the report compares
PREDICTED_STEP, MEASURED_STEP = "predicted_step_seconds", "measured_step_seconds"
#: key of the calibration record's ``extra``: the ratio that made cached profiles be measured again
STALE_PROFILES = "stale_profile_ratio"
#: The profiled ops are part of the FP32 step, so their profiles cannot sum to
#: much more than it: fresh profiles of the CPU benchmark models sum to 0.65-1.4x
#: the measured step (isolated ops pay their own dispatch). Cached profiles over
#: this multiple were taken under other conditions (a loaded shared machine,
#: another clock) and are measured again. Far below is normal where the loss,
#: the optimizer and Python dominate a small model's step.
STALE_PROFILE_RATIO = 2.0


class SearchPredictor:
    """A :class:`~compfx.costmodel.Predictor` calibrated on the first Stage-1 record (the FP32 baseline)."""

    def __init__(self, predictor: Predictor, build_seconds: float = 0.0,
                 remeasure: Callable[[], Predictor] | None = None):
        self.predictor = predictor
        self.build_seconds = build_seconds
        self.remeasure = remeasure  # builds the predictor again from fresh profiles (None: never)
        self.stale_ratio: float | None = None  # set when cached profiles were measured again
        self.batches: int | None = None  # batches per Stage-1 epoch, known once the baseline ran
        self._steps: dict[str, float] = {}

    @classmethod
    def build(cls, analysis, *, cache_dir: str | os.PathLike | None = None, **profile_kwargs) -> "SearchPredictor":
        start = time.perf_counter()
        predictor = Predictor.build(analysis, cache_dir=cache_dir, **profile_kwargs)
        remeasure = functools.partial(Predictor.build, analysis, cache_dir=cache_dir, refresh=True, **profile_kwargs)
        return cls(predictor, time.perf_counter() - start, remeasure)

    @property
    def profiles(self):
        return self.predictor.profiles

    @property
    def calibrated(self) -> bool:
        return self.batches is not None

    def step_seconds(self, bits: str) -> float:
        """Predicted seconds of one step; NaN when the plan's graph cannot be priced (it is then measured)."""
        if bits not in self._steps:  # each prediction rewrites the graph: do it once per plan
            try:
                self._steps[bits] = self.predictor.predict(bits)
            except Exception:  # e.g. an op with no low-precision kernel: the measurement will say so
                self._steps[bits] = math.nan
        return self._steps[bits]

    def lower_bound_seconds(self, bits: str) -> float:
        """A cheap lower bound of :meth:`epoch_seconds`: no graph rewrite, no casts.

        Stage-1 ops ('0'/'1') cost their profile at their bit, "follow" ops the
        cheaper of their two profiles, casts nothing. It never exceeds the full
        prediction while every fitted cast cost is non-negative; otherwise the
        full prediction is returned.
        """
        if not self._casts_non_negative():
            return self.epoch_seconds(bits)
        total = self.predictor.overhead
        for op, bit in zip(self.predictor.analysis.ops, bits):
            profile = self.profiles.get(op.key)
            if profile is None:
                continue
            total += profile.seconds(bit == "0") if bit in "01" else min(profile.fp32_s, profile.low_s)
        return total * self.batches

    def _casts_non_negative(self) -> bool:
        return all(alpha >= 0 and beta >= 0 for alpha, beta in self.predictor.cast_cost.coefficients.values())

    def epoch_seconds(self, bits: str) -> float:
        """Predicted seconds of one Stage-1 epoch under ``bits`` (step time x batches of the baseline)."""
        if not self.calibrated:
            raise RuntimeError("epoch_seconds() before the FP32 baseline record was observed")
        return self.step_seconds(bits) * self.batches

    def observe(self, record: SampleRecord) -> SampleRecord:
        """Calibrate on the baseline; return ``record`` with predicted and measured step seconds added."""
        if not self.calibrated:
            if record.stage != "stage1" or record.status != "accepted" or not record.batches:
                return record
            self._remeasure_if_stale(record.seconds / record.batches)
            self.predictor.calibrate(record.seconds / record.batches)
            self.batches = record.batches
            self._steps.clear()
            return self._annotated(record, record.seconds / record.batches, calibration=True)
        measured = _measured_step(record)
        if measured is None or not math.isfinite(self.step_seconds(record.bitstring)):
            return record
        return self._annotated(record, measured)

    def _remeasure_if_stale(self, measured_step: float) -> None:
        """Profile again when cached profiles do not match the FP32 step this machine just measured."""
        if self.remeasure is None or not self.profiles.reused:
            return
        ratio = self.predictor.fp32_compute_seconds() / measured_step
        if ratio <= STALE_PROFILE_RATIO:
            return
        start = time.perf_counter()
        self.predictor = self.remeasure()  # overwrites the stale cache entries
        self.build_seconds += time.perf_counter() - start
        self.stale_ratio = ratio

    def _annotated(self, record: SampleRecord, measured: float, calibration: bool = False) -> SampleRecord:
        extra = {**record.extra, PREDICTED_STEP: self.step_seconds(record.bitstring), MEASURED_STEP: measured}
        if calibration:
            extra["calibration"] = True  # predicted exactly by construction: not an accuracy figure
            extra.update(profiles_measured=self.profiles.measured, profiles_reused=self.profiles.reused,
                         predictor_build_seconds=self.build_seconds)
            if self.stale_ratio is not None:
                extra[STALE_PROFILES] = self.stale_ratio
        return dataclasses.replace(record, extra=extra)


def _measured_step(record: SampleRecord) -> float | None:
    """A measured per-step time: Stage 1 epoch seconds / batches run (pruned ones too), Stage 2 median step."""
    if record.status in ("note", "skipped", "error") or not record.seconds:
        return None
    if record.stage == "stage1" and record.batches:
        return record.seconds / record.batches
    if record.stage == "stage2":
        return record.seconds
    return None
