"""Write benchmark rows as JSON plus a markdown table, with the paper's figures beside ours.

Results go under ``benchmarks/results/<device-name>/``: the GPU's name from
``torch.cuda.get_device_name``, or the CPU model from /proc/cpuinfo (or
``platform``), made file-name safe.

>>> slug("AMD EPYC 7B13 64-Core Processor")
'amd-epyc-7b13-64-core-processor'
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from tabulate import tabulate

from compfx.measure import hardware_name

from .models import get_spec
from .paper_figures import paper_figures

__all__ = ["device_name", "slug", "attach_paper_figures", "markdown_table", "comparison_table", "write_results",
           "plot_results"]

_MB = 1024 * 1024


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def device_name(device: torch.device) -> str:
    """Human name of the device the rows were measured on (:func:`compfx.measure.hardware_name`)."""
    return hardware_name(device)


def attach_paper_figures(row: dict) -> dict:
    """Add the paper's figures to a row whose (model, config) matches a row of the paper's tables."""
    paper_row = get_spec(row["model"]).paper_rows.get(row["config"])
    figures = paper_figures(*paper_row, row["mode"]) if paper_row else None
    return {**row, "paper": figures}


def _mb(value) -> float | None:
    return None if value is None else round(value / _MB, 3)


def _round(value, digits: int = 4):
    return None if value is None else round(value, digits)


def _percent(fraction) -> float | None:
    return None if fraction is None else round(100 * fraction, 2)


def _table_row(row: dict, fp32: dict) -> list:
    paper = row.get("paper") or {}
    mode = row["mode"] + ("+compile" if row.get("compiled") else "")
    return [
        row["model"], mode, row["status"] if row["status"] == "ok" else row["status"][:40],
        _round(row.get("time_per_epoch_s")), "" if row is fp32 else _time_vs_fp32(row, fp32),
        _mb(row.get("saved_activation_bytes")), _mb(row.get("peak_memory_bytes")),
        _round(row.get("final_train_loss")), _percent(row.get("metric")), _round(row.get("search_share"), 3),
        row.get("casts_forward"), row.get("casts_graph"),
        paper.get("time_a100_s"), paper.get("peak_memory_mb"), paper.get("accuracy_pct"),
    ]


_HEADERS = ["model", "mode", "status", "s/epoch", "time vs FP32", "saved act. MB", "GPU peak MB", "train loss",
            "metric %", "search share", "casts fwd", "casts graph", "paper s/epoch A100", "paper GPU MB",
            "paper acc. %"]


def _fp32_rows(rows: list[dict]) -> dict[tuple, dict]:
    """The ok FP32 row of each (model, config, eager/compiled): what the other modes' times are compared with."""
    return {(row["model"], row.get("config"), bool(row.get("compiled"))): row for row in rows
            if row["mode"] == "fp32" and row["status"] == "ok"}


def markdown_table(rows: list[dict]) -> str:
    """Every row; "time vs FP32" as in :func:`comparison_table`.

    >>> rows = [{"model": "m", "mode": "fp32", "status": "ok", "time_per_epoch_s": 2.0},
    ...         {"model": "m", "mode": "amp", "status": "ok", "time_per_epoch_s": 1.0,
    ...          "time_vs_fp32": {"median": 0.53, "low": 0.51, "high": 0.55}}]
    >>> [line.split("|")[5].strip() for line in markdown_table(rows).splitlines()[2:]]
    ['', '0.53x (0.51-0.55)']
    """
    fp32_rows = _fp32_rows(rows)
    lines = [_table_row(row, fp32_rows.get((row["model"], row.get("config"), bool(row.get("compiled"))), {}))
             for row in rows]
    return tabulate(lines, headers=_HEADERS, tablefmt="github", missingval="")


_COMPARED = ("fp32", "amp", "compfx")


def _ratio_to_fp32(value, fp32) -> str:
    return "" if value is None or not fp32 else f"{value / fp32:.2f}x"


