"""The paper's VGG16-CIFAR and ResNet on this machine, the modes taking turns: FP32, AMP and compfx's plan.

``benchmarks.run`` trains each mode for one epoch, one after the other: an epoch's time there has no interval,
and drift between the modes (compfx's epoch always comes last, after its search) reads as a difference between
them. Here, per model (the paper's config, batch 128, synthetic data, the machine's threads): compfx searches
(``compfx.optimize`` on the epoch's batches, as ``benchmarks.run`` does), then, on a fresh copy of the model,
FP32 (eager), AMP (eager under ``torch.autocast``) and compfx's chosen plan (``compfx.apply``) take turns, one
training step each per round on the same batch (:func:`benchmarks.decisions.independent_steps`: timed with
``time.perf_counter`` around forward, loss, backward and optimizer step, the order rotating each round). Reported:
each mode's median step, and the per-round ratios compfx / AMP, compfx / FP32 and AMP / FP32 with their median
and 95% interval (:func:`compfx.measure.median_interval`).

Run from the repository root::

    python -m benchmarks.paper_interleaved                       # vgg16_cifar and resnet, 12 rounds
    python -m benchmarks.paper_interleaved --models resnet --rounds 20
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn

import compfx
from compfx.files import write_json_atomic
from compfx.measure import device_name, median_interval

from .decisions import independent_steps
from .harness import RunOptions, load_batches
from .models import get_spec

__all__ = ["run_model", "markdown", "main"]

ROOT = Path(__file__).resolve().parent.parent
#: the ratios reported, as (numerator, denominator) of the modes' per-round steps
RATIOS = (("compfx", "amp"), ("compfx", "fp32"), ("amp", "fp32"))


class Autocast(nn.Module):
    """``module`` under ``torch.autocast`` at ``dtype``, its output in FP32 for the loss (as autocast runs it)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args):
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.module(*args)
        return out.float()


def _ratio(steps: dict, top: str, bottom: str) -> dict:
    ratios = [a / b for a, b in zip(steps[top], steps[bottom])]
    low, high, coverage = median_interval(ratios, 0.95)
    return {"median": statistics.median(ratios), "low": low, "high": high, "coverage": coverage}


def run_model(name: str, rounds: int = 12, seed: int = 0) -> dict:
    """Search ``name`` at the paper's config, then time FP32, AMP and the chosen plan taking turns."""
    spec = get_spec(name)
    config = spec.config("paper")
    device = torch.device("cpu")
    torch.manual_seed(seed)
    model = spec.build(config)
    fresh = copy.deepcopy(model)  # the timing trains from the initial weights
    options = RunOptions(device="cpu", low_dtype="auto", epochs=1, batches=10, data="synthetic", compile=False,
                         seed=seed, count_casts=False, search={}, clock="wall", threads=None)
    batches = load_batches(spec, config, options, "train", device)
    nets, optimizers = spec.make_nets(model), spec.make_optimizers(model, config)
    (target,) = spec.search_targets(spec, nets, optimizers, batches)
    result = compfx.optimize(nets[target.net], target.batches, loss_fn=target.loss_fn,
                             optimizer=optimizers[target.optimizer],
                             config=compfx.SearchConfig(seed=seed, progress=False, cache_plan=False))
    analysis = result.analysis
    again = compfx.analyze(fresh, target.batches[0][0], low_dtype=analysis.low_dtype)
    modules = {"fp32": fresh, "amp": Autocast(fresh, device.type, analysis.low_dtype),
               "compfx": compfx.apply(fresh, result.plan, analysis=again)}
    steps = independent_steps(modules, target.batches, target.loss_fn,
                              lambda module: spec.make_optimizers(fresh, config)["model"], rounds=rounds, warmup=2)
    return {
        "model": name, "plan": result.plan.bitstring(analysis),
        "plan_is_amp": result.plan.bitstring(analysis) == compfx.Plan.amp(analysis).bitstring(analysis),
        "search_seconds": result.search_seconds, "rounds": rounds, "threads": torch.get_num_threads(),
        "step_seconds": steps, "median_step_seconds": {k: statistics.median(v) for k, v in steps.items()},
        "ratios": {f"{a}/{b}": _ratio(steps, a, b) for a, b in RATIOS},
    }


def markdown(result: dict) -> str:
    """One row per model: the modes' median steps and the ratios with their 95% intervals.

    >>> ratio = {"median": 0.99, "low": 0.95, "high": 1.03}
    >>> row = {"model": "resnet", "plan_is_amp": True, "rounds": 12,
    ...        "median_step_seconds": {"fp32": 2.6, "amp": 1.2, "compfx": 1.19},
    ...        "ratios": {"compfx/amp": ratio, "compfx/fp32": ratio, "amp/fp32": ratio}}
    >>> print(markdown({"models": [row]}).splitlines()[-1])
    | resnet | AMP's | 12 | 2600 / 1200 / 1190 ms | 0.99 (0.95-1.03) | 0.99 (0.95-1.03) | 0.99 (0.95-1.03) |
    """
    lines = ["| model | compfx's plan | rounds | step FP32 / AMP / compfx | compfx / AMP | compfx / FP32 | "
             "AMP / FP32 |", "|---|---|---|---|---|---|---|"]
    for row in result["models"]:
        steps = row["median_step_seconds"]
        cells = [f"{r['median']:.2f} ({r['low']:.2f}-{r['high']:.2f})"
                 for r in (row["ratios"][f"{a}/{b}"] for a, b in RATIOS)]
        lines.append(f"| {row['model']} | {'AMP' + chr(39) + 's' if row['plan_is_amp'] else 'its own'} | "
                     f"{row['rounds']} | {steps['fp32'] * 1e3:.0f} / {steps['amp'] * 1e3:.0f} / "
                     f"{steps['compfx'] * 1e3:.0f} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vgg16_cifar", "resnet"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "amd-epyc" / "paper-interleaved.json"))
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        row = run_model(name, args.rounds)
        print(json.dumps({k: v for k, v in row.items() if k != "step_seconds"}), file=sys.stderr)
        rows.append(row)
    result = {"device": device_name(torch.device("cpu")), "torch": torch.__version__, "models": rows}
    write_json_atomic(Path(args.out), result)
    print(markdown(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
