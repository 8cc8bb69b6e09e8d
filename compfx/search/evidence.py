"""Why each op got its precision, read from the search log: the report's evidence column.

The log holds every sample (its plan, loss, per-batch seconds, why it was
pruned or skipped), every duel of the decision rule and every note. For each
op, :func:`op_evidence` finds the samples that tried the op at another
precision than the chosen one and says, in one line, what they showed:

* ``fp32: with this op low, epoch loss 2.31 > limit 2.29 (sample 7)``: the
  convergence guard rejected it;
* ``low: 0.40 ms/step faster than with it fp32 (sample 5)``: what keeping it
  low saved, batch for batch on the same batches;
* ``low: with it fp32, 0.02 ms/step faster, not by more than 3% (sample 5)``:
  a tie, which keeps the incumbent;
* ``low: Tensor Cores (fixed low)``, ``follow: not adjustable (other)``,
  ``fp32: pinned by the model's autocast(enabled=False) block (not searched)``;
* for an "other" op Stage 2 set: ``low: Stage 2, 0.12 ms/step faster than
  follow (sample 20; duel 0.95 (0.93-0.97))``.

``sample N`` is the N-th sample of the log (``log.samples()[N - 1]``), so every
figure can be checked against its record; the same text renders from a log
alone (``compfx report LOG``).
"""

from __future__ import annotations

import statistics
from typing import Sequence

from ..vocabulary import Category, Precision, SampleStatus, Stage
from .convergence import loss_limit
from .log import BATCHES, DUEL, HEADER, INCUMBENT_AGAIN, NOTHING_CAN_WIN, PRUNED_AT, STOPPED_EARLY, SearchLog

__all__ = ["op_evidence", "sample_numbers", "batch_seconds"]

_CODE_NAME = {p.code: str(p) for p in Precision}


def sample_numbers(log: SearchLog) -> dict[int, int]:
    """``id(record) -> N`` for every sample of the log, N counting from 1 in log order."""
    return {id(record): n for n, record in enumerate(log.samples(), 1)}


def batch_seconds(record) -> list[float]:
    """The per-batch seconds a Stage-1 record holds (empty when it holds none)."""
    return [float(seconds) for _, seconds in record.extra.get(BATCHES, [])]


def _settings(log: SearchLog) -> dict:
    first = log.records[0] if log.records else None
    return dict(first.extra.get(HEADER, {})) if first is not None else {}


def _step_ms(record) -> float | None:
    """A record's step time in ms: a Stage-1 epoch's median batch, a Stage-2 timing's median step."""
    if record.stage == Stage.STAGE1:
        seconds = batch_seconds(record)
        return statistics.median(seconds) * 1e3 if seconds else None
    return record.seconds * 1e3 if record.seconds else None


def _paired_ms(slower, faster) -> float | None:
    """Median per-batch difference ``slower - faster`` in ms over the batches both Stage-1 records ran."""
    a, b = batch_seconds(slower), batch_seconds(faster)
    pairs = list(zip(a, b))
    if not pairs:
        return None
    return statistics.median(x - y for x, y in pairs) * 1e3


def _difference(other, winner) -> float | None:
    """How much slower ``other`` ran than ``winner``, ms per step (negative: faster)."""
    if other.stage == Stage.STAGE1 and winner.stage == Stage.STAGE1:
        return _paired_ms(other, winner)
    mine, theirs = _step_ms(other), _step_ms(winner)
    return None if mine is None or theirs is None else mine - theirs


