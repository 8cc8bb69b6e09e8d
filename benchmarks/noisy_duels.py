"""Do the search's duels stay right under load? (a benchmark, not a test)

The README's quick start is searched in fresh processes, each beside a CPU load of busy processes (two by
default: ``while True: pass``), with torch at its default threads, as a user on a shared machine runs it. Then,
with the load stopped, one more fresh process times FP32's, AMP's and every chosen plan independently: the plans
applied with ``compfx.apply`` to a fresh copy of the model, taking turns (AB BA ...) for many rounds on the same
batches, timed with ``time.perf_counter`` here, not with compfx's timing code. A chosen plan whose quiet step is
slower than the better of FP32's and AMP's by more than the search's margin (3%) is a wrong decision; a search
that found the machine too noisy to decide keeps its incumbent (AMP's plan) and says so in its report.

Run from the repository root::

    python -m benchmarks.noisy_duels                 # 3 searches beside 2 busy processes, then the quiet timing
    python -m benchmarks.noisy_duels --runs 9 --busy 1 --out benchmarks/results/cpu/noisy_duels.json

The quiet timing is only as quiet as the machine: on a machine others use, say so with its figures (the load
average at the start and the end of each phase is recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import compfx
from compfx.files import write_json_atomic
from compfx.measure import median_interval
from compfx.search.log import DUEL

__all__ = ["busy_processes", "search_once", "quiet_steps", "summarize"]

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 0.03  # the search's default margin: a chosen plan slower than the better baseline by more is wrong


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` processes spinning on a CPU each, for as long as the block runs; stopped (by their ids) after."""
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0.0)  # let the scheduler see them before the search starts
        yield [p.pid for p in spinning]
    finally:
        for process in spinning:
            process.terminate()
        for process in spinning:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _readme_case():
    from benchmarks.decisions import CASES

    return CASES["readme"]()


def search_once(threads: int | None) -> dict:
    """The README quick start, searched in this process (at ``threads``, torch's default when None)."""
    if threads:
        torch.set_num_threads(threads)
    model, batches, loss_fn, make_optimizer = _readme_case()
    started = time.perf_counter()
    result = compfx.optimize(model, batches, optimizer=make_optimizer(model), loss_fn=loss_fn,
                             config=compfx.SearchConfig(progress=False, cache_plan=False))
    seconds = time.perf_counter() - started
    duels = [r.extra[DUEL] for r in result.log.notes() if DUEL in r.extra]
    noise = [line for line in result.report().splitlines() if line.startswith("noise")]
    return {"plan": result.plan.bitstring(result.analysis), "search_seconds": seconds,
            "threads": torch.get_num_threads(), "duels": len(duels),
            "duels_won": sum(bool(d["replaces"]) for d in duels),
            "duels_too_noisy": sum(bool(d.get("too_noisy")) for d in duels),
            "report_noise_line": noise[0] if noise else None,
            "report_speedup_vs_fp32": result.step_comparison.speedup("fp32") if result.step_comparison else None}


def quiet_steps(bitstrings: list[str], threads: int | None, rounds: int = 41, warmup: int = 3) -> dict:
    """Each plan's training step, timed independently on a fresh copy of the README model (see the module
    docstring): FP32's, AMP's and the given plans, taking turns on the same batches."""
    from benchmarks.decisions import independent_steps
    from compfx.batches import split_batch

    if threads:
        torch.set_num_threads(threads)
    model, batches, loss_fn, make_optimizer = _readme_case()
    args, kwargs = split_batch(batches[0])
    analysis = compfx.analyze(model, kwargs if kwargs else args)
    plans = {"fp32": compfx.Plan.fp32(analysis).bitstring(analysis),
             "amp": compfx.Plan.amp(analysis).bitstring(analysis)}
    for bits in bitstrings:
        plans.setdefault(bits, bits)
    unique = {}
    for name, bits in plans.items():
        unique.setdefault(bits, name)
    modules = {name: compfx.apply(model, compfx.Plan.from_bitstring(analysis, bits), analysis=analysis)
               for bits, name in unique.items()}
    seconds = independent_steps(modules, batches, loss_fn, make_optimizer, rounds=rounds, warmup=warmup)
    out = {}
    for bits, name in unique.items():
        low, high, _ = median_interval(seconds[name], 0.95)
        out[bits] = {"name": name, "median_s": statistics.median(seconds[name]), "interval_s": [low, high],
                     "vs_fp32": statistics.median(a / b for a, b in zip(seconds[name], seconds["fp32"])),
                     "vs_amp": statistics.median(a / b for a, b in zip(seconds[name], seconds["amp"]))}
    return {"plans": out, "fp32": plans["fp32"], "amp": plans["amp"], "rounds": rounds,
            "threads": torch.get_num_threads()}


