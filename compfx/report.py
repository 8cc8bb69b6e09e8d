"""The search report: which precision each op got, what the search cost, what the plan gains.

:class:`SearchSummary` is what :func:`compfx.optimize` learned; :func:`render_report`
turns it into text (``model.report()`` on the module ``optimize`` returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tabulate import tabulate

from .searchlog import SearchLog

__all__ = ["SearchSummary", "render_report", "op_table"]


@dataclass
class SearchSummary:
    """Everything the report shows; filled in by :func:`compfx.optimize`."""

    analysis: object  # compfx.Analysis
    plan: object  # compfx.Plan: the chosen plan
    stage1_plan: object  # compfx.Plan: the Stage-1 winner
    log: SearchLog
    stage1_mode: str
    loss0: float
    fp32_epoch_seconds: float  # wall time of the FP32 baseline epoch
    search_seconds: float  # wall time of the whole search
    step_seconds: dict[str, float] = field(default_factory=dict)  # "fp32" / "amp" / "chosen" -> median step

    @property
    def samples_run(self) -> int:
        return len([r for r in self.log.samples() if r.stage in ("stage1", "stage2")])

    @property
    def samples_pruned(self) -> int:
        return len([r for r in self.log.samples() if r.status == "pruned"])


def op_table(analysis, plan, stage1_plan=None, tablefmt: str = "simple") -> str:
    """Per-op table: key, category, Tensor Core eligibility, Stage-1 and chosen precision."""
    headers = ["#", "op key", "category", "TC", "chosen"]
    if stage1_plan is not None:
        headers.insert(4, "stage 1")
    rows = []
    for i, op in enumerate(analysis.ops):
        row = [i, str(op.key), op.category, "yes" if op.tc_eligible else "no", plan[op.key]]
        if stage1_plan is not None:
            row.insert(4, stage1_plan[op.key])
        rows.append(row)
    return tabulate(rows, headers=headers, tablefmt=tablefmt)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _ratio(chosen: float | None, other: float | None) -> str:
    """Speed-up of the chosen plan over ``other`` (below 1: the chosen plan is slower)."""
    return "n/a" if not chosen or not other else f"speed-up {other / chosen:.2f}x"


def render_report(summary: SearchSummary, tablefmt: str = "simple") -> str:
    """The report as text: the per-op table, then the search and the timing summary."""
    a, log = summary.analysis, summary.log
    records = log.samples()
    by_stage = {s: [r for r in records if r.stage == s] for s in ("stage1", "stage2", "check")}
    counts = {s: sum(r.status == s for r in by_stage["stage1"]) for s in ("accepted", "rejected", "pruned", "error")}
    steps = summary.step_seconds
    chosen = steps.get("chosen")
    share = summary.search_seconds / summary.fp32_epoch_seconds if summary.fp32_epoch_seconds else float("nan")
    lines = [
        op_table(a, summary.plan, summary.stage1_plan, tablefmt),
        "",
        f"chosen plan    {summary.plan.bitstring(a)}   ('0' {str(a.low_dtype).replace('torch.', '')}, "
        "'1' fp32, 'f' follow)",
        f"stage 1        {len(by_stage['stage1'])} samples ({summary.stage1_mode}): {counts['accepted']} accepted, "
        f"{counts['rejected']} rejected, {counts['pruned']} pruned, {counts['error']} failed; "
        f"loss_0 {summary.loss0:.4g}; winner {summary.stage1_plan.bitstring(a)}",
        f"stage 2        {len(by_stage['stage2'])} candidates timed"
        + (f"; loss check {by_stage['check'][-1].status}" if by_stage["check"] else ""),
        f"search time    {summary.search_seconds:.2f} s = {share:.1f} FP32 epochs of the sample loader "
        f"({summary.samples_run} samples run, {summary.samples_pruned} pruned)",
        f"step time      chosen {_ms(chosen)}; FP32 {_ms(steps.get('fp32'))} ({_ratio(chosen, steps.get('fp32'))}); "
        f"AMP {_ms(steps.get('amp'))} ({_ratio(chosen, steps.get('amp'))})  [median, same batches]",
    ]
    notes = [r.reason for r in log.notes()]
    if notes:
        lines += ["", "notes:", *(f"  - {n}" for n in notes)]
    return "\n".join(lines)

