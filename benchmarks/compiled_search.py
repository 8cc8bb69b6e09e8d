"""Does a compiled search's report quote the compiled program? (a benchmark, not a test)

For the README's quick-start model and a tiny GPT-2 (built from ``transformers.GPT2Config``), each in a fresh
process: a compiled search (``SearchConfig(compile=CompileOptions())``, Inductor), then the report's speed-up of
the chosen plan over FP32 (the step comparison: compiled FP32 and compiled chosen plan taking turns after the
search) against an independent timing of the same two programs, built afresh on a fresh copy of the model:
``compile_with_plan(model, plan)`` against ``compile_with_plan(model, Plan.fp32(analysis))``, taking turns on the
same batches (:func:`compfx.measure.time_interleaved`), compiled in untimed warm-up. Each speed-up is the median
of the per-round ratios with its interval (:meth:`compfx.search.compare.Comparison.speedup`); target: the two
medians agree within 15%. Also written: each plan's median step and its interval, the search's cost by part
(``compile`` among them) and the load on the machine.

Run from the repository root, on a quiet machine::

    python -m benchmarks.compiled_search                      # both models; writes benchmarks/results/cpu/
    python -m benchmarks.compiled_search --cases readme --inner aot_eager --rounds 7 --out /tmp/out
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import compfx
from compfx.batches import model_loss, split_batch
from compfx.files import write_json_atomic
from compfx.measure import median_interval, time_interleaved
from compfx.search.compare import Comparison

from .decisions import CASES as DECISION_CASES

__all__ = ["CASES", "run_one", "independent_speedup", "markdown", "main"]

ROOT = Path(__file__).resolve().parent.parent
CASES = {"readme": DECISION_CASES["readme"], "gpt2": DECISION_CASES["gpt2"]}
LABELS = {"readme": "README quick-start CNN", "gpt2": "tiny GPT-2"}
CONFIDENCE = 0.95


def independent_speedup(model, plans: dict, batches: list, loss_fn, make_optimizer, options: compfx.CompileOptions,
                        *, rounds: int, warmup: int = 3) -> dict:
    """Each named plan compiled afresh on ``model`` (``compile_with_plan`` under ``options``), their training steps
    taking turns on the same batches; seconds per round, each plan's median with its interval, and the speed-up of
    ``"chosen"`` over ``"fp32"`` (median of the per-round ratios, with its interval)."""
    names = list(plans)
    programs = {name: compfx.compile_with_plan(model, plans[name], options=options) for name in names}
    optimizers = {name: make_optimizer(model) for name in names}
    device = next(model.parameters()).device

    def step(name):
        def one(i):
            batch = batches[i % len(batches)]
            args, kwargs = split_batch(batch)
            optimizers[name].zero_grad(set_to_none=True)
            (loss_fn or model_loss)(programs[name](*args, **kwargs), batch).backward()
            optimizers[name].step()
        return one

    seconds = time_interleaved([step(name) for name in names], rounds=rounds, warmup=warmup, device=device)
    by_name = dict(zip(names, seconds))
    return {"seconds": by_name, "steps": _steps(by_name), **_speedup(by_name)}


def _steps(seconds: dict) -> dict:
    """Each plan's median step and its interval at :data:`CONFIDENCE`, in seconds."""
    steps = {}
    for name, values in seconds.items():
        low, high, _ = median_interval(values, CONFIDENCE)
        steps[name] = {"median": statistics.median(values), "low": low, "high": high}
    return steps


def _speedup(seconds: dict) -> dict:
    middle, low, high = Comparison.of(seconds["fp32"], seconds["chosen"]).speedup(CONFIDENCE)
    return {"speedup": middle, "speedup_low": low, "speedup_high": high}


def run_one(case: str, inner: str = "inductor", rounds: int = 21, seed: int = 0) -> dict:
    """A compiled search of ``case`` in this process, then the independent timing of its chosen plan and FP32's."""
    torch.set_num_threads(1)
    model, batches, loss_fn, make_optimizer = CASES[case]()
    fresh = copy.deepcopy(model)  # the independent timing starts from the initial weights, on programs of its own
    options = compfx.CompileOptions(inner=inner)
    started = time.perf_counter()
    result = compfx.optimize(model, batches, optimizer=make_optimizer(model), loss_fn=loss_fn,
                             config=compfx.SearchConfig(seed=seed, progress=False, cache_plan=False, compile=options,
                                                        rounds=rounds))
    search_seconds = time.perf_counter() - started
    comparison, analysis = result.step_comparison, result.analysis
    reported = {name: list(comparison.seconds[name]) for name in ("fp32", "chosen")}
    independent = independent_speedup(fresh, {"fp32": compfx.Plan.fp32(analysis), "chosen": result.plan}, batches,
                                      loss_fn, make_optimizer, options, rounds=rounds)
    report = {"seconds": reported, "steps": _steps(reported), "text": comparison.speedup("fp32"),
              "phase": comparison.phase, **_speedup(reported)}
    return {
        "case": case, "model": LABELS[case], "inner": inner, "plan": result.plan.bitstring(analysis),
        "plan_is": next((name for name, plan in (("fp32", comparison.plans.get("fp32")),
                                                  ("amp", comparison.plans.get("amp")))
                         if plan == comparison.plans.get("chosen")), None),
        "search_seconds": search_seconds, "cost_breakdown": dict(result.cost_breakdown),
        "report": report, "independent": independent,
        "agreement": report["speedup"] / independent["speedup"],
        "within_15_percent": abs(report["speedup"] / independent["speedup"] - 1.0) <= 0.15,
    }


