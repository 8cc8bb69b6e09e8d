"""The search report: which precision each op got, what the search cost, what the plan gains.

:func:`render_report` turns a :class:`~compfx.search.SearchResult` into text
(``result.report()``); it reads the result it is given (its analysis, plans,
log and timings) and imports nothing that makes one. :mod:`compfx.report`
renders the same report from a finished search's log (``compfx report LOG``).
"""

from __future__ import annotations

import statistics

from tabulate import tabulate

from ..analysis import category_label
from ..costmodel.predictor import MEASURED_STEP as _MEASURED, PREDICTED_STEP as _PREDICTED, STALE_PROFILES as _STALE
from ..costmodel.predictor import EVIDENCE_SCALE as _EVIDENCE, PREDICTION_SCALE as _SCALE
from ..costmodel.predictor import STALE_CONDITIONS as _STALE_N, STALE_CONDITIONS_REASON as _STALE_WHY
from ..vocabulary import Precision, SampleStatus, Stage, dtype_name
from .evidence import op_evidence
from .log import DUEL, HEADER, INCUMBENT_AGAIN, NOTHING_CAN_WIN, RESULT, SEGMENT_NOT_ENUMERATED, STOPPED_EARLY, SearchLog

__all__ = ["render_report", "op_table", "prediction_table", "prediction_error", "predicted_records"]


def predicted_records(log: SearchLog) -> list:
    """Measured samples with a prediction, except the FP32 baseline the predictor was calibrated on."""
    return [r for r in log.samples() if _PREDICTED in r.extra and _MEASURED in r.extra
            and not r.extra.get("calibration")]


def prediction_error(log: SearchLog) -> float | None:
    """Median absolute percentage error of predicted against measured step time (None: nothing to compare).

    >>> from compfx.search.log import SampleRecord
    >>> log = SearchLog()
    >>> for p in (1.1, 0.9, 2.0):
    ...     log.append(SampleRecord(Stage.STAGE1, "0", SampleStatus.ACCEPTED,
    ...                             extra={_PREDICTED: p, _MEASURED: 1.0 if p < 2 else 2.0}))
    >>> round(prediction_error(log), 6)
    10.0
    """
    records = predicted_records(log)
    if not records:
        return None
    return statistics.median(abs(r.extra[_PREDICTED] - r.extra[_MEASURED]) / r.extra[_MEASURED] * 100
                             for r in records)


def prediction_table(log: SearchLog, tablefmt: str = "simple") -> str:
    """Predicted against measured step time for every measured candidate (Stage 1 per batch, Stage 2 median)."""
    rows = [[r.stage, r.plan, r.status, _ms(r.extra[_PREDICTED]), _ms(r.extra[_MEASURED]),
             f"{(r.extra[_PREDICTED] / r.extra[_MEASURED] - 1) * 100:+.1f}%"] for r in predicted_records(log)]
    return tabulate(rows, headers=["stage", "plan", "status", "predicted step", "measured step", "error"],
                    tablefmt=tablefmt)


def op_table(analysis, plan, stage1_plan=None, tablefmt: str = "simple", evidence=None) -> str:
    """Per-op table: key, category, Tensor Core eligibility, Stage-1 and chosen precision, and why.

    An op the model pins to FP32 (its ``autocast(enabled=False)`` blocks) shows ``pinned`` beside its category.

    With FP8 analysed, an "FP8" column says whether each op can run it; an op at
    FP8 shows its recipe (``fp8 tensorwise``). When some op could be padded to
    the Tensor Core multiple, a "pad" column says "padded" (the plan pads it)
    or "can" (``pad_eligible``, left unpadded). ``evidence`` (one line per op,
    :func:`compfx.search.evidence.op_evidence`) fills the "why" column.
    """
    headers = ["#", "op key", "category", "TC", "chosen"]
    if stage1_plan is not None:
        headers.insert(4, "stage 1")
    padding = bool(plan.padded) or any(getattr(op, "pad_eligible", False) for op in analysis.ops)
    rows = []
    for i, op in enumerate(analysis.ops):
        row = [i, str(op.key), category_label(op), "yes" if op.tc_eligible else "no", _precision(plan, op.key)]
        if stage1_plan is not None:
            row.insert(4, _precision(stage1_plan, op.key))
        if analysis.fp8:
            row.insert(4, "yes" if op.fp8_eligible else "no")
        if padding:
            row.append("padded" if op.key in plan.padded else "can" if getattr(op, "pad_eligible", False) else "")
        if evidence is not None:
            row.append(evidence[i])
        rows.append(row)
    if analysis.fp8:
        headers.insert(4, "FP8")
    if padding:
        headers.append("pad")
    if evidence is not None:
        headers.append("why (sample N: the log's N-th sample)")
    return tabulate(rows, headers=headers, tablefmt=tablefmt)


