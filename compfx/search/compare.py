"""The decision rule, defined once: when a candidate plan replaces the incumbent, and how sure the report may be.

Timings on a real machine are noisy; a rule that lets the smaller of two
numbers win lets noise pick between plans that are equally fast, so the same
search reaches a different plan each run. compfx's rule:

**A candidate replaces the incumbent only when it is faster by more than
``margin``, with ``confidence``** -- or, when it saves fewer activation bytes for
backward, when it is not slower by more than ``margin``, with ``confidence``.
Anything else is a tie, and a tie keeps the incumbent. The first incumbent is
AMP's plan (what the user would otherwise run); then FP32's; then the
candidates, in a fixed order. So ties go the same way every time.

Two tests, both necessary:

1. **The screen** (on what the stage measured: a Stage-1 epoch, a Stage-2
   timing): the candidate's cost is below :meth:`DecisionRule.bar` --
   ``(1 - margin)`` x the incumbent's cost, or ``(1 + margin)`` x when it saves
   less memory. Costs only grow as a sample runs, so a sample whose running cost
   reaches the bar stops there (exact pruning: it could not pass).
2. **The duel** (``rounds > 0``): the two plans take turns on the same batches,
   ``rounds`` pairs at a time (:func:`paired_costs`, order alternating
   AB BA AB ... so that drift hits both alike); the ratio candidate / incumbent
   of each pair's costs is one sample, and :func:`median_interval` gives a
   distribution-free interval of the median ratio at ``confidence`` (order
   statistics, as a sign test; no assumption on the noise's shape, and one slow
   outlier step moves it by one rank only). The candidate wins when the whole
   interval lies below ``1 - margin`` (or below ``1 + margin`` with less memory).
   While the median ratio is below the bar but the interval is not, up to
   :data:`MAX_DUEL_BLOCKS` blocks of ``rounds`` pairs are taken (each look at the
   stated confidence).

With ``rounds=0`` the screen alone decides (with ``margin=0`` that is CoMP's
own rule: the cheaper plan wins, ties to the earlier).

**A machine too noisy to decide keeps the incumbent.** The pairs are fair only
while whatever else the machine does hits both plans alike. On a loaded CPU a
thread that is descheduled makes a step several times slower, and such bursts
can hit one side of a duel far more than the other (one plan's steps near
350 ms, the other's near 20 ms): the ratios then agree, tightly, on a speed-up
that does not exist. So a duel also checks that its pairs are plausible
(:meth:`Comparison.noise`): their ratios must not spread over more than
:data:`NOISE_FACTOR` around their median; the ratio must not depend on which
plan ran first by more than that; and each plan's steps must not run further
above their own fastest than the other plan's do, by more than that, where a
plan's fastest at each round of a block is the least cost it had at that round
in any block of this search (every block runs the same batches from the same
state, so those are one computation timed twice). A check that fails measures
how far the noise could have moved the ratio; a win by less than that (the
interval's top times that factor not below the bar) cannot replace the
incumbent: the duel takes more blocks, and if the last is still in doubt, its
verdict says the machine was too noisy to decide, and so does the report. A
win by more than the noise could explain stands.

The report's speed-ups come from the same statistics (:func:`speedup_text`):
one interleaved phase of FP32, AMP and the chosen plan after the search (or, when the chosen plan is
FP32's or AMP's, Stage 1's duel of those two: the same kind of phase).

>>> rule = DecisionRule(margin=0.03, rounds=7)
>>> rule.bar(10.0, saves_less=False), rule.bar(10.0, saves_less=True)
(9.7, 10.3)
>>> rule.verdict(Comparison.of([1.0] * 7, [0.9, 0.92, 0.91, 0.93, 0.9, 0.95, 0.91]), saves_less=False).replaces
True
>>> rule.verdict(Comparison.of([1.0] * 7, [0.9, 0.99, 0.91, 1.01, 0.9, 0.95, 0.91]), saves_less=False).replaces
False
"""

from __future__ import annotations

import math
import numbers
import statistics
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ..errors import BadInputError, PlanFailedError
from ..measure import interleaved_order, median_interval
from .log import DUEL
from .outcome import checked_cost, note

