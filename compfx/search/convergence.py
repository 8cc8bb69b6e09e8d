"""CoMP's convergence guard, defined once: when a plan's loss still tracks FP32's.

Stage 1 accepts a plan when its mean epoch loss is finite and below
``loss_0 * threshold`` (the paper's 1.01), ``loss_0`` being the FP32 epoch's.
compfx adds a check of the final plan (the Stage-2 winner, or a rank's
per-device plan) on the first few batches, against FP32's losses on those same
batches from the same starting state: :func:`check_plan`.

>>> loss_limit(2.0, 1.01), is_accepted(2.01, 2.0, 1.01), is_accepted(2.0199, 2.0, 1.01)
(2.02, True, True)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..errors import PlanFailedError
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage
from .log import SampleRecord
from .outcome import Outcome, Reporter, failure_reason

__all__ = ["loss_limit", "is_accepted", "reference_loss", "Check", "check_plan", "check_winner"]


def loss_limit(loss0: float, threshold: float) -> float:
    """Largest loss (exclusive) still accepted: ``loss_0 * threshold`` for a positive ``loss_0``."""
    return loss0 + (threshold - 1.0) * abs(loss0)


def is_accepted(loss: float | None, loss0: float, threshold: float) -> bool:
    return loss is not None and math.isfinite(loss) and loss < loss_limit(loss0, threshold)


def reference_loss(baseline: Outcome, batches: int) -> tuple[float, int]:
    """FP32's mean loss over the first ``batches`` batches of its epoch, and how many batches that is."""
    batches = min(batches, baseline.batches)
    if batches <= 0:
        return math.nan, 0
    return sum(baseline.batch_losses[:batches]) / batches, batches


@dataclass(frozen=True)
class Check:
    """The outcome of one loss check."""

    passed: bool
    loss: float | None
    reason: str

    @property
    def status(self) -> SampleStatus:
        if self.loss is None:
            return SampleStatus.ERROR
        return SampleStatus.ACCEPTED if self.passed else SampleStatus.REJECTED


def check_plan(evaluator, plan: Assignment, baseline: Outcome, *, batches: int, threshold: float) -> Check:
    """Train ``plan`` on the loader's first batches from the initial state; compare with FP32's loss there.

    A plan that fails (:class:`~compfx.errors.PlanFailedError`) does not pass;
    any other error stops the search. Zero batches: nothing to check, it passes.
    """
    reference, batches = reference_loss(baseline, batches)
    if batches == 0:
        return Check(True, None, "no batches to check on")
    try:
        loss = float(evaluator.check_loss(plan, batches))
    except PlanFailedError as error:
        return Check(False, None, failure_reason(error))
    passed = is_accepted(loss, reference, threshold)
    return Check(passed, loss, f"loss {loss:.6g} vs FP32 {reference:.6g} on the same batches: "
                               + ("passed" if passed else "failed"))


def check_winner(evaluator, winner: Assignment, fallback: Assignment, baseline: Outcome, *, batches: int,
                 threshold: float, report: Reporter | None = None) -> Assignment:
    """The Stage-2 winner if it passes :func:`check_plan`, else ``fallback`` (the Stage-1 winner), logged either way."""
    if winner == fallback or min(batches, baseline.batches) <= 0:
        return winner
    start = time.perf_counter()
    check = check_plan(evaluator, winner, baseline, batches=batches, threshold=threshold)
    if report is not None:
        reason = check.reason + ("" if check.passed else "; falling back to the Stage-1 winner")
        report(SampleRecord(Stage.CHECK, str(winner), check.status, loss=check.loss, reason=reason,
                            duration=time.perf_counter() - start))
    return winner if check.passed else fallback
