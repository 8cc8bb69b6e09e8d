"""What depth costs a compiled search: Stage 1's candidates and the seconds spent compiling each plan, by depth.

A GPT-style decoder (``benchmarks.models.gpt.GPT``, width 64) at 2, 4, 8 and
16 layers. For each depth:

* **Stage 1's candidates**, with and without ``SearchConfig(tie_blocks=True)``:
  Stage 1 runs on fake epochs (no training: a device where each FP32 op costs a
  second and no plan hurts the loss) at the default ``stage1_budget``; the
  figure is the plans it sampled, FP32's and AMP's epochs included, and its
  decisions (searched ops, or tied ones).
* **Compile seconds per plan**, for ``Plan.fp32`` and ``Plan.amp``, compiled
  with ``compfx.compile_with_plan(model, plan, regions=...)`` whole
  (``regions=None``) and by regions (``regions="auto"``): the wall seconds
  torch's own compile timers count in the first training step (dynamo's
  compile of each frame, the backward's compile), and the first step's CPU
  seconds less the median steady step's (this process and the compiler
  processes it waited for: one thread, Inductor compiling in-process,
  ``compile_threads=1``). Inductor's and AOT autograd's caches are off, and
  dynamo is reset before each compile, so every compile starts cold.
* **The compiled search's own compile part** (``result.cost_breakdown
  ["compile"]`` of a search under ``SearchConfig(compile=...)``), when this
  compfx has that setting; "not available" otherwise.

The acceptance figure is the ratio of compile seconds at the deepest to the
shallowest depth, per way of compiling::

    python -m benchmarks.compile_depth --out benchmarks/results/cpu

Writes ``compile_depth.json`` and ``compile_depth.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import compfx
from compfx.backend import compile_with_plan
from compfx.files import write_json_atomic
from compfx.search.config import SearchConfig
from compfx.search.evaluator import FunctionEvaluator
from compfx.search.space import SearchSpace
from compfx.search.stage1 import run_stage1

from .models.gpt import GPT

__all__ = ["DEPTHS", "WAYS", "PLANS", "stage1_candidates", "compile_seconds", "compiled_search_compile", "measure",
           "markdown", "main"]

DEPTHS = (2, 4, 8, 16)
#: torch's own compile timers (``torch._dynamo.utils.compilation_time_metrics``): dynamo's compile of a frame
#: (the forward's AOT and Inductor compiles inside it), and the backward's compile at the first backward
TIMERS = ("_compile.compile_inner", "backward._backward_impl")
WIDTH, HEADS, LENGTH, VOCAB, BATCH = 64, 4, 32, 128, 8


def decoder(layers: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(VOCAB, LENGTH, WIDTH, HEADS, layers)


def tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _fake_epochs(plan):
    """(loss, seconds) per batch on a device where each FP32 op costs a second and no plan hurts the loss."""
    for _ in range(3):
        yield 1.0, 1.0 + str(plan).count("1")


def stage1_candidates(analysis, tie_blocks: bool, budget: int = SearchConfig().stage1_budget) -> dict:
    """Stage 1 on fake epochs: the plans it sampled (FP32's and AMP's included), its decisions and its mode.

    >>> row = stage1_candidates(compfx.analyze(decoder(2), tokens()[0], verify=False), tie_blocks=True)
    >>> row["decisions"] < row["searched_ops"], row["samples"] > 2
    (True, True)
    """
    space = SearchSpace.from_analysis(analysis, tie_blocks=tie_blocks)
    result = run_stage1(space, FunctionEvaluator(run_epoch=_fake_epochs), budget=budget)
    return {"searched_ops": len(space.searched), "decisions": len(space.decisions), "samples": len(result.samples),
            "mode": result.mode}


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for (the C++ compiler Inductor runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def compile_seconds(layers: int, plan_name: str, regions, *, inner: str = "inductor", steps: int = 3) -> dict:
    """Seconds the first training step of ``compile_with_plan(model, plan, regions=regions)`` spends compiling:
    its wall and CPU seconds less the median steady step's; and the graphs compfx's backends compiled."""
    torch._dynamo.reset()
    model = decoder(layers)
    x, y = tokens()
    analysis = compfx.analyze(model, x, verify=False)
    plan = getattr(compfx.Plan, plan_name)(analysis)
    compiled = compile_with_plan(model, plan, inner=inner, regions=regions)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), _cpu_seconds()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(compiled(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        return time.perf_counter() - wall, _cpu_seconds() - cpu

    timers = torch._dynamo.utils.compilation_time_metrics
    timers.clear()
    first = step()
    compiling = sum(sum(timers.get(name, ())) for name in TIMERS)
    steady = [step() for _ in range(steps)]
    records = compiled.records if hasattr(compiled, "compfx_regions") else compiled.compfx_backend.records
    return {"wall": first[0] - statistics.median(s[0] for s in steady),
            "cpu": first[1] - statistics.median(s[1] for s in steady),
            "torch_timers": compiling,
            "steady_step_wall": statistics.median(s[0] for s in steady),
            "graphs": len({record.compile_id for record in records})}


def compiled_search_compile(layers: int) -> float | str:
    """The compile part of a compiled search's cost breakdown (tied blocks), or why there is none."""
    fields = {f.name for f in dataclasses.fields(SearchConfig)}
    if "compile" not in fields:
        return "not available (this compfx's SearchConfig has no compile setting)"
    model = decoder(layers)
    batches = [tokens(seed) for seed in range(2)]
    settings = dict(compile=True, progress=False, warmup=1, repeats=1, cache_plan=False)
    if "tie_blocks" in fields:
        settings["tie_blocks"] = True
    try:
        config = SearchConfig(**settings)
    except compfx.errors.CompfxError as error:
        return f"not available (SearchConfig(compile=True) refused: {error})"
    result = compfx.optimize(model, batches, loss_fn=lambda out, b: F.cross_entropy(out.flatten(0, 1), b[1].flatten()),
                             optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=config)
    return float(result.cost_breakdown.get("compile", float("nan")))


