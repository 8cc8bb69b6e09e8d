"""Are the search's decisions reproducible, and are its reports quotable? (a benchmark, not a test)

Three checks, each search in a fresh process, so that each pays what a user's run pays:

* ``--repeat N``: the README's first example (the digits CNN on 8 seeded random batches) searched N times;
  the same plan every time?
* ``--agreement``: the report's speed-up of the chosen plan over FP32 against an independent timing of the
  same two plans: a fresh copy of the model, each plan applied with ``compfx.apply``, the two taking turns
  (AB BA ...) for many rounds on the same batches, timed here with ``time.perf_counter`` (not with compfx's
  timing code). On the README example and a tiny GPT-2; target: within 15%.
* ``--cnn128``: a 13-op CNN at batch 128 (20 batches); the chosen plan's step against the better of FP32's
  and AMP's, timed independently the same way; target: within 3%, in each of N runs.

Run from the repository root, on a quiet machine (on a loaded one every timing is slower and wider, and the
rule keeps incumbents)::

    python -m benchmarks.decisions --repeat 3
    python -m benchmarks.decisions --agreement
    python -m benchmarks.decisions --cnn128 --repeat 3
    python -m benchmarks.decisions --all          # all three; writes benchmarks/results/<device>/decisions.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import compfx
from compfx.files import write_json_atomic
from compfx.batches import model_loss, split_batch

__all__ = ["independent_steps", "run_one", "CASES", "markdown"]

ROOT = Path(__file__).resolve().parent.parent


def _readme_case():
    """The README's first example, its batches seeded."""
    from compfx.examples import cnn

    torch.manual_seed(0)
    model = cnn()
    batches = [(torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))) for _ in range(8)]
    return model, batches, lambda out, batch: F.nll_loss(out, batch[-1]), lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1)


def _gpt2_case():
    from benchmarks.search_cost import gpt2_batches, tiny_gpt2

    torch.manual_seed(0)
    return tiny_gpt2(), gpt2_batches(), None, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)


def _cnn128_case():
    from benchmarks.search_cost import ThirteenOpCNN, sample_loader

    torch.manual_seed(0)
    return ThirteenOpCNN(), sample_loader(20, batch_size=128), lambda out, batch: F.cross_entropy(out, batch[-1]), \
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


CASES = {"readme": _readme_case, "gpt2": _gpt2_case, "cnn128": _cnn128_case}