def _precision(plan, key) -> str:
    """An op's precision for the table; FP8 with its recipe."""
    precision = plan[key]
    return f"{precision} {plan.fp8_recipe}" if precision is Precision.FP8 else str(precision)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _evidence_scaling(log: SearchLog) -> str:
    """The scalings of the predictions that the samples' and duels' evidence demanded ("" when none did)."""
    scalings = [r.extra[_EVIDENCE] for r in log.records if _EVIDENCE in r.extra]
    if not scalings:
        return ""
    return (f"; plans measured slower against their references than predicted, in {len(scalings)} of the samples "
            f"and duels, scaled the predicted differences down to {scalings[-1]['scale']:.0%}")


def _stale_profiles(log: SearchLog) -> str:
    """A sentence when cached profiles disagreed with the measured FP32 step and were measured again."""
    ratio = next((r.extra[_STALE] for r in log.samples() if _STALE in r.extra), None)
    stale = next((r.extra for r in log.samples() if _STALE_N in r.extra), None)
    text = "" if stale is None else (f"; {stale[_STALE_N]} cached profiles were measured again: "
                                     f"{stale.get(_STALE_WHY, 'other conditions')}")
    return text + ("" if ratio is None else (f"; the cached profiles summed to {ratio:.2f}x the measured FP32 step, "
                                             "so they were measured again"))


def _cost_breakdown(summary) -> list[str]:
    """The search time by part (capture, profiling, rewrites, samples, ...), each in FP32 epochs too."""
    parts = getattr(summary, "cost_breakdown", None)
    if not parts:
        return []
    epoch = summary.fp32_epoch_seconds or float("nan")
    text = ", ".join(f"{name} {seconds:.2f} s ({seconds / epoch:.1f})" for name, seconds in parts.items())
    return [f"  by part      {text}  [s (FP32 epochs)]"]


def _stopped_early(records) -> str:
    """`` (n stopped early on pace)`` when the guided search stopped any sample before exact pruning could."""
    n = sum(bool(r.extra.get(STOPPED_EARLY)) for r in records)
    return f" ({n} stopped early on pace)" if n else ""


def _mb(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e6:.3g} MB"


_LABELS = {"chosen": "chosen", "fp32": "FP32", "amp": "AMP"}


def _step_lines(summary) -> list[str]:
    """The step comparison: medians with their intervals, the chosen plan's speed-up over FP32 and AMP, memory."""
    comparison = getattr(summary, "step_comparison", None)
    if comparison is None:  # a log from before one interleaved comparison: its medians only
        steps = summary.step_seconds
        return [f"step time      chosen {_ms(steps.get('chosen'))}; FP32 {_ms(steps.get('fp32'))}; AMP "
                f"{_ms(steps.get('amp'))}  [medians, timed in different phases: not comparable]"]
    parts = []
    for name in ("chosen", "fp32", "amp"):
        spread = comparison.spread(name)
        if spread is None:
            parts.append(f"{_LABELS[name]} not timed (it failed)")
            continue
        text = f"{_LABELS[name]} {_ms(comparison.median(name))} ({spread[0] * 1e3:.2f}-{spread[1] * 1e3:.2f})"
        if name != "chosen":
            speedup = comparison.speedup(name)
            text += f", chosen vs {_LABELS[name]}: {speedup}" if speedup else ""
        parts.append(text)
    rounds = max(len(v) for v in comparison.seconds.values()) if comparison.seconds else 0
    lines = [f"step time      {'; '.join(parts)}",
             f"               [medians of {rounds} rounds, the plans taking turns on the same batches "
             f"{comparison.phase}, warm; {comparison.coverage:.0%} intervals]"]
    saved = comparison.saved_bytes or {}
    if saved:
        memory = "; ".join(f"{_LABELS[name]} {_mb(saved.get(name))}" for name in ("chosen", "fp32", "amp"))
        lines.append(f"memory         activations saved for backward: {memory}  [one forward on the first batch]")
    return lines


