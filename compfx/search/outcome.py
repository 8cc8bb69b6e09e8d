"""What one search sample gave (:class:`Outcome`), and the bookkeeping both stages share.

A sample ends as one :class:`~compfx.vocabulary.SampleStatus`. The stages
report every outcome, and notes on why they did what they did, as
:class:`~compfx.search.log.SampleRecord` s through a ``report`` callable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from ..errors import BadInputError, PlanFailedError
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage
from .log import SampleRecord

__all__ = ["Outcome", "Reporter", "note", "failure_reason", "ProgramIndex", "PriceVersion", "checked_cost", "cost_unit"]

Reporter = Callable[[SampleRecord], None]


@dataclass
class Outcome:
    """What one sample gave."""

    plan: Assignment
    status: SampleStatus
    loss: float | None = None
    seconds: float = 0.0
    cost: float = math.inf
    batches: int = 0
    reason: str = ""
    duration: float = 0.0
    batch_losses: list[float] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)
    artifact: Any = field(default=None, repr=False)  # the evaluator's trained state (Stage 1), kept for the winner
    extra: dict = field(default_factory=dict)  # e.g. the predicted cost, for the report

    def record(self, stage: Stage) -> SampleRecord:
        return SampleRecord(stage, str(self.plan), self.status, loss=self.loss,
                            cost=None if math.isinf(self.cost) else self.cost, seconds=self.seconds,
                            batches=self.batches, reason=self.reason, duration=self.duration,
                            extra=dict(self.extra))


def checked_cost(evaluator, plan: Assignment, seconds: float) -> float:
    """``evaluator.cost(plan, seconds)`` as a float; :class:`BadInputError` when it is not a finite number.

    The search ranks plans by this number: a NaN would silently lose (or win)
    every comparison, so it stops the search instead (the cost function is
    wrong whatever the plan).

    >>> from compfx.search.evaluator import FunctionEvaluator
    >>> checked_cost(FunctionEvaluator(cost=lambda plan, s: float("nan")), Assignment.parse("1"), 0.5)
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: the cost function (SearchConfig.cost_fn) returned nan for plan 1 at 0.5 s; ...
    """
    value = evaluator.cost(plan, seconds)
    try:
        cost = float(value)
    except (TypeError, ValueError):
        cost = math.nan
    if isinstance(value, bool) or not math.isfinite(cost):
        raise BadInputError(
            f"the cost function (SearchConfig.cost_fn) returned {value!r} for plan {plan} at {seconds:.6g} s; the "
            "search ranks plans by it, so expected a finite number. Fix cost_fn (e.g. guard a division by zero), "
            "or leave cost_fn=None to rank by the measured seconds.")
    return cost


def cost_unit(evaluator) -> str:
    """``"s"`` when ``evaluator``'s costs are seconds, ``""`` when they are in a cost function's own units."""
    return getattr(evaluator, "cost_unit", "s")


def note(report: Reporter | None, stage: Stage, message: str, **extra) -> None:
    """Report a note (not a sample): why the search did what it did."""
    if report is not None:
        report(SampleRecord(stage, "", SampleStatus.NOTE, reason=message, extra=extra))


def failure_reason(error: PlanFailedError) -> str:
    """The reason logged for a failed plan: the failure as the user's code raised it.

    A plain :class:`PlanFailedError` wraps the original error and its message
    already names it ("RuntimeError: ..."); a subclass names itself.
    """
    return str(error) if type(error) is PlanFailedError else f"{type(error).__name__}: {error}"


class PriceVersion:
    """Tells a stage when the cost model's prices moved since it last asked: the figures it cached are void then
    (a duel or a sample scaled the predictions down). ``version()`` is the predictor's counter; None: never moves.

    >>> count = [0]
    >>> prices = PriceVersion(lambda: count[0])
    >>> prices.moved(), (count.__setitem__(0, 1), prices.moved())[1], prices.moved()
    (False, True, False)
    """

    def __init__(self, version: Callable[[], int] | None = None):
        self._version = version or (lambda: 0)
        self._seen = self._version()

    def moved(self) -> bool:
        now = self._version()
        moved, self._seen = now != self._seen, now
        return moved


class ProgramIndex:
    """The first plan seen for each program, so that a plan whose program was already sampled is not run again.

    ``program(plan)`` names what a plan runs (e.g. the rewritten graph's code);
    two plans with equal programs measure the same.
    """

    def __init__(self, program: Callable[[Assignment], Hashable]):
        self.program = program
        self._first: dict[Hashable, Assignment] = {}

    def earlier_twin(self, plan: Assignment) -> Assignment | None:
        """The plan first recorded with ``plan``'s program, unless that is ``plan`` itself (then it is recorded)."""
        first = self._first.setdefault(self.program(plan), plan)
        return None if first == plan else first
