"""Stage 5 of the pipeline: CoMP's two-stage search, as pure logic over injected evaluators.

Nothing here touches a model. Plans are CoMP bitstrings over ``analysis.ops``
('0' low, '1' FP32, 'f' follow) and every measurement comes from a callable,
so the search is exactly testable with fake evaluators:

* ``run_epoch(bits)`` -- a generator that trains one epoch under ``bits`` and
  yields ``(batch_loss, batch_seconds)`` per batch; its ``return`` value is an
  opaque artifact (the trained state) that the search keeps for the winner.
  Closing it early must restore whatever it changed (``training.py`` does).
* ``time_step(bits) -> seconds`` -- median step time of a plan (Stage 2).
* ``check_loss(bits) -> loss`` -- mean loss over a few batches (Stage-2 check).
* ``cost(bits, seconds) -> float`` -- what the search minimises.

**Stage 1** (Algorithm 1) runs an FP32 epoch for ``loss_0``, fixes
Tensor-Core-eligible whitelist ops to low and "other" ops to follow, and tries
the adjustable ops (blacklist + whitelist without TC) at both precisions. A plan
is accepted when its mean epoch loss is finite and below
``loss_0 + (threshold - 1) * |loss_0|`` (the paper's ``loss_0 * 1.01`` for a
positive loss). The cheapest accepted plan wins; ties go to the earlier sample,
and the FP32 plan (run first) is always the fallback. When ``2**k`` exceeds the
budget the space is reduced (:func:`stage1_plan_space` says how) and a note is
logged.

**Exact-safe pruning.** A Stage-1 sample stops as soon as its running cost,
``cost(bits, seconds so far)``, reaches the best accepted cost (it cannot win:
costs only grow and ties go to the earlier sample), or as soon as a batch loss
is NaN/inf (the epoch mean cannot be finite). This is exact -- the search picks
the same plan as without pruning -- provided ``cost`` is non-decreasing in
``seconds``, which every cost of the form "seconds times or plus something that
depends on the plan" is.

**Fewer samples.** A candidate that rewrites to a program already sampled
(``identity``) is not run again. With a cost model (``predict``), candidates
run cheapest-predicted first and those predicted over ``margin`` x the best are
skipped; ``early_stop`` also ends a sample whose measured pace projects it over
the best. These two are not exact, which is why ``optimize`` uses them only
with ``predictor="on"``.

**Stage 2** (Algorithm 2) takes the Stage-1 winner and, for each segment
between consecutive Stage-1 ops whose precisions differ, enumerates the "other"
ops strictly inside it (see :func:`stage2_segments` for the boundaries).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable, Hashable, Iterator, Sequence

from .errors import BadInputError, SearchError
from .searchlog import SampleRecord

__all__ = [
    "SearchSpace", "Outcome", "Segment", "Stage1Result", "Stage2Result", "STOPPED_EARLY",
    "loss_limit", "is_accepted", "stage1_bits", "stage1_plan_space", "stage1_candidates",
    "stage2_segments", "algorithm2_candidates", "run_stage1", "should_skip", "skip_message", "run_stage2", "check_stage2",
]

EpochRunner = Callable[[str], Iterator[tuple[float, float]]]
CostFn = Callable[[str, float], float]
Predict = Callable[[str], float]  # bits -> predicted seconds of one Stage-1 epoch
Identity = Callable[[str], Hashable]  # bits -> what the plan runs (equal: the same program)
Reporter = Callable[[SampleRecord], None]

_LOW, _FP32, _FOLLOW = "0", "1", "f"

#: batches a Stage-1 sample runs before an early stop may judge its pace
EARLY_STOP_MIN_BATCHES = 3
#: key of ``Outcome.extra`` (and the log record's) on a sample stopped early on pace
STOPPED_EARLY = "stopped_early"


@dataclass(frozen=True)
class SearchSpace:
    """What the search needs to know about each op, in graph order (``analysis.ops``)."""

    categories: tuple[str, ...]  # "whitelist" | "blacklist" | "other"
    tc_eligible: tuple[bool, ...]
    groups: tuple[Hashable, ...]  # ops with equal labels may share one bit when Stage 1 must shrink
    names: tuple[str, ...] = ()

    def __post_init__(self):
        n = len(self.categories)
        if len(self.tc_eligible) != n or len(self.groups) != n or (self.names and len(self.names) != n):
            raise SearchError("SearchSpace fields must all have one entry per op")
        bad = set(self.categories) - {"whitelist", "blacklist", "other"}
        if bad:
            raise SearchError(f"unknown op categories {sorted(bad)}; expected whitelist, blacklist or other")

    @classmethod
    def from_analysis(cls, analysis) -> "SearchSpace":
        """Group label = op kind + input shapes: such ops cost the same and usually behave alike."""
        return cls(
            categories=tuple(op.category for op in analysis.ops),
            tc_eligible=tuple(op.tc_eligible for op in analysis.ops),
            # as text: dynamo graphs may hold symbolic (unhashable) sizes
            groups=tuple(f"{op.kind}{list(map(list, op.input_shapes))}" for op in analysis.ops),
            names=tuple(str(op.key) for op in analysis.ops),
        )

    def __len__(self) -> int:
        return len(self.categories)

    @property
    def stage1_positions(self) -> tuple[int, ...]:
        """CoMP's Stage1_OP_list: whitelist and blacklist ops."""
        return tuple(i for i, c in enumerate(self.categories) if c != "other")

    @property
    def adjustable(self) -> tuple[int, ...]:
        """Stage-1 ops tried at both precisions: blacklist, and whitelist without Tensor Cores."""
        return tuple(i for i, c in enumerate(self.categories)
                     if c == "blacklist" or (c == "whitelist" and not self.tc_eligible[i]))

    @property
    def fp32_bits(self) -> str:
        return _FP32 * len(self)

    def name(self, i: int) -> str:
        return self.names[i] if self.names else f"op{i}"