def _time_vs_fp32(row: dict, fp32: dict) -> str:
    """``row``'s time as a multiple of FP32's: where the modes took turns, the median of its per-batch step ratios
    to FP32 and their 95% interval (``time_vs_fp32``); for rows without it, the ratio of the epoch times."""
    ratio = row.get("time_vs_fp32")
    if ratio:
        return _interval_text(ratio)
    return _ratio_to_fp32(row.get("time_per_epoch_s"), fp32.get("time_per_epoch_s"))


def _interval_text(ratio: dict) -> str:
    """A per-batch ratio (:func:`benchmarks.harness.step_ratio_interval`) as ``0.53x (0.51-0.55)``."""
    return f"{ratio['median']:.2f}x ({ratio['low']:.2f}-{ratio['high']:.2f})"


def _time_vs_amp(ours: dict, amp: dict) -> str:
    """compfx's time as a multiple of AMP's: the median of their per-batch step ratios with its 95% interval where
    both took turns in one run (``step_seconds``), else the ratio of their epoch times."""
    from .harness import step_ratio_interval

    if ours.get("step_seconds") and amp.get("step_seconds"):
        return _interval_text(step_ratio_interval(ours["step_seconds"], amp["step_seconds"]))
    return _ratio_to_fp32(ours.get("time_per_epoch_s"), amp.get("time_per_epoch_s"))


def _per_net(row: dict, key: str, fmt: str) -> str:
    """``key`` of each searched network's figures (``row["search"]``), formatted; "net: x" when there are several."""
    figures = {net: found[key] for net, found in (row.get("search") or {}).items() if found.get(key) is not None}
    if len(figures) == 1:
        return fmt.format(*figures.values())
    return ", ".join(f"{net}: {fmt.format(value)}" for net, value in figures.items())


def comparison_table(rows: list[dict]) -> str:
    """One line per model: compfx and AMP against FP32 (time, saved activations, metric, casts).

    Time: the median per-batch step ratio to FP32 (and compfx's to AMP's) with its 95% interval where the rows
    have their steps (the modes took turns), else the ratio of the epoch times.

    >>> rows = [{"model": "m", "mode": mode, "status": "ok", "time_per_epoch_s": t, "saved_activation_bytes": 2 ** 20,
    ...          "metric": 0.5, "casts_forward": c, "search_share": share,
    ...          "search": {"model": {"search_fp32_epochs": 3.04, "predictor_error_pct": 4.2}} if share else None}
    ...         for mode, t, c, share in (("fp32", 1.0, 0, None), ("amp", 2.0, 9, None), ("compfx", 1.1, 1, 0.25))]
    >>> [cell.strip() for cell in comparison_table(rows).splitlines()[2].split("|")[1:-1]]
    ['m', '1.0000 s', '2.00x', '1.10x', '0.55x', '1.000 MB', '1.00x', '1.00x', '50.0 / 50.0 / 50.0', '9 / 1', '25%', '3.0', '4.2%']
    >>> rows[2]["time_vs_fp32"] = {"median": 1.02, "low": 0.98, "high": 1.07}
    >>> comparison_table(rows).splitlines()[2].split("|")[4].strip()
    '1.02x (0.98-1.07)'
    """
    by_model: dict[str, dict[str, dict]] = {}
    for row in rows:
        if row["status"] == "ok" and not row.get("compiled") and row["mode"] in _COMPARED:
            by_model.setdefault(row["model"], {})[row["mode"]] = row
    lines = []
    for model, modes in by_model.items():
        fp32, amp, ours = (modes.get(mode, {}) for mode in _COMPARED)
        time0, memory0 = fp32.get("time_per_epoch_s"), fp32.get("saved_activation_bytes")
        metrics = " / ".join("" if m.get("metric") is None else f"{100 * m['metric']:.1f}" for m in (fp32, amp, ours))
        share = ours.get("search_share")
        lines.append([
            model, "" if time0 is None else f"{time0:.4f} s",
            _time_vs_fp32(amp, fp32), _time_vs_fp32(ours, fp32), _time_vs_amp(ours, amp),
            "" if memory0 is None else f"{memory0 / _MB:.3f} MB",
            _ratio_to_fp32(amp.get("saved_activation_bytes"), memory0),
            _ratio_to_fp32(ours.get("saved_activation_bytes"), memory0),
            metrics, f"{amp.get('casts_forward', '')} / {ours.get('casts_forward', '')}",
            "" if share is None else f"{100 * share:.0f}%",
            _per_net(ours, "search_fp32_epochs", "{:.1f}"), _per_net(ours, "predictor_error_pct", "{:.1f}%"),
        ])
    headers = ["model", "FP32 s/epoch", "AMP", "compfx", "compfx / AMP", "FP32 saved act.", "AMP", "compfx",
               "metric % FP32 / AMP / compfx", "casts AMP / compfx", "search share", "search (FP32 epochs)",
               "predictor error"]
    return tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True)


