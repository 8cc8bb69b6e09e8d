"""The cost-model screen of Stage 1: candidates the profiles show cannot win are not sampled.

With a cost model (``predict``), candidates still run in the fixed order (an
order by predicted cost would move with the profiles' noise, and with it the
plan a near tie goes to); those the profiles show cannot beat the incumbent by
more than the rule's margin are skipped, and Stage 1 stops when none left can.
This is not exact: :func:`compfx.optimize` uses it only with ``predictor="on"``.
:class:`Pricing` holds what the cost model gives (the prediction, its cheap
lower bounds, the skip margin); :class:`CostModelScreen` prices plans with it,
once each, and decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import BadInputError
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage
from .compare import DecisionRule
from .log import CANNOT_WIN, NOTHING_CAN_WIN
from .outcome import Outcome, PriceVersion, Reporter, checked_cost, cost_unit, note

__all__ = ["Pricing", "CostModelScreen", "Predict", "BoundAgainst", "should_skip", "skip_message",
           "cannot_win_message"]

Predict = Callable[[Assignment], float]  # plan -> predicted seconds of one Stage-1 epoch
BoundAgainst = Callable[[Assignment, Assignment], float]  # (plan, a priced plan) -> a lower bound of predict(plan)


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


# -- the screen ------------------------------------------------------------------------

@dataclass(frozen=True)
class Pricing:
    """What the cost model gives the screen (see :func:`~compfx.search.stage1.run_stage1`): ``predict(plan)``,
    the predicted epoch seconds (None: no cost model, nothing is screened); ``bound(plan)`` and
    ``bound_against(plan, priced plan)``, cheap lower bounds of it; ``margin``, how much costlier than the
    incumbent's measured cost a prediction may be where the incumbent cannot be priced; ``price_version()``,
    which moves when the prices change."""

    predict: Predict | None = None
    margin: float = 1.25
    bound: Predict | None = None
    bound_against: BoundAgainst | None = None
    price_version: Callable[[], int] | None = None


class CostModelScreen:
    """Prices Stage-1 plans (once each, again when the prices move) and skips those that cannot win."""

    def __init__(self, pricing: Pricing, evaluator, rule: DecisionRule, report: Reporter):
        self.evaluator, self.rule, self.report = evaluator, rule, report
        self.predict, self.margin = pricing.predict, pricing.margin
        self.bound = pricing.bound if pricing.predict is not None else None
        self.bound_against = pricing.bound_against if self.bound is not None else None
        self.predicted: dict[Assignment, float] = {}  # plan -> predicted cost
        self.bounds: dict[Assignment, float] = {}  # plan -> cost at the lower bound of the predicted seconds
        self.bounds_against: dict[tuple, float] = {}  # (plan, incumbent, plans priced) -> bound against it
        self.prices = PriceVersion(pricing.price_version)

    def cost(self, plan: Assignment, seconds: float) -> float:
        return checked_cost(self.evaluator, plan, seconds)

    def annotate(self, outcome: Outcome) -> None:
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

    def bound_cost(self, plan: Assignment, best: Outcome | None) -> float:
        """``cost(plan, lower bound of the predicted seconds)``: the full prediction when there is no bound.

        With ``bound_against``, the bound read off the incumbent's (``best``'s) priced graph (tighter for a plan
        that differs from it in a few ops), where it can be had."""
        if self.bound is None:
            return self.predicted_cost(plan)
        self._prices_current()
        if self.bound_against is not None and best is not None:
            key = (plan, best.plan, len(self.predicted))  # each plan priced may tighten the bound
            if key not in self.bounds_against:
                seconds = float(self.bound_against(plan, best.plan))
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

    def cannot_win(self, plan: Assignment, best: Outcome | None, *, price: bool = True) -> tuple[bool, float, float]:
        """Does the cost model show that ``plan`` cannot beat the incumbent ``best`` by more than the margin?

        Like for like: ``plan``'s predicted cost against the rule's bar on the
        incumbent's *predicted* cost (both from the same profiles and
        calibration). The cheap lower bound of the prediction (casts free,
        follow ops at their faster dtype) is tried first; only when it is under
        the bar is the plan priced in full (a rewrite), and its prediction
        decides (``price=False``: a prediction already made, else the bound).
        Returns (cannot win, the figure that decided, bar); never true for a plan
        or an incumbent that cannot be priced.
        """
        if self.predict is None or best is None:
            return False, math.nan, math.nan
        reference = self.predicted_cost(best.plan)
        bound = self.bound_cost(plan, best)
        if not (math.isfinite(reference) and math.isfinite(bound)):
            return False, bound, math.nan
        bar = self.rule.bar(reference, saves_less=False)
        if bound >= bar or self.bound is None:
            return bound >= bar, bound, bar
        if not price and plan not in self.predicted:
            return False, bound, bar
        predicted = self.predicted_cost(plan)
        return math.isfinite(predicted) and predicted >= bar, predicted, bar

    def nothing_can_win(self, left: Sequence[Assignment], best: Outcome | None) -> bool:
        """True (and a note) when the cost model shows that none of the candidates ``left`` (not yet seen) can beat
        the incumbent ``best`` by more than the margin (:meth:`cannot_win`, on their bounds and the predictions
        already made; a plan still in doubt is priced when its turn comes): Stage 1 stops instead of sampling them."""
        if not left or self.predict is None or best is None:
            return False
        # the next candidate usually can win: asked first, it settles the question without pricing the rest
        if not all(self.cannot_win(plan, best, price=False)[0] for plan in left):
            return False
        verdicts = [self.cannot_win(plan, best, price=False) for plan in left]  # cached now: for the note's figures
        bar = verdicts[0][2]
        note(self.report, Stage.STAGE1, f"stopped: the profiles show that none of the {len(left)} plans left can "
             f"beat the incumbent {best.plan} by more than the margin (the lowest of their predicted costs, "
             f"{min(b for _, b, _ in verdicts):.6g}, is not below {bar:.6g}, {1 - self.rule.margin:g} x the "
             "incumbent's predicted cost); not sampled", **{NOTHING_CAN_WIN: len(left)})
        return True

    def skipped(self, plan: Assignment, best: Outcome | None) -> bool:
        """Log and skip ``plan`` when the profiles show it cannot beat the incumbent ``best`` (:meth:`cannot_win`,
        like for like); where the incumbent cannot be priced, when its predicted cost exceeds ``margin`` x the
        incumbent's measured cost.

        Predicted and measured costs are compared only when nothing else can
        be: the profiles' seconds are not the epochs' (they are taken in
        another phase, and scaled only once a duel has measured both), and a
        plan predicted 5% faster than the incumbent can read 30% slower than the
        incumbent's measured epoch. Compared so, the same plan would be sampled
        in one run and skipped in the next. The cheap lower bound is tried
        first: when even it is over, the full prediction (which can only be
        higher) is not computed.
        """
        if self.predict is None or best is None:
            return False
        cannot, figure, bar = self.cannot_win(plan, best)
        if cannot:
            bounded = self.bound is not None and figure == self.bound_cost(plan, best)  # the cheap bound sufficed
            name = "predicted_cost_lower_bound" if bounded else "predicted_cost"
            outcome = Outcome(plan, SampleStatus.SKIPPED, extra={name: figure, CANNOT_WIN: bar},
                              reason=cannot_win_message(figure, bar, self.rule.margin, cost_unit(self.evaluator)))
            self.report(outcome.record(Stage.STAGE1))
            return True
        if math.isfinite(bar):  # priced like for like, and it can win
            return False
        predicted = self.bound_cost(plan, best)
        name = "predicted_cost" if self.bound is None else "predicted_cost_lower_bound"  # which figure was over
        if not should_skip(predicted, best.cost, self.margin):
            predicted, name = self.predicted_cost(plan), "predicted_cost"
            if not should_skip(predicted, best.cost, self.margin):
                return False
        outcome = Outcome(plan, SampleStatus.SKIPPED, reason=skip_message(predicted, best.cost, cost_unit(self.evaluator)),
                          extra={name: predicted})
        self.report(outcome.record(Stage.STAGE1))
        return True