@dataclass
class Outcome:
    """What one sample gave."""

    bits: str
    status: str  # accepted | rejected | pruned | error | skipped
    loss: float | None = None
    seconds: float = 0.0
    cost: float = math.inf
    batches: int = 0
    reason: str = ""
    duration: float = 0.0
    batch_losses: list[float] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)
    artifact: Any = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)  # e.g. the predicted epoch seconds, for the report

    def record(self, stage: str) -> SampleRecord:
        return SampleRecord(stage, self.bits, self.status, loss=self.loss,
                            cost=None if math.isinf(self.cost) else self.cost, seconds=self.seconds,
                            batches=self.batches, reason=self.reason, duration=self.duration,
                            extra=dict(self.extra))


def loss_limit(loss0: float, threshold: float) -> float:
    """Largest loss (exclusive) still accepted: ``loss_0 * threshold`` for a positive ``loss_0``."""
    return loss0 + (threshold - 1.0) * abs(loss0)


def is_accepted(loss: float | None, loss0: float, threshold: float) -> bool:
    return loss is not None and math.isfinite(loss) and loss < loss_limit(loss0, threshold)


# -- Stage 1: candidates ------------------------------------------------------

def stage1_bits(space: SearchSpace, choice: dict[int, str]) -> str:
    """A Stage-1 plan: TC whitelist ops low, "other" ops follow, adjustable ops from ``choice``."""
    bits = []
    for i, category in enumerate(space.categories):
        if i in choice:
            bits.append(choice[i])
        elif category == "other":
            bits.append(_FOLLOW)
        elif category == "whitelist" and space.tc_eligible[i]:
            bits.append(_LOW)
        else:  # an adjustable op left out of ``choice`` keeps autocast's choice
            bits.append(_LOW if category == "whitelist" else _FP32)
    return "".join(bits)