def _fresh(case: str, inner: str, rounds: int) -> dict:
    """:func:`run_one` in a fresh process: each case pays its own first compiles."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.compiled_search", "--one", case, "--inner", inner,
                           "--rounds", str(rounds)], capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ms(step: dict) -> str:
    return f"{step['median'] * 1e3:.2f} ms ({step['low'] * 1e3:.2f}-{step['high'] * 1e3:.2f})"


def markdown(results: dict) -> str:
    """One row per model: the report's speed-up and the independent one, with intervals, and their agreement.

    >>> step = {"median": 1e-3, "low": 9e-4, "high": 1.1e-3}
    >>> side = {"speedup": 1.2, "speedup_low": 1.1, "speedup_high": 1.3, "steps": {"fp32": step, "chosen": step}}
    >>> row = {"model": "m", "plan": "0f0", "report": side, "independent": side, "agreement": 1.0,
    ...        "within_15_percent": True, "cost_breakdown": {"compile": 3.0}, "search_seconds": 9.0}
    >>> print(markdown({"cases": {"m": row}, "threads": 1, "load_per_cpu": [0.5, 0.5], "inner": "inductor"}).splitlines()[-1])
    | m | `0f0` | 1.20x (1.10-1.30) | 1.00 ms (0.90-1.10) / 1.00 ms (0.90-1.10) | 1.20x (1.10-1.30) | 1.00 ms (0.90-1.10) / 1.00 ms (0.90-1.10) | 1.000 (yes) | 9.0 s (compile 3.0 s) |
    """
    load = results.get("load_per_cpu") or [None, None]
    lines = [f"Compiled search (inner={results['inner']!r}), {results['threads']} thread(s); load per CPU "
             f"{load[0] if load[0] is None else f'{load[0]:.2f}'} at start, "
             f"{load[1] if load[1] is None else f'{load[1]:.2f}'} at end. Speed-up of the chosen plan over FP32, "
             f"both compiled: median of per-round ratios ({CONFIDENCE:.0%} interval); steps: median (interval).", "",
             "| model | chosen plan | report: chosen vs FP32 | report steps FP32 / chosen | independent: chosen vs "
             "FP32 | independent steps FP32 / chosen | report / independent (within 15%) | search (compile) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results["cases"].values():
        report, independent = row["report"], row["independent"]
        lines.append(
            f"| {row['model']} | `{row['plan']}` | {_speedup_text(report)} | {_ms(report['steps']['fp32'])} / "
            f"{_ms(report['steps']['chosen'])} | {_speedup_text(independent)} | {_ms(independent['steps']['fp32'])} / "
            f"{_ms(independent['steps']['chosen'])} | {row['agreement']:.3f} "
            f"({'yes' if row['within_15_percent'] else 'no'}) | {row['search_seconds']:.1f} s (compile "
            f"{row['cost_breakdown'].get('compile', 0.0):.1f} s) |")
    return "\n".join(lines)


def _speedup_text(side: dict) -> str:
    return f"{side['speedup']:.2f}x ({side['speedup_low']:.2f}-{side['speedup_high']:.2f})"


def _load() -> float | None:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["readme", "gpt2"])
    parser.add_argument("--inner", default="inductor", help="the inner backend (default: inductor)")
    parser.add_argument("--rounds", type=int, default=21, help="rounds of each interleaved timing")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu"))
    parser.add_argument("--one", choices=sorted(CASES), help=argparse.SUPPRESS)  # one run, JSON on stdout
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.inner, args.rounds)))
        return 0
    load_start = _load()
    cases = {case: _fresh(case, args.inner, args.rounds) for case in args.cases}
    results = {"inner": args.inner, "threads": 1, "rounds": args.rounds, "torch": torch.__version__,
               "load_per_cpu": [load_start, _load()], "cases": cases}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "compiled_search.json", results, "compiled search results")
    (out / "compiled_search.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