__all__ = ["DecisionRule", "COMP_RULE", "Comparison", "Verdict", "median_interval", "paired_costs",
           "speedup_text", "speedup_measured", "duel", "log_duel", "NOISE_FACTOR",
           "StepComparison", "MAX_DUEL_BLOCKS", "AFTER_THE_SEARCH", "IN_THE_FIRST_DUEL",
           "IN_THE_FIRST_EPOCHS"]

#: Most blocks of ``rounds`` pairs one duel takes while it is still undecided.
MAX_DUEL_BLOCKS = 3

#: How far a duel's pairs may disagree before the machine counts as too noisy to decide (see the module
#: docstring): on a quiet machine two plans' steps on the same batches keep their ratio within a few percent,
#: round after round and whichever runs first, and a plan's step stays within tens of percent of its fastest;
#: a descheduled thread makes a step several times slower.
NOISE_FACTOR = 1.5

#: When the report's step comparison was timed (:attr:`StepComparison.phase`): its own phase after the search, or,
#: when the chosen plan is FP32's or AMP's, the search's duel of those two plans, which is such a phase already.
AFTER_THE_SEARCH = "after the search"
IN_THE_FIRST_DUEL = "in the search's duel of FP32's and AMP's plans"
IN_THE_FIRST_EPOCHS = "in the search's first epochs (FP32's and AMP's plans, each training a copy of the state)"


def paired_costs(seconds: Sequence[Sequence[float]], cost: Callable[[int, float], float]) -> list[list[float]]:
    """Each plan's per-round seconds priced by ``cost(plan index, seconds)``."""
    return [[cost(i, s) for s in row] for i, row in enumerate(seconds)]


@dataclass(frozen=True)
class Comparison:
    """Paired costs of an incumbent and a candidate, round by round; ``ratios`` are candidate / incumbent.

    ``incumbent_first`` says, per pair, whether the incumbent's step ran first (None where not known);
    ``disturbance`` how far each plan's costs ran above its fastest at the same rounds (see the module
    docstring), (incumbent's, candidate's) medians, where known. Both feed :meth:`noise`.
    """

    incumbent: tuple[float, ...]
    candidate: tuple[float, ...]
    incumbent_first: tuple[bool | None, ...] = ()
    disturbance: tuple[float, float] | None = None

    @classmethod
    def of(cls, incumbent: Sequence[float], candidate: Sequence[float],
           incumbent_first: Sequence[bool | None] = ()) -> "Comparison":
        if len(incumbent) != len(candidate) or not incumbent:
            raise BadInputError(f"a comparison pairs costs round by round; got {len(incumbent)} and "
                                f"{len(candidate)} rounds")
        return cls(tuple(map(float, incumbent)), tuple(map(float, candidate)), tuple(incumbent_first))

    def noise(self, confidence: float) -> tuple[float, str]:
        """How far the machine's noise hit the two plans unlike each other, as a factor on the cost ratio, and
        in words: the largest of the checks in the module docstring that exceeds :data:`NOISE_FACTOR`, or
        ``(1.0, "")`` when none does. A win by more than that factor stands whatever the noise did.

        >>> Comparison.of([1.0] * 7, [0.5, 0.52, 0.49, 0.5, 0.51, 0.5, 0.5]).noise(0.95)
        (1.0, '')
        >>> Comparison.of([1.0] * 7, [0.1, 0.9, 0.1, 0.1, 0.9, 0.1, 0.9]).noise(0.95)
        (9.0, "the pairs' cost ratios spread from 0.1 to 0.9 around 0.1")
        """
        ratios = [r for r in self.ratios if 0 < r < math.inf]
        if len(ratios) < len(self.ratios) or not ratios:
            return 1.0, ""  # a zero or infinite cost: nothing to judge the spread by
        found = [(1.0, "")]
        low, high, _ = median_interval(ratios, confidence)
        middle = statistics.median(ratios)
        found.append((max(high / middle, middle / low),
                      f"the pairs' cost ratios spread from {low:.3g} to {high:.3g} around {middle:.3g}"))
        first = [r for r, f in zip(ratios, self.incumbent_first) if f is True]
        second = [r for r, f in zip(ratios, self.incumbent_first) if f is False]
        if len(first) >= 2 and len(second) >= 2:
            a, b = statistics.median(first), statistics.median(second)
            found.append((max(a / b, b / a), f"the cost ratio is {a:.3g} when the incumbent runs first and {b:.3g} "
                                             "when it runs second"))
        if self.disturbance is not None and min(self.disturbance) > 0:
            mine, theirs = self.disturbance
            found.append((max(mine / theirs, theirs / mine), f"the incumbent's steps ran {mine:.2f}x and the "
                                                             f"candidate's {theirs:.2f}x their fastest at the same rounds"))
        factor, words = max(found, key=lambda item: item[0])
        return (factor, words) if factor > NOISE_FACTOR else (1.0, "")

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(c / i if i > 0 else math.inf for i, c in zip(self.incumbent, self.candidate))

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def interval(self, confidence: float) -> tuple[float, float, float]:
        return median_interval(self.ratios, confidence)

    def speedup(self, confidence: float) -> tuple[float, float, float]:
        """(median, low, high) of the candidate's speed-up over the incumbent (incumbent / candidate per round)."""
        speedups = [i / c if c > 0 else math.inf for i, c in zip(self.incumbent, self.candidate)]
        low, high, _ = median_interval(speedups, confidence)
        return statistics.median(speedups), low, high

    def extended(self, other: "Comparison") -> "Comparison":
        return Comparison(self.incumbent + other.incumbent, self.candidate + other.candidate,
                          _orders(self) + _orders(other), other.disturbance or self.disturbance)