def _groups_of(space: SearchSpace) -> list[tuple[int, ...]]:
    """Adjustable ops with the same group label, in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i in space.adjustable:
        groups.setdefault(space.groups[i], []).append(i)
    return [tuple(members) for members in groups.values()]


def stage1_plan_space(space: SearchSpace, budget: int) -> str:
    """How Stage 1 covers the ``k`` adjustable ops within ``budget`` samples (FP32 baseline not counted).

    * ``"exhaustive"``: ``2**k <= budget``; every combination, as in the paper.
    * ``"grouped"``: ops of the same kind and input shapes share one bit; all
      ``2**g`` group combinations are run, then the remaining budget refines op
      by op (flip one op; keep the flip when it gives a new best plan).
    * ``"greedy"``: even ``2**g`` is over budget; start from autocast's choice
      and flip one op at a time, in graph order, keeping flips that give a new best.
    """
    k = len(space.adjustable)
    if 2 ** k <= budget:
        return "exhaustive"
    if 2 ** len(_groups_of(space)) <= budget:
        return "grouped"
    return "greedy"


def _most_low_first(choices: list[dict[int, str]]) -> list[dict[int, str]]:
    # Plans with more low-precision ops are usually the fast ones where low
    # precision pays; running them first sets a low bar that prunes later samples sooner.
    return sorted(choices, key=lambda c: -sum(b == _LOW for b in c.values()))


def stage1_candidates(space: SearchSpace, groups: Sequence[Sequence[int]] | None = None) -> list[str]:
    """Every combination of the adjustable ops (or of ``groups`` of them), most-low first."""
    groups = [(i,) for i in space.adjustable] if groups is None else groups
    choices = [{i: bit for members, bit in zip(groups, bits) for i in members}
               for bits in product(_LOW + _FP32, repeat=len(groups))]
    return [stage1_bits(space, c) for c in _most_low_first(choices)]


# -- Stage 1: sampling ----------------------------------------------------------

def _flip(bits: str, i: int) -> str:
    return bits[:i] + (_FP32 if bits[i] == _LOW else _LOW) + bits[i + 1:]


class _Stage1:
    """Runs samples and keeps the best accepted one; the strategies below decide what to run."""

    def __init__(self, run_epoch: EpochRunner, cost: CostFn, threshold: float, prune: bool,
                 report: Reporter | None, predict: Predict | None = None, margin: float = 1.25,
                 bound: Predict | None = None, identity: Identity | None = None,
                 early_stop: float | None = None):
        self.run_epoch, self.cost, self.threshold, self.prune = run_epoch, cost, threshold, prune
        self.report = report or (lambda record: None)
        self.predict, self.margin = predict, margin
        self.bound = bound if predict is not None else None
        self.identity, self.early_stop = identity, early_stop
        self.predicted: dict[str, float] = {}  # bits -> predicted cost
        self.bounds: dict[str, float] = {}  # bits -> cost at the lower bound of the predicted seconds
        self.samples: list[Outcome] = []
        self.seen: set[str] = set()
        self.programs: dict[Hashable, str] = {}  # identity -> the first plan sampled with it
        self.best: Outcome | None = None
        self.loss0: float | None = None

    def sample(self, bits: str) -> Outcome:
        """Run one epoch under ``bits``, stopping early when pruning allows it."""
        start = time.perf_counter()
        outcome = Outcome(bits, "rejected")
        epoch = None
        try:
            epoch = self.run_epoch(bits)
            outcome.artifact = self._consume(epoch, outcome)
        except (BadInputError, SearchError):
            raise  # the user's inputs are wrong whatever the plan: no point trying the others
        except Exception as error:  # the model failed under this plan: reject it, keep searching
            outcome.status, outcome.reason = "error", f"{type(error).__name__}: {error}"
        finally:
            if epoch is not None and hasattr(epoch, "close"):
                epoch.close()  # restores the state when the sample stopped early
            outcome.duration = time.perf_counter() - start
        return outcome

    def _consume(self, epoch, outcome: Outcome):
        total = 0.0
        while True:
            try:
                loss, seconds = next(epoch)
            except StopIteration as stop:
                artifact = stop.value
                break
            outcome.batch_losses.append(float(loss))
            outcome.batch_seconds.append(float(seconds))
            outcome.batches += 1
            outcome.seconds += seconds
            total += loss
            if self.prune and not math.isfinite(loss):
                outcome.status, outcome.loss = "pruned", float(loss)
                outcome.reason = f"loss became {loss} at batch {outcome.batches}; the epoch mean cannot be finite"
                return None
            if self.prune and self.best is not None:
                running = self.cost(outcome.bits, outcome.seconds)
                if running >= self.best.cost:
                    outcome.status, outcome.cost = "pruned", running
                    outcome.reason = (f"running cost {running:.6g} after {outcome.batches} batches already "
                                      f">= best accepted cost {self.best.cost:.6g} ({self.best.bits})")
                    return None
                if self._stopped_early(outcome):
                    return None
        if outcome.batches == 0:
            raise SearchError("the sample loader yielded no batches; Stage 1 needs at least one batch per epoch")
        outcome.loss = total / outcome.batches
        outcome.cost = self.cost(outcome.bits, outcome.seconds)
        return artifact

    def baseline(self, bits: str) -> Outcome:
        outcome = self.sample(bits)
        if outcome.status == "error" or outcome.loss is None or not math.isfinite(outcome.loss):
            self.report(outcome.record("stage1"))
            raise SearchError(
                f"the FP32 baseline epoch failed ({outcome.reason or f'loss {outcome.loss}'}); the search compares "
                "every plan with it. Check that the model trains in FP32 with this loader, loss_fn and optimizer.")
        outcome.status, outcome.reason = "accepted", "FP32 baseline (loss_0)"
        self.loss0, self.best = outcome.loss, outcome
        self.samples.append(outcome)
        self.seen.add(bits)
        _earlier_twin(self.programs, self.identity, bits)  # the baseline's program is the first recorded
        self.report(outcome.record("stage1"))
        return outcome

    def predicted_cost(self, bits: str) -> float | None:
        """``cost(bits, predicted epoch seconds)``; None without a predictor, NaN when it cannot price ``bits``."""
        return None if self.predict is None else self._priced(self.predict, self.predicted, bits)

    def bound_cost(self, bits: str) -> float:
        """``cost(bits, lower bound of the predicted seconds)``: the full prediction when there is no bound."""
        if self.bound is None:
            return self.predicted_cost(bits)
        return self._priced(self.bound, self.bounds, bits)

    def _priced(self, estimate: Predict, cache: dict[str, float], bits: str) -> float:
        """``cost(bits, estimate(bits))``, computed once per plan; NaN when ``bits`` cannot be priced."""
        if bits not in cache:
            seconds = float(estimate(bits))
            cache[bits] = float(self.cost(bits, seconds)) if math.isfinite(seconds) else math.nan
        return cache[bits]

    def by_prediction(self, candidates: Sequence[str]) -> list[str]:
        """Candidates cheapest-predicted first (stable; by the bound when there is one), or as given."""
        if self.predict is None:
            return list(candidates)

        def key(bits: str) -> tuple[bool, float]:
            value = self.bound_cost(bits)  # a plan that cannot be priced (NaN) goes after those that can
            return (not math.isfinite(value), value if math.isfinite(value) else 0.0)
        return sorted(candidates, key=key)

    def skipped(self, bits: str) -> bool:
        """Log and skip ``bits`` when its predicted cost exceeds ``margin`` x the best measured accepted cost.

        The cheap lower bound is tried first: when even it is over, the full
        prediction (which can only be higher) is not computed.
        """
        if self.predict is None or self.best is None:
            return False
        predicted, name = self.bound_cost(bits), "predicted_cost_lower_bound"
        if not should_skip(predicted, self.best.cost, self.margin):
            predicted, name = self.predicted_cost(bits), "predicted_cost"
            if not should_skip(predicted, self.best.cost, self.margin):
                return False
        outcome = Outcome(bits, "skipped", reason=skip_message(predicted, self.best.cost), extra={name: predicted})
        self.report(outcome.record("stage1"))
        return True

    def _same_program_sampled(self, bits: str) -> bool:
        """True (and a note) when ``bits`` rewrites to a program already sampled: its epoch would be a replica.

        E.g. the Stage-1 plan with every adjustable op FP32 is the FP32 baseline
        whenever its "follow" ops only ever see FP32 inputs.
        """
        first = _earlier_twin(self.programs, self.identity, bits)
        if first is None:
            return False
        _note(self.report, "stage1", f"plan {bits} runs the same program as {first}, already sampled: not run "
              "again", plan=bits, same_as=first)
        return True

    def _stopped_early(self, outcome: Outcome) -> bool:
        """Stop a sample whose pace, batch for batch against the best plan's, projects it well over the best.

        Not exact (pruning is): the projection is the best plan's epoch seconds
        times the median per-batch ratio so far, after
        :data:`EARLY_STOP_MIN_BATCHES` batches; the sample stops when that
        projected cost exceeds the best accepted cost by more than ``early_stop``.
        """
        best, k = self.best, outcome.batches
        if self.early_stop is None or k < EARLY_STOP_MIN_BATCHES or len(best.batch_seconds) < k:
            return False
        ratios = [mine / theirs for mine, theirs in zip(outcome.batch_seconds, best.batch_seconds) if theirs > 0]
        if len(ratios) < EARLY_STOP_MIN_BATCHES:
            return False
        projected = self.cost(outcome.bits, statistics.median(ratios) * best.seconds)
        if not projected > (1.0 + self.early_stop) * best.cost:
            return False
        outcome.status, outcome.cost = "pruned", projected
        outcome.extra[STOPPED_EARLY] = True
        outcome.reason = (f"stopped early: projected cost {projected:.6g} after {k} batches is over "
                          f"{1.0 + self.early_stop:g} x best accepted cost {best.cost:.6g} ({best.bits})")
        return True

    def try_plan(self, bits: str) -> bool:
        """Sample ``bits`` (once); True when it became the new best."""
        if bits in self.seen:
            return False
        self.seen.add(bits)
        if self.skipped(bits) or self._same_program_sampled(bits):
            return False
        outcome = self.sample(bits)
        if self.predict is not None and math.isfinite(self.predicted_cost(bits)):
            outcome.extra["predicted_cost"] = self.predicted_cost(bits)
        became_best = False
        if outcome.status == "rejected":
            if is_accepted(outcome.loss, self.loss0, self.threshold):
                outcome.status = "accepted"
                became_best = outcome.cost < self.best.cost
                outcome.reason = "new best" if became_best else f"accepted; best cost is {self.best.cost:.6g}"
            else:
                outcome.reason = (f"loss {outcome.loss:.6g} not below {loss_limit(self.loss0, self.threshold):.6g} "
                                  f"(loss_0 {self.loss0:.6g} x threshold {self.threshold})")
        if became_best:
            self.best.artifact = None  # only the best plan's trained state is kept
            self.best = outcome
        else:
            outcome.artifact = None  # only the best plan's trained state is kept
        self.samples.append(outcome)
        self.report(outcome.record("stage1"))
        return became_best


@dataclass
class Stage1Result:
    best: Outcome
    baseline: Outcome
    samples: list[Outcome]
    mode: str

    @property
    def loss0(self) -> float:
        return self.baseline.loss


def _earlier_twin(programs: dict, identity: Identity | None, bits: str) -> str | None:
    """The plan first recorded in ``programs`` with the program ``bits`` rewrites to, unless that is ``bits``.

    Records ``bits`` when its program is new; None without an ``identity``.
    """
    if identity is None:
        return None
    first = programs.setdefault(identity(bits), bits)
    return None if first == bits else first


def should_skip(predicted: float, best: float | None, margin: float = 1.25) -> bool:
    """Skip measuring a candidate predicted to cost more than ``margin`` times the best accepted one.

    A plan that cannot be priced (NaN) is never skipped.

    >>> should_skip(1.3, 1.0), should_skip(1.2, 1.0), should_skip(9.0, None), should_skip(float("nan"), 1.0)
    (True, False, False, False)
    """
    if margin < 1.0:
        raise BadInputError(f"margin={margin}; expected >= 1.0 (1.25 skips candidates predicted 25% slower).")
    return best is not None and predicted > margin * best


def skip_message(predicted: float, best: float) -> str:
    """The reason logged for a candidate the predictor skipped.

    >>> skip_message(0.0123, 0.0045)
    'skipped (predicted 0.0123 s vs best 0.0045 s)'
    """
    return f"skipped (predicted {predicted:.3g} s vs best {best:.3g} s)"


def run_stage1(space: SearchSpace, run_epoch: EpochRunner, cost: CostFn, *, threshold: float = 1.01,
               budget: int = 64, prune: bool = True, report: Reporter | None = None,
               predict: Predict | None = None, margin: float = 1.25,
               bound: Predict | None = None, identity: Identity | None = None,
               early_stop: float | None = None) -> Stage1Result:
    """CoMP Algorithm 1 with exact-safe pruning; ``budget`` caps samples after the FP32 baseline.

    With ``predict(bits) -> predicted epoch seconds`` (called only after the
    FP32 baseline has run, so it may calibrate on it; NaN when it cannot price
    a plan, which then runs after the priced ones and is never skipped), candidates run cheapest
    predicted cost first, and a candidate whose ``cost(bits, predicted seconds)``
    exceeds ``margin`` times the best measured accepted cost is not run: it is
    logged with status ``"skipped"``. Skipped plans do not count against
    ``budget``. ``margin=math.inf`` only reorders. An optional cheap
    ``bound(bits)`` that never exceeds ``predict(bits)`` orders the candidates
    and skips without the full prediction when even the bound is over the
    margin (the logged figure is then that bound).

    ``identity(bits)`` names the program a plan runs (e.g. the rewritten
    graph's code): a candidate whose program was already sampled is not run
    again, and a note says so. ``early_stop`` (a fraction, e.g. 0.05; None: off)
    stops a sample once its measured pace projects it more than that fraction
    over the best accepted cost; unlike pruning it can misjudge a near-tie, so
    only approximate searches (the cost model on) should use it.

    >>> space = SearchSpace(("whitelist", "other", "blacklist"), (False,) * 3, ("a", "b", "c"))
    >>> def run_epoch(bits):                # fake: low precision halves the time, never hurts the loss
    ...     for _ in range(3):
    ...         yield 1.0, 1.0 - 0.25 * bits.count("0")
    >>> run_stage1(space, run_epoch, lambda bits, s: s).best.bits
    '0f0'
    """
    if budget < 1:
        raise SearchError(f"stage1_budget={budget}; expected at least 1 sample after the FP32 baseline")
    if not margin >= 1.0:
        raise SearchError(f"predictor margin={margin}; expected >= 1 (1.25 skips plans predicted 25% costlier)")
    if early_stop is not None and not early_stop >= 0:
        raise SearchError(f"early_stop={early_stop}; expected a fraction >= 0 (0.05: stop samples projected "
                          "5% over the best) or None")
    search = _Stage1(run_epoch, cost, threshold, prune, report, predict, margin, bound, identity, early_stop)
    search.baseline(space.fp32_bits)
    mode = stage1_plan_space(space, budget)
    if mode == "exhaustive":
        for bits in search.by_prediction(stage1_candidates(space)):
            search.try_plan(bits)
    elif mode == "grouped":
        _grouped(space, search, budget, report)
    else:
        _greedy(space, search, budget, report)
    return Stage1Result(search.best, search.samples[0], search.samples, mode)


def _note(report: Reporter | None, stage: str, message: str, **extra) -> None:
    if report is not None:
        report(SampleRecord(stage, "", "note", reason=message, extra=extra))


def _budget_left(search: _Stage1, budget: int) -> int:
    return budget - (len(search.samples) - 1)


def _grouped(space: SearchSpace, search: _Stage1, budget: int, report: Reporter | None) -> None:
    groups = _groups_of(space)
    _note(report, "stage1", f"{len(space.adjustable)} adjustable ops give 2^{len(space.adjustable)} plans, over "
          f"stage1_budget={budget}: ops of the same kind and input shapes share one bit ({len(groups)} groups), "
          "then the rest of the budget refines op by op", mode="grouped",
          groups=[[space.name(i) for i in g] for g in groups])
    candidates = stage1_candidates(space, groups)
    for bits in search.by_prediction(candidates):
        search.try_plan(bits)
    current = search.best.bits if search.best is not search.samples[0] else candidates[-1]
    _refine(space, search, budget, report, current, [i for g in groups if len(g) > 1 for i in g])


def _greedy(space: SearchSpace, search: _Stage1, budget: int, report: Reporter | None) -> None:
    _note(report, "stage1", f"even the {len(_groups_of(space))} groups of same-kind, same-shape ops exceed "
          f"stage1_budget={budget}: starting from autocast's choice and flipping one op at a time", mode="greedy")
    start = stage1_bits(space, {})
    search.try_plan(start)
    _refine(space, search, budget, report, start, list(space.adjustable))


def _refine(space: SearchSpace, search: _Stage1, budget: int, report: Reporter | None,
            current: str, order: list[int]) -> None:
    """Flip one op at a time from ``current``; keep a flip when it gives a new best plan."""
    for position, i in enumerate(order):
        if _budget_left(search, budget) <= 0:
            untried = [space.name(j) for j in order[position:]]
            _note(report, "stage1", f"stage1_budget={budget} spent: {len(untried)} ops were not tried alone and "
                  "keep the precision of the best plan found", untried=untried)
            return
        candidate = _flip(current, i)
        if search.try_plan(candidate):
            current = candidate


# -- Stage 2 -----------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """Ops strictly between two consecutive Stage-1 positions (or a boundary) whose precisions differ."""

    start: int
    end: int
    inner: tuple[int, ...]


def stage2_segments(space: SearchSpace, bits: str) -> list[Segment]:
    """Segments that Algorithm 2 enumerates for the Stage-1 winner ``bits``.

    The paper adds boundaries -1 and ``len - 1`` to Stage1_OP_list and counts
    ``2**(end - start)`` strings per segment, which takes in the op at ``end``.
    We enumerate the ops *strictly* inside each segment (so a Stage-1 op is never
    changed) and put the right boundary at ``len`` instead, so the ops after the
    last Stage-1 op are still covered, as in the paper. Both boundaries stand for
    FP32: the model's inputs, and the outputs that the FP32 loss reads.
    """
    if len(bits) != len(space):
        raise SearchError(f"bitstring {bits!r} has {len(bits)} characters for {len(space)} ops")
    cuts = [-1, *space.stage1_positions, len(space)]

    def precision(i: int) -> str:
        return _FP32 if i in (-1, len(space)) else bits[i]

    segments = []
    for start, end in zip(cuts, cuts[1:]):
        inner = tuple(range(start + 1, end))
        if inner and precision(start) != precision(end):
            segments.append(Segment(start, end, inner))
    return segments


def algorithm2_candidates(bits: str, segment: Segment) -> list[str]:
    """The ``2**n`` strings of Algorithm 2 for one segment, in binary counting order."""
    out = []
    for assignment in product(_LOW + _FP32, repeat=len(segment.inner)):
        chars = list(bits)
        for i, bit in zip(segment.inner, assignment):
            chars[i] = bit
        out.append("".join(chars))
    return out


@dataclass
class Stage2Result:
    best: Outcome
    base: Outcome
    samples: list[Outcome]
    segments: list[Segment]


class _Stage2:
    def __init__(self, time_step: Callable[[str], float], cost: CostFn, report: Reporter | None,
                 identity: Identity | None = None):
        self.time_step, self.cost, self.identity = time_step, cost, identity
        self.report = report or (lambda record: None)
        self.samples: list[Outcome] = []
        self.known: dict[str, Outcome] = {}
        self.programs: dict[Hashable, str] = {}  # identity -> the first plan timed with it

    def sample(self, bits: str, reason: str = "") -> Outcome:
        if bits in self.known:
            return self.known[bits]
        twin = self._twin(bits)
        if twin is not None:  # the same program was timed: its outcome stands (and wins the tie, being earlier)
            self.known[bits] = self.known[twin]
            _note(self.report, "stage2", f"plan {bits} runs the same program as {twin}, already timed: not "
                  "timed again", plan=bits, same_as=twin)
            return self.known[bits]
        start = time.perf_counter()
        outcome = Outcome(bits, "accepted", reason=reason)
        try:
            outcome.seconds = float(self.time_step(bits))
            outcome.cost = self.cost(bits, outcome.seconds)
        except (BadInputError, SearchError):
            raise
        except Exception as error:
            outcome.status, outcome.reason = "error", f"{type(error).__name__}: {error}"
        outcome.duration = time.perf_counter() - start
        self.known[bits] = outcome
        self.samples.append(outcome)
        self.report(outcome.record("stage2"))
        return outcome

    def _twin(self, bits: str) -> str | None:
        """The plan already timed that runs the same program as ``bits``, if any."""
        return _earlier_twin(self.programs, self.identity, bits)

    def cheapest(self, outcomes: Sequence[Outcome]) -> Outcome:
        """Lowest cost; the earliest wins a tie (``min`` keeps the first)."""
        return min(outcomes, key=lambda o: o.cost)


def run_stage2(space: SearchSpace, base_bits: str, time_step: Callable[[str], float], cost: CostFn, *,
               budget: int = 32, report: Reporter | None = None, identity: Identity | None = None) -> Stage2Result:
    """CoMP Algorithm 2 on the Stage-1 winner; ``budget`` caps timed candidates (the winner included).

    Candidates are the winner itself, then each differing segment's ``2**n``
    strings with the rest of the plan as in the winner (Algorithm 2). A segment
    whose ``2**n`` does not fit the budget left is searched greedily instead
    (each op tried at low and FP32 in turn, keeping the cheaper). Last, when
    two or more segments improved, their best strings are combined into one
    more candidate. The cheapest candidate wins. With no segment at all the
    winner stands untimed (``samples`` is empty and a note says why). With
    ``identity``, a candidate that runs the same program as one already timed
    (e.g. follow ops set to the dtype that reaches them anyway) takes that
    outcome instead of being timed, and does not count against ``budget``.

    >>> space = SearchSpace(("whitelist", "other", "blacklist"), (False,) * 3, ("a", "b", "c"))
    >>> run_stage2(space, "0f1", lambda bits: 1.0 - 0.1 * bits.count("0"), lambda b, s: s).best.bits
    '001'
    """
    if budget < 1:
        raise SearchError(f"stage2_budget={budget}; expected at least 1 (the Stage-1 winner itself)")
    segments = stage2_segments(space, base_bits)
    if not segments:  # no alternative to compare with: timing the winner alone would decide nothing
        _note(report, "stage2", "no segment lies between Stage-1 ops of differing precision: the Stage-1 winner "
              "stands, with nothing to time")
        base = Outcome(base_bits, "accepted", reason="Stage-1 winner")
        return Stage2Result(base, base, [], [])
    search = _Stage2(time_step, cost, report, identity)
    base = search.sample(base_bits, "Stage-1 winner")
    improved: list[tuple[Segment, str]] = []
    for segment in segments:
        left = budget - len(search.samples)
        if left <= 0:
            _note(report, "stage2", f"stage2_budget={budget} spent: segment ({segment.start}, {segment.end}) "
                  "keeps the Stage-1 precisions (follow)", segment=[segment.start, segment.end])
            continue
        if 2 ** len(segment.inner) <= left:
            tried = [search.sample(b, f"segment ({segment.start}, {segment.end})")
                     for b in algorithm2_candidates(base_bits, segment)]
        else:
            tried = _stage2_greedy(space, search, base_bits, segment, budget, report)
        best = search.cheapest([base, *tried])
        if best is not base:
            improved.append((segment, best.bits))
    if len(improved) > 1 and len(search.samples) < budget:
        chars = list(base_bits)
        for segment, bits in improved:
            for i in segment.inner:
                chars[i] = bits[i]
        search.sample("".join(chars), "best string of every segment, combined")
    return Stage2Result(search.cheapest(search.samples), base, search.samples, segments)


def _stage2_greedy(space: SearchSpace, search: _Stage2, base_bits: str, segment: Segment, budget: int,
                   report: Reporter | None) -> list[Outcome]:
    _note(report, "stage2", f"segment ({segment.start}, {segment.end}) has {len(segment.inner)} ops: 2^"
          f"{len(segment.inner)} strings exceed the budget left, so its ops are tried one at a time",
          segment=[segment.start, segment.end])
    current = search.known[base_bits]
    tried = []
    for position, i in enumerate(segment.inner):
        for bit in (_LOW, _FP32):
            if len(search.samples) >= budget:
                untried = [space.name(j) for j in segment.inner[position:]]
                _note(report, "stage2", f"stage2_budget={budget} spent inside segment ({segment.start}, "
                      f"{segment.end}); {len(untried)} ops keep 'follow'", untried=untried)
                return tried
            bits = current.bits[:i] + bit + current.bits[i + 1:]
            outcome = search.sample(bits, f"segment ({segment.start}, {segment.end}), greedy")
            tried.append(outcome)
            if outcome.cost < current.cost:
                current = outcome
    return tried


def check_stage2(winner: str, fallback: str, check_loss: Callable[[str], float], reference_loss: float,
                 threshold: float, report: Reporter | None = None) -> str:
    """Our addition to CoMP: re-check the Stage-2 winner's loss on a few batches against FP32's.

    Returns ``winner`` when its loss passes the Stage-1 guard against
    ``reference_loss`` (FP32 on the same batches from the same state), else
    ``fallback`` (the Stage-1 winner), with the reason logged.
    """
    if winner == fallback:
        return winner
    start = time.perf_counter()
    try:
        loss = float(check_loss(winner))
        passed = is_accepted(loss, reference_loss, threshold)
        reason = (f"loss {loss:.6g} vs FP32 {reference_loss:.6g} on the same batches: "
                  + ("passed" if passed else "failed; falling back to the Stage-1 winner"))
        status = "accepted" if passed else "rejected"
    except Exception as error:
        loss, passed, status = None, False, "error"
        reason = f"{type(error).__name__}: {error}; falling back to the Stage-1 winner"
    if report is not None:
        report(SampleRecord("check", winner, status, loss=loss, reason=reason,
                            duration=time.perf_counter() - start))
    return winner if passed else fallback
