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
import platform
import re
from pathlib import Path

import torch
from tabulate import tabulate

from .models import get_spec
from .paper_figures import paper_figures

__all__ = ["device_name", "slug", "attach_paper_figures", "markdown_table", "write_results", "plot_results"]

_MB = 1024 * 1024


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    """Human name of the device the rows were measured on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model()


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


def _table_row(row: dict) -> list:
    paper = row.get("paper") or {}
    mode = row["mode"] + ("+compile" if row.get("compiled") else "")
    return [
        row["model"], mode, row["status"] if row["status"] == "ok" else row["status"][:40],
        _round(row.get("time_per_epoch_s")), _mb(row.get("saved_activation_bytes")), _mb(row.get("peak_memory_bytes")),
        _round(row.get("final_train_loss")), _percent(row.get("metric")), _round(row.get("search_share"), 3),
        row.get("casts_forward"), row.get("casts_graph"),
        paper.get("time_a100_s"), paper.get("peak_memory_mb"), paper.get("accuracy_pct"),
    ]


_HEADERS = ["model", "mode", "status", "s/epoch", "saved act. MB", "GPU peak MB", "train loss", "metric %",
            "search share", "casts fwd", "casts graph", "paper s/epoch A100", "paper GPU MB", "paper acc. %"]


def markdown_table(rows: list[dict]) -> str:
    return tabulate([_table_row(row) for row in rows], headers=_HEADERS, tablefmt="github", missingval="")


def _metric_notes(rows: list[dict]) -> str:
    seen = {}
    for row in rows:
        seen.setdefault(row["model"], (row.get("metric_name"), row.get("data")))
    return "\n".join(f"- {model}: metric = {metric}; data = {data}" for model, (metric, data) in seen.items())


def _markdown(rows: list[dict], meta: dict) -> str:
    return "\n".join([
        f"# Benchmark: {meta['device_name']} ({meta['device']}), config {meta['config']}",
        "",
        f"torch {meta['torch']}; low dtype {meta['low_dtype']}; {meta['epochs']} epoch(s) of up to "
        f"{meta['batches']} batches; data: {meta['data']}; compfx: {meta['compfx']}.",
        "",
        "s/epoch: median of epochs after the first (the only one if epochs=1). saved act. MB: bytes saved for "
        "backward in one step, measured with saved-tensor hooks, excluding the parameters' own storages. "
        "metric: evaluated in FP32 eval mode on held-out batches with the weights each mode trained. "
        "casts fwd: dtype casts in one traced forward (make_fx under the mode's autocast). "
        "Paper columns: CoMP paper Tables 4-7 (GPU, real datasets, 100 epochs) for matching paper-config rows.",
        "",
        markdown_table(rows),
        "",
        _metric_notes(rows),
        "",
    ])


def write_results(rows: list[dict], meta: dict, out_root: str | os.PathLike, stem: str) -> dict[str, Path]:
    """Write ``<out_root>/<device-slug>/<stem>.json`` and ``.md``; returns their paths."""
    folder = Path(out_root) / slug(meta["device_name"])
    folder.mkdir(parents=True, exist_ok=True)
    rows = [attach_paper_figures(row) for row in rows]  # idempotent: main() has usually attached them
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