def _stopped(log: SearchLog, stage: Stage) -> str:
    """``; stopped early: ...`` when ``stage`` stopped because the profiles showed no plan left could win."""
    found = [r for r in log.notes() if NOTHING_CAN_WIN in r.extra and r.stage == stage]
    if not found:
        return ""
    left = sum(r.extra[NOTHING_CAN_WIN] for r in found)
    return f"; stopped early: the profiles showed none of the {left} plans left could beat the incumbent by the margin"


def _not_enumerated(log: SearchLog) -> str:
    """``; not enumerated fully: ...`` naming the Stage-2 segments whose ``2**n`` plans did not fit the budget."""
    found = [r.extra[SEGMENT_NOT_ENUMERATED] for r in log.notes() if SEGMENT_NOT_ENUMERATED in r.extra]
    if not found:
        return ""
    parts = ", ".join(f"({s['segment'][0]}, {s['segment'][1]}) {s['tried']} of 2^{s['ops']} plans" for s in found)
    return (f"; {len(found)} segment{'s' if len(found) != 1 else ''} not enumerated fully (stage2_budget): {parts} "
            "tried")


def _duels(log: SearchLog, stage: Stage) -> str:
    duels = [r.extra[DUEL] for r in log.notes() if DUEL in r.extra and r.stage == stage]
    if not duels:
        return ""
    won = sum(bool(d["replaces"]) for d in duels)
    noisy = sum(bool(d.get("too_noisy")) for d in duels)
    return (f"; {len(duels)} duel{'s' if len(duels) != 1 else ''} with the incumbent, {won} won"
            + (f", {noisy} too noisy to decide (incumbent kept)" if noisy else ""))


def _noise_lines(log: SearchLog) -> list[str]:
    """What the report says when duels were too noisy to decide: the plans' speeds were not measured."""
    noisy = [r.extra[DUEL] for r in log.notes() if DUEL in r.extra and r.extra[DUEL].get("too_noisy")]
    if not noisy:
        return []
    return [f"noise          {len(noisy)} duel(s) found the machine too noisy to decide ({noisy[0]['too_noisy']}): "
            "a candidate looked faster, but the pairs were not fair, so the incumbent was kept. Other work on the "
            "machine slowed one plan's steps far more than the other's; search again on a quieter machine (or "
            "with fewer threads than cores) to measure them."]


def _fixed_cost(summary) -> list[str]:
    parts = getattr(summary, "cost_breakdown", None)
    if not parts:
        return []
    epoch = summary.fp32_epoch_seconds or float("nan")
    samples = parts.get("samples", 0.0)
    fixed = summary.search_seconds - samples
    return [f"  fixed part   {fixed:.2f} s ({fixed / epoch:.1f} FP32 epochs): everything but the samples "
            f"({samples:.2f} s, {samples / epoch:.1f})"]