class _Log:
    """The log, indexed for the evidence: samples by stage and plan, duels by candidate, numbers."""

    def __init__(self, log: SearchLog, loss0: float):
        self.log = log
        self.numbers = sample_numbers(log)
        self.settings = _settings(log)
        self.threshold = float(self.settings.get("threshold", 1.01))
        self.margin = float(self.settings.get("margin", 0.0))
        self.limit = loss_limit(loss0, self.threshold)
        stage1 = log.samples(Stage.STAGE1)
        # the incumbent's epochs run again beside a candidate's are not samples of a plan of their own; they are
        # the same-phase side of that candidate's pairs: (incumbent, candidate) -> the incumbent's record
        self.stage1 = [r for r in stage1 if INCUMBENT_AGAIN not in r.extra]
        self.beside = {(r.plan, r.extra[INCUMBENT_AGAIN]): r for r in stage1 if INCUMBENT_AGAIN in r.extra}
        self.stage2 = [r for r in log.samples(Stage.STAGE2)]
        self.duels = {}
        for note in log.notes():
            duel = note.extra.get(DUEL)
            if duel:
                self.duels[(duel["incumbent"], duel["candidate"])] = duel
        self.stopped = any(NOTHING_CAN_WIN in n.extra for n in log.notes() if n.stage == Stage.STAGE1)
        self.twins = {n.extra["plan"]: n.extra["same_as"] for n in log.notes() if "same_as" in n.extra}

    def number(self, record) -> str:
        return f"sample {self.numbers[id(record)]}"

    def find(self, records: Sequence, plan: str):
        """The last record of ``plan`` (a Stage-1 plan may be sampled twice: AMP's, after a duel)."""
        found = [r for r in records if r.plan == plan]
        return found[-1] if found else None

    def difference(self, other, winner) -> float | None:
        """How much slower ``other`` ran than ``winner``, ms per step (negative: faster): on the batches of
        ``winner``'s epoch that took turns with ``other``'s, where they did (the same phase), else on its own."""
        return _difference(other, self.beside.get((winner.plan, other.plan), winner))

    def duel_of(self, candidate: str):
        """The last duel ``candidate`` fought, or None."""
        found = [d for (inc, cand), d in self.duels.items() if cand == candidate]
        return found[-1] if found else None


def _duel_words(duel) -> str:
    low, high = duel["interval"]
    return f"duel {duel['median_ratio']:.3f} ({low:.3f}-{high:.3f})"


def _alternative(log: _Log, chosen: str, i: int, other: str, positions: Sequence[int]):
    """The Stage-1 record that tried op ``i`` at ``other`` closest to ``chosen`` (the flip of op ``i`` first)."""
    flip = chosen[:i] + other + chosen[i + 1:]
    exact = log.find(log.stage1, flip)
    if exact is not None:
        return exact
    tried = [r for r in log.stage1 if len(r.plan) == len(chosen) and r.plan[i] == other]
    if not tried:
        return None
    return min(tried, key=lambda r: sum(r.plan[j] != chosen[j] for j in positions))


def _stage1_reason(log: _Log, chosen: str, winner, i: int, record, other: str, positions: Sequence[int]) -> str:
    """What ``record`` (op ``i`` at ``other``) showed, from the chosen precision's side."""
    me = _CODE_NAME[chosen[i]]
    alt = _CODE_NAME[other]
    where = log.number(record) if record.plan == chosen[:i] + other + chosen[i + 1:] else \
        f"plan {record.plan}, {log.number(record)}"
    margin = f"{log.margin:.0%}"
    status = record.status
    if status == SampleStatus.REJECTED and record.loss is not None and "memory_budget" not in record.reason:
        return f"{me}: with this op {alt}, epoch loss {record.loss:.4g} > limit {log.limit:.4g} ({where})"
    if status == SampleStatus.REJECTED:
        return f"{me}: with this op {alt}, {record.reason} ({where})"
    if status == SampleStatus.ERROR:
        return f"{me}: with this op {alt}, the plan failed: {record.reason[:80]} ({where})"
    if status == SampleStatus.SKIPPED:
        return f"{me}: with this op {alt}, {record.reason} ({where})"
    if status == SampleStatus.PRUNED and PRUNED_AT not in record.extra and not record.extra.get(STOPPED_EARLY):
        return f"{me}: with this op {alt}, the loss became {record.loss} ({where})"
    slower = log.difference(record, winner) if winner is not None else None
    if status == SampleStatus.PRUNED:
        how = "stopped early on pace" if record.extra.get(STOPPED_EARLY) else "pruned"
        if slower is not None and slower > 0:
            return (f"{me}: {slower:.2f} ms/step faster than with it {alt} (that plan {how} after {record.batches} "
                    f"batches, {where})")
        return f"{me}: with this op {alt}, {how}: it could not beat the incumbent by more than {margin} ({where})"
    duel = log.duel_of(record.plan)
    fought = f"; {_duel_words(duel)}" if duel is not None else ""
    if slower is None:
        return f"{me}: with this op {alt}, accepted but not faster by more than {margin} ({where}{fought})"
    if slower > 0:
        return f"{me}: {slower:.2f} ms/step faster than with it {alt} ({where}{fought})"
    return f"{me}: with this op {alt}, {-slower:.2f} ms/step faster, not by more than {margin} ({where}{fought})"