def _metric_notes(rows: list[dict]) -> str:
    seen = {}
    for row in rows:
        seen.setdefault(row["model"], (row.get("metric_name"), row.get("data")))
    return "\n".join(f"- {model}: metric = {metric}; data = {data}" for model, (metric, data) in seen.items())


def _clock_words(meta: dict) -> str:
    clock = (meta.get("options") or {}).get("clock", "wall")
    return "process CPU time (one thread; other jobs on the machine do not count)" if clock == "cpu" else "wall clock"


def _markdown(rows: list[dict], meta: dict) -> str:
    return "\n".join([
        f"# Benchmark: {meta['device_name']} ({meta['device']}), config {meta['config']}",
        "",
        f"torch {meta['torch']}; low dtype {meta['low_dtype']}; {meta['epochs']} epoch(s) of up to "
        f"{meta['batches']} batches; data: {meta['data']}; compfx: {meta['compfx']}; "
        f"{meta.get('threads', '?')} thread(s); times: {_clock_words(meta)}.",
        "",
        "s/epoch: median of epochs after the first (the only one if epochs=1). time vs FP32: the modes of a model "
        "take turns, one step each per batch; the median of a mode's per-batch step ratios to FP32's, over the same "
        "epochs, with its 95% interval. saved act. MB: bytes saved for "
        "backward in one step, measured with saved-tensor hooks, excluding the parameters' own storages. "
        "GPU peak MB: what the mode keeps on the GPU plus the most one of its steps allocated on top. "
        "metric: evaluated in FP32 eval mode on held-out batches with the weights each mode trained. "
        "casts fwd: dtype casts in one traced forward (make_fx under the mode's autocast). "
        "Paper columns: CoMP paper Tables 4-7 (GPU, real datasets, 100 epochs) for matching paper-config rows.",
        "AMP and compfx against FP32 (time and saved activations as multiples of FP32's; below 1x is better):",
        "",
        comparison_table(rows),
        "",
        "Every row:",
        "",
        markdown_table(rows),
        "",
        _metric_notes(rows),
        "",
    ])


def write_results(rows: list[dict], meta: dict, out_root: str | os.PathLike, stem: str) -> dict[str, Path]:
    """Write ``<out_root>/<device-slug>/<stem>.json`` and ``.md``; returns their paths.

    Rows are written as given: the caller attaches the paper's figures (:func:`attach_paper_figures`).
    """
    folder = Path(out_root) / slug(meta["device_name"])
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / f"{stem}.json", "markdown": folder / f"{stem}.md"}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    paths["markdown"].write_text(_markdown(rows, meta))
    return paths


def plot_results(rows: list[dict], path: str | os.PathLike) -> Path | None:
    """Bar charts of time per epoch and saved activation bytes per model and mode (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [row for row in rows if row["status"] == "ok"]
    labels = [f"{row['model']}\n{row['mode']}{'+c' if row.get('compiled') else ''}" for row in ok]
    figure, (time_axis, memory_axis) = plt.subplots(2, 1, figsize=(max(6, len(ok) * 0.6), 7), sharex=True)
    time_axis.bar(labels, [row["time_per_epoch_s"] for row in ok])
    time_axis.set_ylabel("s / epoch")
    memory_axis.bar(labels, [row["saved_activation_bytes"] / _MB for row in ok])
    memory_axis.set_ylabel("saved for backward (MB)")
    memory_axis.tick_params(axis="x", rotation=90, labelsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return Path(path)