def independent_steps(modules: dict, batches: list, loss_fn, make_optimizer, *, rounds: int = 21,
                      warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of one training step per round of each named module, the modules taking turns on the same batch.

    Timed here, with ``time.perf_counter`` around forward, loss, backward and step; the order rotates each
    round. Each module gets its own optimizer (they share the model's Parameters, so they train one state).
    """
    names = list(modules)
    optimizers = {name: make_optimizer(modules[name]) for name in names}

    def step(name, batch):
        module, optimizer = modules[name], optimizers[name]
        args, kwargs = split_batch(batch)
        optimizer.zero_grad(set_to_none=True)
        output = module(*args, **kwargs)
        (loss_fn or model_loss)(output, batch).backward()
        optimizer.step()

    for i in range(warmup):
        for name in names:
            step(name, batches[i % len(batches)])
    seconds = {name: [] for name in names}
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            batch = batches[(warmup + i) % len(batches)]
            start = time.perf_counter()
            step(name, batch)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def _ratio(slower: list[float], faster: list[float]) -> float:
    """Median of the per-round ratios ``slower / faster``: the speed-up of ``faster``."""
    return statistics.median(a / b for a, b in zip(slower, faster))


def run_one(case: str, seed: int = 0) -> dict:
    """One search of ``case`` in this process, then the independent timing of its plans."""
    torch.set_num_threads(1)
    model, batches, loss_fn, make_optimizer = CASES[case]()
    fresh = copy.deepcopy(model)  # the independent timing starts from the initial weights
    started = time.perf_counter()
    result = compfx.optimize(model, batches, optimizer=make_optimizer(model), loss_fn=loss_fn,
                             config=compfx.SearchConfig(seed=seed, progress=False, cache_plan=False))
    search_seconds = time.perf_counter() - started
    analysis = result.analysis
    plans = {"fp32": compfx.Plan.fp32(analysis), "amp": compfx.Plan.amp(analysis), "chosen": result.plan}
    args, kwargs = split_batch(batches[0])
    again = compfx.analyze(fresh, kwargs if kwargs else args, low_dtype=analysis.low_dtype)  # the fresh copy's own
    modules = {name: compfx.apply(fresh, plan, analysis=again) for name, plan in plans.items()}
    steps = independent_steps(modules, batches, loss_fn, make_optimizer)
    comparison = result.step_comparison
    reported = _ratio(comparison.seconds["fp32"], comparison.seconds["chosen"]) if comparison.seconds.get(
        "chosen") and comparison.seconds.get("fp32") else None
    independent = _ratio(steps["fp32"], steps["chosen"])
    medians = {name: statistics.median(s) for name, s in steps.items()}
    best_baseline = min(medians["fp32"], medians["amp"])
    # the chosen plan may be AMP's or FP32's own: then it is that program, and two timings of one program differ
    # only by this timing's noise, which is no difference between plans
    same_as = next((name for name in ("amp", "fp32") if plans[name].bitstring(analysis) == plans["chosen"].bitstring(
        analysis)), None)
    chosen_step = medians[same_as] if same_as else medians["chosen"]
    return {
        "case": case, "plan": result.plan.bitstring(analysis), "search_seconds": search_seconds,
        "report_speedup_text": comparison.speedup("fp32"), "report_speedup": reported,
        "independent_speedup": independent,
        "agreement": None if reported is None else reported / independent,
        "independent_step_seconds": medians,
        "chosen_vs_better_of_fp32_amp": chosen_step / best_baseline, "chosen_is": same_as,
        "report_step_seconds": dict(result.step_seconds),
    }


def _row(label: str, row: dict) -> str:
    steps = row["independent_step_seconds"]
    agreement = "-" if row.get("agreement") is None else f"{row['agreement']:.3f}"
    return (f"| {label} | `{row['plan']}` | {row['report_speedup_text']} | {row['independent_speedup']:.3f}x | "
            f"{agreement} | {steps['fp32'] * 1e3:.2f} / {steps['amp'] * 1e3:.2f} / {steps['chosen'] * 1e3:.2f} ms | "
            f"{row['chosen_vs_better_of_fp32_amp']:.3f} |")


def markdown(result: dict) -> str:
    """The results as one markdown table: a line per search, each in a fresh process.

    >>> row = {"plan": "01f", "report_speedup_text": "speed-up 1.10x (1.05-1.20)", "independent_speedup": 1.08,
    ...        "agreement": 1.02, "independent_step_seconds": {"fp32": 2e-3, "amp": 2.1e-3, "chosen": 1.85e-3},
    ...        "chosen_vs_better_of_fp32_amp": 0.925}
    >>> print(markdown({"repeatability": {"runs": [row]}}).splitlines()[-1])
    | README example, run 1 | `01f` | speed-up 1.10x (1.05-1.20) | 1.080x | 1.020 | 2.00 / 2.10 / 1.85 ms | 0.925 |
    """
    lines = ["| search (fresh process) | chosen plan | the report says (chosen vs FP32) | independent timing: "
             "FP32 / chosen | report / independent | independent steps FP32 / AMP / chosen | chosen / better of "
             "FP32 and AMP |", "|---|---|---|---|---|---|---|"]
    for number, row in enumerate((result.get("repeatability") or {}).get("runs", []), 1):
        lines.append(_row(f"README example, run {number}", row))
    for case, row in (result.get("agreement") or {}).items():
        lines.append(_row({"readme": "README example", "gpt2": "tiny GPT-2"}.get(case, case) + " (agreement check)",
                          row))
    for number, row in enumerate((result.get("cnn128") or {}).get("runs", []), 1):
        lines.append(_row(f"batch-128 CNN, run {number}", row))
    return "\n".join(lines)


def _fresh(case: str, seed: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.decisions", "--one", case, "--seed", str(seed)],
                          capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def repeatability(runs: int) -> dict:
    rows = [_fresh("readme", 0) for _ in range(runs)]
    plans = [row["plan"] for row in rows]
    return {"plans": plans, "same_plan": len(set(plans)) == 1, "runs": rows}


def agreement() -> dict:
    out = {}
    for case in ("readme", "gpt2"):
        row = _fresh(case, 0)
        row["within_15_percent"] = row["agreement"] is not None and abs(row["agreement"] - 1.0) <= 0.15
        out[case] = row
    return out


def cnn128(runs: int) -> dict:
    rows = [_fresh("cnn128", 0) for _ in range(runs)]
    return {"runs": rows, "within_3_percent_every_run": all(r["chosen_vs_better_of_fp32_amp"] <= 1.03 for r in rows)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=0, help="runs of the README example (or of --cnn128)")
    parser.add_argument("--agreement", action="store_true", help="report vs independent timing: README, GPT-2")
    parser.add_argument("--cnn128", action="store_true", help="the batch-128 CNN, --repeat runs (default 3)")
    parser.add_argument("--all", action="store_true", help="all three, 3 runs each; writes the results JSON")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<device>/decisions.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", choices=sorted(CASES), help=argparse.SUPPRESS)  # one run, JSON on stdout
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.seed)))
        return 0
    result = {"machine_load_per_cpu_at_start": _load()}
    if args.all or (args.repeat and not args.cnn128):
        result["repeatability"] = repeatability(args.repeat or 3)
        print(f"README example, {len(result['repeatability']['plans'])} fresh runs: {result['repeatability']['plans']}"
              f" -> {'the same plan' if result['repeatability']['same_plan'] else 'DIFFERENT plans'}")
    if args.all or args.agreement:
        result["agreement"] = agreement()
        for case, row in result["agreement"].items():
            print(f"{case}: report {row['report_speedup_text']!r}; report's median ratio "
                  f"{row['report_speedup'] or float('nan'):.3f} vs independent {row['independent_speedup']:.3f} "
                  f"(x{row['agreement'] or float('nan'):.3f}; within 15%: {row['within_15_percent']})")
    if args.all or args.cnn128:
        result["cnn128"] = cnn128(args.repeat or 3)
        for row in result["cnn128"]["runs"]:
            print(f"cnn128: plan {row['plan']}; chosen / better of FP32, AMP = {row['chosen_vs_better_of_fp32_amp']:.3f}"
                  f" (steps {', '.join(f'{k} {v * 1e3:.2f} ms' for k, v in row['independent_step_seconds'].items())})")
        print(f"within 3% in every run: {result['cnn128']['within_3_percent_every_run']}")
    result["machine_load_per_cpu_at_end"] = _load()
    if args.all or args.out:
        out = Path(args.out or ROOT / "benchmarks" / "results" / "cpu" / "decisions.json")
        write_json_atomic(out, result)
        print(f"wrote {out}")
    return 0


def _load() -> float | None:
    try:
        import os

        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