def _stage2_reason(log: _Log, chosen: str, stage1: str, i: int) -> str:
    me = _CODE_NAME[chosen[i]]
    tried = [r for r in log.stage2 if len(r.plan) == len(chosen) and r.plan[i] != stage1[i]]
    if chosen[i] == stage1[i]:  # Stage 2 kept follow
        if not tried:
            return f"{me}: not adjustable (other)"
        timed = [r for r in tried if r.status == SampleStatus.ACCEPTED and r.seconds]
        base = log.find(log.stage2, chosen) or log.find(log.stage2, stage1)
        if not timed or base is None or not base.seconds:
            return f"{me}: Stage 2 tried it otherwise ({log.number(tried[0])}); no faster plan"
        best = min(timed, key=lambda r: r.seconds)
        gain = (base.seconds - best.seconds) * 1e3
        duel = log.duel_of(best.plan)
        fought = f"; {_duel_words(duel)}" if duel is not None else ""
        if gain > 0:
            return (f"{me}: Stage 2's fastest other plan ({best.plan}) was {gain:.2f} ms/step faster, not by more "
                    f"than {log.margin:.0%} ({log.number(best)}{fought})")
        return f"{me}: Stage 2 tried it otherwise; none faster ({log.number(best)}{fought})"
    final = log.find(log.stage2, chosen)
    base = log.find(log.stage2, stage1)
    if final is None or base is None or not final.seconds or not base.seconds:
        return f"{me}: Stage 2 chose it"
    duel = log.duel_of(chosen)
    fought = f"; {_duel_words(duel)}" if duel is not None else ""
    return (f"{me}: Stage 2, {(base.seconds - final.seconds) * 1e3:.2f} ms/step faster than follow "
            f"({log.number(final)}{fought})")


def op_evidence(analysis, log: SearchLog, chosen: str, stage1: str, loss0: float) -> list[str]:
    """One line per op of ``analysis`` (``chosen``, ``stage1``: the plans' CoMP strings): why it has its precision."""
    indexed = _Log(log, loss0)
    winner = indexed.find(indexed.stage1, stage1)
    positions = [i for i, op in enumerate(analysis.ops) if op.category is not Category.OTHER]
    lines = []
    for i, op in enumerate(analysis.ops):
        if getattr(op, "pinned", False) and not indexed.settings.get("search_pinned", False):
            lines.append(f"{_CODE_NAME[chosen[i]]}: pinned by the model's autocast(enabled=False) block (not searched)")
            continue
        if op.category is Category.OTHER:
            lines.append(_stage2_reason(indexed, chosen, stage1, i))
            continue
        fp8_tried = any(len(r.plan) == len(chosen) and r.plan[i] == Precision.FP8.code for r in indexed.stage1)
        if op.category is Category.WHITELIST and op.tc_eligible and chosen[i] == Precision.LOW.code and not fp8_tried:
            lines.append("low: Tensor Cores (fixed low, as CoMP)")
            continue
        others = sorted({r.plan[i] for r in indexed.stage1 if len(r.plan) == len(chosen)} - {chosen[i]})
        if not others:
            why = ("not tried otherwise: the profiles showed no plan could beat the incumbent" if indexed.stopped
                   else "not tried otherwise")
            lines.append(f"{_CODE_NAME[chosen[i]]}: {why}")
            continue
        reasons = []
        for other in others:
            record = _alternative(indexed, chosen, i, other, positions)
            reasons.append(_stage1_reason(indexed, chosen, winner, i, record, other, positions))
        lines.append("; ".join(reasons))
    return lines