def summarize(runs: list[dict], quiet: dict) -> list[str]:
    """A line per search: its plan, its duels, and the quiet step of its plan against the better of FP32's and
    AMP's (each ratio the median of per-round ratios); then the count of wrong decisions.

    On a CPU where AMP's plan is the slower one (no fast bf16), a search that kept it, AMP's plan being the first
    incumbent, counts as wrong here too.

    >>> quiet = {"fp32": "11", "amp": "01", "plans": {"11": {"vs_fp32": 1.0, "vs_amp": 0.6, "median_s": 0.010},
    ...          "01": {"vs_fp32": 1.6, "vs_amp": 1.0, "median_s": 0.016}}}
    >>> print(summarize([{"plan": "01", "duels": 2, "duels_won": 0, "duels_too_noisy": 1}], quiet)[-1])
    wrong decisions (quiet step slower than the better of FP32's and AMP's by more than 3%): 1 of 1
    """
    lines, wrong = [], 0
    for number, run in enumerate(runs, 1):
        timing = quiet["plans"][run["plan"]]
        amp_faster = quiet["plans"][quiet["amp"]]["vs_fp32"] < 1.0
        ratio = timing["vs_amp"] if amp_faster else timing["vs_fp32"]  # against the better of the two
        bad = ratio > 1 + MARGIN
        wrong += bad
        lines.append(f"run {number}: plan {run['plan']}; {run['duels']} duels, {run['duels_won']} won, "
                     f"{run['duels_too_noisy']} too noisy; quiet step {timing['median_s'] * 1e3:.2f} ms = {ratio:.3f}x "
                     f"the better of FP32's and AMP's{' (WRONG)' if bad else ''}")
    lines.append(f"wrong decisions (quiet step slower than the better of FP32's and AMP's by more than "
                 f"{MARGIN:.0%}): {wrong} of {len(runs)}")
    return lines


def _fresh(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.noisy_duels", *argv], capture_output=True, text=True,
                          check=False, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="searches, each in a fresh process beside the load")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside each search")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--rounds", type=int, default=41, help="rounds of the quiet timing")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--search", action="store_true", help=argparse.SUPPRESS)  # one search, JSON on stdout
    parser.add_argument("--quiet", default=None, help=argparse.SUPPRESS)  # the quiet timing of these plans
    args = parser.parse_args(argv)
    threads = args.threads or None
    if args.search:
        print(json.dumps(search_once(threads)))
        return 0
    if args.quiet is not None:
        print(json.dumps(quiet_steps(args.quiet.split(",") if args.quiet else [], threads, rounds=args.rounds)))
        return 0
    extra = ["--threads", str(args.threads)] if args.threads else []
    runs = []
    for number in range(args.runs):
        before = _load()
        with busy_processes(args.busy):
            run = _fresh(["--search", *extra])
        run.update(load_before=before, load_after=_load(), busy=args.busy)
        runs.append(run)
        print(f"search {number + 1} beside {args.busy} busy processes: plan {run['plan']} ({run['duels']} duels, "
              f"{run['duels_won']} won, {run['duels_too_noisy']} too noisy; {run['threads']} threads; load "
              f"{run['load_before']:.2f} -> {run['load_after']:.2f}); {run['report_noise_line'] or 'no noise line'}",
              flush=True)
    before = _load()
    quiet = _fresh(["--quiet", ",".join(sorted({r["plan"] for r in runs})), "--rounds", str(args.rounds), *extra])
    quiet.update(load_before=before, load_after=_load())
    print(f"quiet timing ({quiet['rounds']} rounds, {quiet['threads']} threads, load {before:.2f} -> "
          f"{quiet['load_after']:.2f}):")
    for bits, timing in quiet["plans"].items():
        print(f"  {timing['name']:>6} {bits}: {timing['median_s'] * 1e3:.2f} ms "
              f"({timing['interval_s'][0] * 1e3:.2f}-{timing['interval_s'][1] * 1e3:.2f}); "
              f"x{timing['vs_fp32']:.3f} FP32's, x{timing['vs_amp']:.3f} AMP's")
    lines = summarize(runs, quiet)
    print("\n".join(lines))
    if args.out:
        write_json_atomic(Path(args.out), {"runs": runs, "quiet": quiet, "summary": lines,
                                           "cpus": os.cpu_count()})
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