def render_report(summary, tablefmt: str = "simple") -> str:
    """The report of a :class:`~compfx.search.SearchResult`: the per-op table, the search, the timing summary."""
    a, log = summary.analysis, summary.log
    by_stage = {stage: log.samples(stage) for stage in (Stage.STAGE1, Stage.STAGE2, Stage.CHECK)}
    again = [r for r in by_stage[Stage.STAGE1] if INCUMBENT_AGAIN in r.extra]  # not samples of a plan of their own
    by_stage[Stage.STAGE1] = [r for r in by_stage[Stage.STAGE1] if INCUMBENT_AGAIN not in r.extra]
    counts = {status: sum(r.status is status for r in by_stage[Stage.STAGE1]) for status in SampleStatus}
    share = summary.search_seconds / summary.fp32_epoch_seconds if summary.fp32_epoch_seconds else float("nan")
    chosen, stage1 = summary.plan.bitstring(a), summary.stage1_plan.bitstring(a)
    evidence = op_evidence(a, log, chosen, stage1, summary.loss0)
    settings = log.records[0].extra.get(HEADER, {}) if log.records else {}
    lines = [
        op_table(a, summary.plan, summary.stage1_plan, tablefmt, evidence=evidence),
        "",
        f"chosen plan    {chosen}   ('0' {dtype_name(a.low_dtype)}, '1' fp32, 'f' follow"
        + (f", '8' fp8 {summary.plan.fp8_recipe}" if summary.plan.fp8_recipe else "") + ")",
        f"decision rule  a plan replaces the incumbent (first AMP's, then FP32's) only when faster by more than "
        f"{float(settings.get('margin', 0.0)):.0%} at {float(settings.get('confidence', 0.95)):.0%} confidence "
        f"({settings.get('rounds', 0)} interleaved pairs), or as fast and saving less memory",
        f"stage 1        {len(by_stage[Stage.STAGE1])} samples ({summary.stage1_mode}): "
        f"{counts[SampleStatus.ACCEPTED]} accepted, {counts[SampleStatus.REJECTED]} rejected, "
        f"{counts[SampleStatus.PRUNED]} pruned{_stopped_early(by_stage[Stage.STAGE1])}, "
        f"{counts[SampleStatus.SKIPPED]} skipped, {counts[SampleStatus.ERROR]} failed; "
        f"loss_0 {summary.loss0:.4g}; winner {stage1}{_duels(log, Stage.STAGE1)}{_stopped(log, Stage.STAGE1)}"
        + (f"; the incumbent's epoch ran {len(again)} more time(s), for candidates to be compared with" if again
           else ""),
        f"stage 2        {len(by_stage[Stage.STAGE2])} candidates timed{_duels(log, Stage.STAGE2)}"
        + (f"; loss check {by_stage[Stage.CHECK][-1].status}" if by_stage[Stage.CHECK] else "")
        + _stopped(log, Stage.STAGE2) + _not_enumerated(log),
        f"search time    {summary.search_seconds:.2f} s = {share:.1f} FP32 epochs of the sample loader "
        f"({summary.samples_run} samples: {summary.samples_pruned} pruned, {summary.samples_skipped} skipped "
        "on prediction)",
        *_noise_lines(log),
        *_fixed_cost(summary),
        *_cost_breakdown(summary),
        *_step_lines(summary),
    ]
    eligible = sum(bool(getattr(op, "pad_eligible", False)) for op in a.ops)
    if eligible or summary.plan.padded:
        lines.append(f"padding        {len(summary.plan.padded)} of {eligible} op(s) that miss the Tensor Core "
                     "rule padded (kept only where the measured step is faster; see the notes)")
    if getattr(summary, "plan_cache", ""):
        lines.append(f"plan cache     {summary.plan_cache}")
    error = prediction_error(log)
    calibrations = [r for r in log.samples() if r.extra.get("calibration")]
    if calibrations:  # the cost model was on
        scale = next((r.extra[_SCALE] for r in calibrations if _SCALE in r.extra), None)
        accuracy = ("no other measured candidate was priced" if error is None else
                    f"median absolute error {error:.1f}% over {len(predicted_records(log))} measured candidates")
        lines += ["", f"cost model     {summary.samples_skipped} plans skipped on prediction; {accuracy} (FP32's and "
                  "AMP's plans excluded: they calibrate it)"
                  + ("" if scale is None or scale == 1.0 else
                     f"; AMP's measured step bore out {scale:.0%} of the predicted difference from FP32, and "
                     "predictions were scaled so")
                  + _evidence_scaling(log) + _stale_profiles(log)]
        if error is not None:
            lines.append(prediction_table(log, tablefmt))
    notes = [r.reason for r in log.notes()  # the plan cache has a line of its own above; the result is the report
             if not r.reason.startswith("plan cache: ") and RESULT not in r.extra and DUEL not in r.extra]
    if notes:
        lines += ["", "notes:", *(f"  - {n}" for n in notes)]
    return "\n".join(lines)