WAYS = (("whole", None), ("regions", "auto"))
PLANS = ("fp32", "amp")


def measure(depths=DEPTHS, *, inner: str = "inductor", steps: int = 3, rounds: int = 3, search: bool = True) -> dict:
    """Every figure of the benchmark; compile seconds are the median over ``rounds`` rounds, each compiling every
    depth, way and plan once (after a warm-up compile of each way and plan, not counted: a process's first compile
    also loads the compiler and builds what every later compile reuses)."""
    for _, regions in WAYS:
        for plan in PLANS:
            compile_seconds(depths[0], plan, regions, inner=inner, steps=1)
    seconds = {(layers, way, plan): [] for layers in depths for way, _ in WAYS for plan in PLANS}
    for _ in range(rounds):
        for layers in depths:
            for way, regions in WAYS:
                for plan in PLANS:
                    seconds[layers, way, plan].append(compile_seconds(layers, plan, regions, inner=inner, steps=steps))
        print(f"round {_ + 1} of {rounds} done", flush=True)
    rows = []
    for layers in depths:
        analysis = compfx.analyze(decoder(layers), tokens()[0], verify=False)
        rows.append({
            "layers": layers, "ops": len(analysis.ops),
            "stage1": {"untied": stage1_candidates(analysis, False), "tied": stage1_candidates(analysis, True)},
            "compile": {way: {plan: _medians(seconds[layers, way, plan]) for plan in PLANS} for way, _ in WAYS},
            "compiled_search_compile": compiled_search_compile(layers) if search else "not run"})
    first, last = rows[0], rows[-1]
    ratios = {way: {plan: {clock: last["compile"][way][plan][clock] / first["compile"][way][plan][clock]
                           for clock in ("torch_timers", "cpu")} for plan in PLANS} for way, _ in WAYS}
    return {"model": f"GPT-style decoder (benchmarks.models.gpt.GPT), width {WIDTH}, {HEADS} heads, {LENGTH} tokens, "
                     f"vocab {VOCAB}, batch {BATCH}",
            "inner": inner, "rounds": rounds, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "stage1_budget": SearchConfig().stage1_budget,
            "rows": rows, "deepest_over_shallowest": ratios}


def _medians(runs: list[dict]) -> dict:
    """Each figure's median over the rounds, and the rounds' own figures (their spread)."""
    return {**{name: statistics.median(run[name] for run in runs) for name in runs[0]}, "rounds": runs}


def markdown(results: dict) -> str:
    rows = results["rows"]
    lines = [f"{results['model']}; compiled with {results['inner']} on {results['machine']} (torch "
             f"{results['torch']}), one thread, caches off, one compile at a time. Compile seconds per plan: torch's "
             "compile timers in the first training step, wall (in brackets: the first step's CPU seconds less a steady "
             f"step's), median of {results['rounds']} rounds. Stage 1 on fake epochs at stage1_budget="
             f"{results['stage1_budget']}: plans sampled (decisions).", "",
             "| layers | Stage 1 untied | Stage 1 tied | whole FP32 | whole AMP | regions FP32 | regions AMP | graphs "
             "whole / regions | compiled search's compile |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        compile_, untied, tied = row["compile"], row["stage1"]["untied"], row["stage1"]["tied"]
        cells = [f"{compile_[way][plan]['torch_timers']:.1f} ({compile_[way][plan]['cpu']:.1f})"
                 for way, _ in WAYS for plan in PLANS]
        search = row["compiled_search_compile"]
        lines.append(f"| {row['layers']} | {untied['samples']} ({untied['decisions']}) "
                     f"| {tied['samples']} ({tied['decisions']}) | {' | '.join(cells)} "
                     f"| {compile_['whole']['amp']['graphs']} / {compile_['regions']['amp']['graphs']} "
                     f"| {f'{search:.1f} s' if isinstance(search, float) else search} |")
    ratios = results["deepest_over_shallowest"]
    lines += ["", f"Compile seconds at {rows[-1]['layers']} layers over {rows[0]['layers']} layers, torch's timers "
              "(CPU):"]
    for way in ("whole", "regions"):
        lines.append(f"- {way}: " + ", ".join(f"{plan.upper()} {r['torch_timers']:.2f}x ({r['cpu']:.2f}x)"
                                              for plan, r in ratios[way].items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEPTHS))
    parser.add_argument("--inner", default="inductor", help="the inner backend (aot_eager for a quick check)")
    parser.add_argument("--steps", type=int, default=3, help="steady steps after the first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of compiles (their median is reported)")
    parser.add_argument("--no-search", action="store_true", help="skip the compiled search")
    parser.add_argument("--out", default="benchmarks/results/cpu")
    args = parser.parse_args(argv)
    # every compile cold, and in this process (so its compiler's CPU seconds are counted)
    from torch._functorch import config as aot_config
    from torch._inductor import config as inductor_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no intra-op threads spinning in the CPU seconds of the steps
    try:
        with inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False, compile_threads=1), \
                aot_config.patch(enable_autograd_cache=False):
            results = measure(args.layers, inner=args.inner, steps=args.steps, rounds=args.rounds,
                              search=not args.no_search)
    finally:
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "compile_depth.json", results, "compile depth results")
    (out / "compile_depth.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