def _orders(comparison: Comparison) -> tuple[bool | None, ...]:
    """Per pair whether the incumbent ran first, None where not known (padded to the pairs)."""
    known = comparison.incumbent_first[:len(comparison.incumbent)]
    return known + (None,) * (len(comparison.incumbent) - len(known))


@dataclass(frozen=True)
class Verdict:
    """What one duel decided, and on what."""

    comparison: Comparison
    replaces: bool
    low: float
    high: float
    coverage: float
    bar: float  # the ratio the interval had to stay below
    reason: str
    seconds: tuple[tuple[float, ...], ...] = ()  # (incumbent's, candidate's) seconds per round, as measured
    noise: str = ""  # why the machine was too noisy to decide, when that alone kept the incumbent

    def to_dict(self) -> dict:
        return {"incumbent_costs": list(self.comparison.incumbent), "candidate_costs": list(self.comparison.candidate),
                "median_ratio": self.comparison.median, "interval": [self.low, self.high], "coverage": self.coverage,
                "bar": self.bar, "replaces": self.replaces, **({"too_noisy": self.noise} if self.noise else {})}


@dataclass(frozen=True)
class DecisionRule:
    """When a candidate plan replaces the incumbent: ``SearchConfig(decision=DecisionRule(...))``.

    A candidate replaces the incumbent (first AMP's plan, then FP32's, then the
    candidates in a fixed order) only when it is faster by more than ``margin``,
    at ``confidence``, on ``rounds`` pairs of interleaved steps of the two plans
    on the same batches (up to :data:`MAX_DUEL_BLOCKS` blocks of them while
    undecided); or, saving fewer activation bytes, when it is not slower by more
    than ``margin``. Ties keep the incumbent. The report's step comparison of
    FP32, AMP and the chosen plan takes ``rounds`` rounds too. Frozen, and
    checked when built; the module docstring has the statistics.

    Args:
        margin: the least fraction a candidate must be faster by, in [0, 1): 0.03 is 3%.
        confidence: how sure a duel must be, in (0, 1): its interval covers the median ratio this often.
        rounds: pairs of steps per duel block. 0 decides on the stages' own timings alone (the screen); with
            ``margin=0`` too, that is CoMP's rule, the cheaper plan wins (:data:`COMP_RULE`).

    Raises:
        BadInputError: a value out of range, or not a number (a bool is not one; ``rounds`` is an int).

    Example::

        >>> import compfx
        >>> config = compfx.SearchConfig(decision=compfx.DecisionRule(margin=0.05, rounds=9))
        >>> config.decision
        DecisionRule(margin=0.05, confidence=0.95, rounds=9)
        >>> compfx.DecisionRule(margin=1.5)
        Traceback (most recent call last):
        ...
        compfx.errors.BadInputError: DecisionRule(margin=1.5); expected a fraction in [0, 1), e.g. 0.03 (a candidate must be more than 3% faster to replace the incumbent).
    """

    margin: float = 0.03
    confidence: float = 0.95
    rounds: int = 7

    def __post_init__(self):
        for name in ("margin", "confidence"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise BadInputError(f"DecisionRule({name}={value!r}); expected a number, not a {type(value).__name__}.")
            object.__setattr__(self, name, float(value))
        if not (0 <= self.margin < 1):
            raise BadInputError(f"DecisionRule(margin={self.margin!r}); expected a fraction in [0, 1), e.g. 0.03 (a "
                                "candidate must be more than 3% faster to replace the incumbent).")
        if not (0 < self.confidence < 1):
            raise BadInputError(f"DecisionRule(confidence={self.confidence!r}); expected a probability in (0, 1), e.g. "
                                "0.95 (the duel's interval covers the median ratio 95% of the time).")
        if not isinstance(self.rounds, numbers.Integral) or isinstance(self.rounds, bool) or self.rounds < 0:
            raise BadInputError(f"DecisionRule(rounds={self.rounds!r}); expected an int >= 0: 0 (no duel) or more "
                                "pairs per duel.")
        object.__setattr__(self, "rounds", int(self.rounds))

    def ratio_bar(self, saves_less: bool) -> float:
        """The cost ratio candidate / incumbent a candidate must stay below."""
        return 1.0 + self.margin if saves_less else 1.0 - self.margin

    def bar(self, incumbent_cost: float, *, saves_less: bool) -> float:
        """The screen: a candidate must cost strictly less than this (pruning stops a sample that reaches it)."""
        return self.ratio_bar(saves_less) * incumbent_cost

    def passes_screen(self, candidate_cost: float, incumbent_cost: float, *, saves_less: bool) -> bool:
        return candidate_cost < self.bar(incumbent_cost, saves_less=saves_less)

    def verdict(self, comparison: Comparison, *, saves_less: bool) -> Verdict:
        """Does the candidate replace the incumbent, on these paired costs?"""
        low, high, coverage = comparison.interval(self.confidence)
        bar = self.ratio_bar(saves_less)
        # only a win needs its pairs believed, and only one the noise could account for is in doubt
        factor, noise = comparison.noise(self.confidence) if high < bar else (1.0, "")
        noise = noise if high * factor >= bar else ""
        replaces = high < bar and not noise
        what = (f"not slower by more than {self.margin:.0%}, and saves less memory" if saves_less
                else f"faster by more than {self.margin:.0%}")
        reason = (f"cost ratio {comparison.median:.3f} ({low:.3f}-{high:.3f}, {coverage:.0%} interval over "
                  f"{len(comparison.ratios)} pairs): "
                  + (what if replaces else f"{what} on its face, but the machine was too noisy to decide ({noise}); "
                     "incumbent kept" if noise else f"not confidently {what}; incumbent kept"))
        return Verdict(comparison, replaces, low, high, coverage, bar, reason, noise=noise)

    def decided(self, verdict: Verdict) -> bool:
        """True when more pairs cannot change the verdict's meaning (won, or the median itself is past the bar);
        pairs too noisy to decide are not a decision: more may be quieter."""
        return verdict.replaces or not verdict.comparison.median < verdict.bar

    def check_rounds(self) -> None:
        """Refuse ``rounds`` too few for ``confidence`` (even the full range would cover less)."""
        if self.rounds and 1 - 2 / 2 ** self.rounds < self.confidence:
            needed = next(n for n in range(1, 64) if 1 - 2 / 2 ** n >= self.confidence)
            raise BadInputError(f"rounds={self.rounds} pairs cannot give {self.confidence:.0%} confidence (the "
                                f"widest interval of {self.rounds} covers {1 - 2 / 2 ** self.rounds:.1%}); expected "
                                f"at least {needed} rounds, or a lower confidence")



#: CoMP's own rule: the cheaper plan wins on the stages' timings, no margin, no duel (the stages' default).
COMP_RULE = DecisionRule(margin=0.0, rounds=0)

def speedup_measured(low: float, high: float) -> bool:
    """Is a speed-up with this interval measured, i.e. does the interval exclude 1? The report states it only then.

    >>> speedup_measured(1.02, 1.10), speedup_measured(0.98, 1.10)
    (True, False)
    """
    return low > 1.0 or high < 1.0


def speedup_text(comparison: Comparison, confidence: float) -> str:
    """The report's words for how much faster the candidate is than the incumbent, from paired costs.

    ``"speed-up 1.24x (1.19-1.30)"`` when the interval of the speed-up
    (incumbent / candidate per pair) excludes 1; otherwise ``"no measurable
    difference (±3%)"``, the ± being the interval's wider side.

    >>> speedup_text(Comparison.of([1.24, 1.3, 1.19, 1.25, 1.22], [1.0] * 5), 0.9)
    'speed-up 1.24x (1.19-1.30)'
    >>> speedup_text(Comparison.of([1.0, 1.02, 0.99, 1.01, 0.97], [1.0] * 5), 0.9)
    'no measurable difference (±3%)'
    """
    middle, low, high = comparison.speedup(confidence)
    if speedup_measured(low, high):
        return f"speed-up {middle:.2f}x ({low:.2f}-{high:.2f})"
    spread = max(1.0 - low, high - 1.0)
    return f"no measurable difference (±{math.ceil(spread * 100 - 1e-9):.0f}%)"


def duel(evaluator, rule: DecisionRule, incumbent, candidate, *, saves_less: bool,
         measured: Sequence[Sequence[float]] = ((), ()),
         failed: Callable[[PlanFailedError], None] | None = None) -> Verdict:
    """Time ``incumbent`` and ``candidate`` in turns on the same batches (``evaluator.time_steps``); the verdict.

    Blocks of ``rule.rounds`` pairs, until the verdict is decided or
    :data:`MAX_DUEL_BLOCKS` blocks' worth of pairs were taken. ``measured``:
    the (incumbent's, candidate's) seconds of pairs taken already (two
    epochs taking turns), judged first and counted in that worth. Each pair's
    seconds are priced by ``evaluator.cost``. A plan that fails while it is
    timed (:class:`~compfx.errors.PlanFailedError`) propagates, for the
    caller to log; with ``failed`` and pairs to judge, ``failed(error)`` is told
    instead and the verdict is the pairs' so far.
    """
    seconds = [[float(s) for s in row] for row in measured]
    price = lambda i, s: checked_cost(evaluator, (incumbent, candidate)[i], s)  # noqa: E731
    costs = paired_costs(seconds, price)
    orders: list[bool | None] = [None] * len(seconds[0])  # the epochs' pairs: in turns, order not kept
    blocks: list[list[list[float]]] = []  # this duel's timed blocks, priced: their rounds are comparable
    verdict = rule.verdict(Comparison.of(*costs), saves_less=saves_less) if seconds[0] else None
    while (verdict is None or not rule.decided(verdict)) and len(seconds[0]) < MAX_DUEL_BLOCKS * rule.rounds:
        try:
            block = evaluator.time_steps([incumbent, candidate], rule.rounds)
        except PlanFailedError as error:
            if failed is None or verdict is None:
                raise
            failed(error)
            break
        blocks.append(paired_costs(block, price))
        for row, cost_row, more, priced in zip(seconds, costs, block, blocks[-1]):
            row.extend(float(s) for s in more)
            cost_row.extend(priced)
        orders += [interleaved_order(2, r)[0] == 0 for r in range(len(block[0]))]
        comparison = replace(Comparison.of(*costs, orders),
                             disturbance=_disturbance(evaluator, (incumbent, candidate), blocks))
        verdict = rule.verdict(comparison, saves_less=saves_less)
    return replace(verdict, seconds=tuple(map(tuple, seconds)))


#: Per search (by its evaluator's id, while the evaluator lives), per plan, the least cost it had at each round
#: of a duel block. By id: an evaluator may be a dataclass, which is not hashable.
_FASTEST: dict[int, dict] = {}


def _disturbance(evaluator, plans, blocks: list[list[list[float]]]) -> tuple[float, float] | None:
    """(incumbent's, candidate's) median of their costs in this duel's blocks over their fastest at the same round
    in any block of the search (this duel's included): how far each ran above its best. Every block runs the same
    batches from the same state (``FairSampler.interleaved_step_times``), so round ``r`` of two blocks is one
    computation timed twice. None where the evaluator cannot be remembered."""
    fastest = _FASTEST.get(id(evaluator))
    if fastest is None:
        try:
            weakref.finalize(evaluator, _FASTEST.pop, id(evaluator), None)
        except TypeError:  # not weakly referable: no memory across duels
            return None
        fastest = _FASTEST[id(evaluator)] = {}
    for block in blocks[-1:]:
        for plan, row in zip(plans, block):
            best = fastest.setdefault(plan, {})
            for r, cost in enumerate(row):
                best[r] = min(best.get(r, math.inf), cost)
    above = []
    for j, plan in enumerate(plans):
        best = fastest[plan]
        ratios = [cost / best[r] for block in blocks for r, cost in enumerate(block[j]) if best[r] > 0]
        if not ratios:
            return None
        above.append(statistics.median(ratios))
    return above[0], above[1]


def log_duel(report, stage, verdict: Verdict, incumbent, candidate, rounds: int, *, epoch_pairs: int = 0) -> None:
    """Log a duel as a note: its verdict and the seconds of every round (a resumed search replays them).

    ``epoch_pairs``: its first pairs were the two plans' Stage-1 epochs, taking turns (a resumed search replays
    the epochs; the blocks of ``rounds`` pairs after them, timed for the duel, it replays from here)."""
    words = f"their epochs taking turns ({epoch_pairs} pairs), " if epoch_pairs else ""
    note(report, stage, f"duel {candidate} vs incumbent {incumbent}: {words}{verdict.reason}",
         **{DUEL: {"incumbent": str(incumbent), "candidate": str(candidate), "rounds": rounds,
                   "seconds": [list(row) for row in verdict.seconds], **verdict.to_dict(),
                   **({"epoch_pairs": epoch_pairs} if epoch_pairs else {})}})


@dataclass(frozen=True)
class StepComparison:
    """The report's step comparison: each named plan's step seconds, round by round, from one interleaved phase.

    ``plans`` names each plan's CoMP string (two names may share a plan: it
    was timed once); ``saved_bytes`` the activation bytes one forward of each
    saves for backward (missing where unknown); ``phase`` says when the plans
    took their turns (:data:`AFTER_THE_SEARCH`, :data:`IN_THE_FIRST_DUEL` or :data:`IN_THE_FIRST_EPOCHS`).

    >>> c = StepComparison({"fp32": "11", "chosen": "01"}, {"fp32": (2.0, 2.1, 2.0), "chosen": (1.0, 1.1, 1.0)}, 0.7)
    >>> c.median("chosen"), c.speedup("fp32")
    (1.0, 'speed-up 2.00x (1.91-2.00)')
    """

    plans: dict[str, str]
    seconds: dict[str, tuple[float, ...]]
    confidence: float
    saved_bytes: dict[str, int] | None = None
    phase: str = AFTER_THE_SEARCH

    def median(self, name: str) -> float | None:
        return statistics.median(self.seconds[name]) if self.seconds.get(name) else None

    def spread(self, name: str) -> tuple[float, float] | None:
        """The interval of ``name``'s median step at ``confidence`` (None when it was not timed)."""
        if not self.seconds.get(name):
            return None
        low, high, _ = median_interval(self.seconds[name], self.confidence)
        return low, high

    def speedup(self, over: str, of: str = "chosen") -> str | None:
        """How much faster ``of`` is than ``over`` (:func:`speedup_text`); None when either was not timed."""
        if not self.seconds.get(over) or not self.seconds.get(of):
            return None
        if self.plans.get(over) == self.plans.get(of):
            return f"the same plan as {over.upper()}"
        return speedup_text(Comparison.of(self.seconds[over], self.seconds[of]), self.confidence)

    @property
    def coverage(self) -> float:
        """The coverage of the intervals this comparison states (its rounds and confidence give it)."""
        rounds = max((len(s) for s in self.seconds.values()), default=0)
        return median_interval(range(rounds), self.confidence)[2] if rounds else 0.0

    def to_dict(self) -> dict:
        return {"plans": dict(self.plans), "seconds": {k: list(v) for k, v in self.seconds.items()},
                "confidence": self.confidence, "saved_bytes": dict(self.saved_bytes or {}), "phase": self.phase}

    @classmethod
    def from_dict(cls, data: dict) -> "StepComparison":
        return cls({str(k): str(v) for k, v in data["plans"].items()},
                   {str(k): tuple(float(x) for x in v) for k, v in data["seconds"].items()},
                   float(data["confidence"]), {str(k): int(v) for k, v in data.get("saved_bytes", {}).items()},
                   str(data.get("phase", AFTER_THE_SEARCH)))
