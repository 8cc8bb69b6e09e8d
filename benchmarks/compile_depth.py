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
  (``regions=False``) and by regions (``regions="auto"``): the wall seconds
  torch's own compile timers count in the first training step (dynamo's
  compile of each frame, the backward's compile), and the first step's CPU
  seconds less the median steady step's (this process and the compiler
  processes it waited for: one thread, Inductor compiling in-process,
  ``compile_threads=1``). Inductor's and AOT autograd's caches are off, and
  dynamo is reset before each compile, so every compile starts cold.
* **The compiled search's compile seconds**: a whole ``compfx.optimize`` under
  ``SearchConfig(compile=CompileOptions(regions="auto"))``, with and without
  ``tie_blocks``, on two batches, pricing plans with the H100 roofline
  (:func:`compfx.costmodel.roofline_cost`: a device where low precision can pay)
  and with the cost model off (``predictor=False``), so that every Stage-1
  candidate is measured, compiled: the most compiles a search makes. The figure
  is what torch's compile timers count over the whole search (every program:
  FP32's, AMP's, the candidates', the duels', the step comparison's), beside its
  cost breakdown's ``compile`` part (wall seconds of the untimed compile steps,
  which also run a step), the plans whose programs it built, and the graphs
  dynamo compiled. The searches take turns by depth, after a warm-up search.

The acceptance figures are the ratios of compile seconds at the deepest to the
shallowest depth, per way of compiling, and for the compiled search (goal: at
most 1.5x). The machine may be shared: the load average (``os.getloadavg``)
before and after each search, and over the run, is in the results::

    python -m benchmarks.compile_depth --out benchmarks/results/cpu

Writes ``compile_depth.json`` and ``compile_depth.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import compfx
from compfx import CompileOptions
from compfx.compile_backend import compile_with_plan
from compfx.costmodel import roofline_cost
from compfx.files import write_json_atomic
from compfx.search.config import SearchConfig
from compfx.search.evaluator import FunctionEvaluator
from compfx.search.space import SearchSpace
from compfx.search.stage1 import run_stage1
from compfx.vocabulary import SampleStatus, Stage

from .models.gpt import GPT

__all__ = ["DEPTHS", "WAYS", "PLANS", "SEARCHES", "SEARCH_GOAL", "stage1_candidates", "compile_seconds",
           "compiled_search_compile", "measure", "markdown", "main"]

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


def compiled_search_compile(layers: int, *, tie_blocks: bool = True, inner: str = "inductor",
                            budgets: dict | None = None) -> dict:
    """A compiled search by regions (``SearchConfig(compile=CompileOptions(regions="auto"))``) at this depth: the
    seconds torch's compile timers count over the whole search, its cost breakdown's ``compile`` part (wall seconds
    of the untimed compile steps, which run a step too), the plans whose programs it built, and the graphs dynamo
    compiled. ``budgets``: SearchConfig's ``stage1_budget`` / ``stage2_budget`` (a quick check)."""
    torch._dynamo.reset()
    model = decoder(layers)
    batches = [tokens(seed) for seed in range(2)]
    cost = roofline_cost(compfx.analyze(model, batches[0][0], verify=False))  # an H100, where low precision can pay
    config = SearchConfig(compile=CompileOptions(inner=inner, regions="auto"), tie_blocks=tie_blocks, cost_fn=cost,
                          predictor=False, progress=False, warmup=1, repeats=1, cache_plan=False, **(budgets or {}))
    timers, counters = torch._dynamo.utils.compilation_time_metrics, torch._dynamo.utils.counters["stats"]
    timers.clear()
    graphs, load, wall = counters["unique_graphs"], os.getloadavg()[0], time.perf_counter()
    result = compfx.optimize(model, batches, loss_fn=lambda out, b: F.cross_entropy(out.flatten(0, 1), b[1].flatten()),
                             optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=config)
    seconds = sum(sum(timers.get(name, ())) for name in TIMERS)
    measured = [r for r in result.log.samples() if r.status is not SampleStatus.SKIPPED]
    programs = {r.plan for r in measured} | set(result.step_comparison.plans.values())
    return {"torch_timers": seconds, "breakdown_compile": float(result.cost_breakdown.get("compile", float("nan"))),
            "programs": len(programs), "per_program": seconds / max(1, len(programs)),
            "stage1_plans": len({r.plan for r in measured if r.stage is Stage.STAGE1}),
            "stage2_plans": len({r.plan for r in measured if r.stage is Stage.STAGE2}),
            "graphs": counters["unique_graphs"] - graphs, "search_wall": time.perf_counter() - wall,
            "load_before": load, "load_after": os.getloadavg()[0]}


WAYS = (("whole", False), ("regions", "auto"))
PLANS = ("fp32", "amp")


SEARCHES = (("tied", True), ("untied", False))
#: The compiled search's goal: its compile seconds at the deepest depth at most this many times the shallowest's.
SEARCH_GOAL = 1.5


def measure(depths=DEPTHS, *, inner: str = "inductor", steps: int = 3, rounds: int = 3, search: bool = True,
            search_rounds: int = 1, search_budgets: dict | None = None) -> dict:
    """Every figure of the benchmark; compile seconds are the median over ``rounds`` rounds, each compiling every
    depth, way and plan once (after a warm-up compile of each way and plan, not counted: a process's first compile
    also loads the compiler and builds what every later compile reuses); the compiled searches' over
    ``search_rounds`` rounds, each searching every depth tied and untied, after a warm-up search."""
    load_start = os.getloadavg()
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
    searches = {(layers, name): [] for layers in depths for name, _ in SEARCHES}
    if search:
        compiled_search_compile(depths[0], inner=inner, budgets=search_budgets)  # warm-up, not counted
        for round_ in range(search_rounds):
            for layers in depths:
                for name, tied in SEARCHES:
                    searches[layers, name].append(compiled_search_compile(layers, tie_blocks=tied, inner=inner,
                                                                          budgets=search_budgets))
                    print(f"search round {round_ + 1}, {layers} layers, {name}: "
                          f"{searches[layers, name][-1]['torch_timers']:.1f} s", flush=True)
    rows = []
    for layers in depths:
        analysis = compfx.analyze(decoder(layers), tokens()[0], verify=False)
        rows.append({
            "layers": layers, "ops": len(analysis.ops),
            "stage1": {"untied": stage1_candidates(analysis, False), "tied": stage1_candidates(analysis, True)},
            "compile": {way: {plan: _medians(seconds[layers, way, plan]) for plan in PLANS} for way, _ in WAYS},
            "compiled_search": ({name: _medians(searches[layers, name]) for name, _ in SEARCHES} if search
                                else "not run")})
    first, last = rows[0], rows[-1]
    ratios = {way: {plan: {clock: last["compile"][way][plan][clock] / first["compile"][way][plan][clock]
                           for clock in ("torch_timers", "cpu")} for plan in PLANS} for way, _ in WAYS}
    search_ratios = ({name: {figure: last["compiled_search"][name][figure] / first["compiled_search"][name][figure]
                             for figure in ("torch_timers", "per_program")} for name, _ in SEARCHES}
                     if search else "not run")
    return {"model": f"GPT-style decoder (benchmarks.models.gpt.GPT), width {WIDTH}, {HEADS} heads, {LENGTH} tokens, "
                     f"vocab {VOCAB}, batch {BATCH}",
            "inner": inner, "rounds": rounds, "search_rounds": search_rounds, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "stage1_budget": SearchConfig().stage1_budget, "search_budgets": search_budgets or "the defaults",
            "rows": rows, "deepest_over_shallowest": ratios, "search_deepest_over_shallowest": search_ratios,
            "search_goal": SEARCH_GOAL}


def _medians(runs: list[dict]) -> dict:
    """Each figure's median over the rounds, and the rounds' own figures (their spread)."""
    return {**{name: statistics.median(run[name] for run in runs) for name in runs[0]}, "rounds": runs}


def markdown(results: dict) -> str:
    rows = results["rows"]
    start, end = results["load_average_start"], results["load_average_end"]
    lines = [f"{results['model']}; compiled with {results['inner']} on {results['machine']} (torch "
             f"{results['torch']}), one thread, caches off, one compile at a time, on a machine of "
             f"{results['cpus']} CPUs shared with other work: load average {start[0]:.1f} at the start, "
             f"{end[0]:.1f} at the end (1-minute; {start[2]:.1f} and {end[2]:.1f} over 15 minutes). Compile seconds per "
             "plan: torch's compile timers in the first training step, wall (in brackets: the first step's CPU "
             f"seconds less a steady step's), median of {results['rounds']} rounds. Stage 1 on fake epochs at "
             f"stage1_budget={results['stage1_budget']}: plans sampled (decisions). The compiled search's compile: "
             "torch's compile timers over a whole search by regions (regions='auto', cost model off, H100 roofline "
             f"cost), median of {results['search_rounds']} round(s), tied / untied blocks, with the plans whose "
             "programs it compiled (of them, Stage 2's candidates).", "",
             "| layers | Stage 1 untied | Stage 1 tied | whole FP32 | whole AMP | regions FP32 | regions AMP | graphs "
             "whole / regions | compiled search's compile, tied / untied (plans) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        compile_, untied, tied = row["compile"], row["stage1"]["untied"], row["stage1"]["tied"]
        cells = [f"{compile_[way][plan]['torch_timers']:.1f} ({compile_[way][plan]['cpu']:.1f})"
                 for way, _ in WAYS for plan in PLANS]
        search = row["compiled_search"]
        searched = (" / ".join(f"{search[name]['torch_timers']:.1f} s ({search[name]['programs']:.0f} plans, "
                               f"{search[name]['stage2_plans']:.0f} in Stage 2)" for name, _ in SEARCHES)
                    if isinstance(search, dict) else search)
        lines.append(f"| {row['layers']} | {untied['samples']} ({untied['decisions']}) "
                     f"| {tied['samples']} ({tied['decisions']}) | {' | '.join(cells)} "
                     f"| {compile_['whole']['amp']['graphs']} / {compile_['regions']['amp']['graphs']} "
                     f"| {searched} |")
    ratios = results["deepest_over_shallowest"]
    deep, shallow = rows[-1]["layers"], rows[0]["layers"]
    lines += ["", f"Compile seconds at {deep} layers over {shallow} layers, torch's timers (CPU):"]
    for way in ("whole", "regions"):
        lines.append(f"- {way}: " + ", ".join(f"{plan.upper()} {r['torch_timers']:.2f}x ({r['cpu']:.2f}x)"
                                              for plan, r in ratios[way].items()))
    search_ratios = results["search_deepest_over_shallowest"]
    if isinstance(search_ratios, dict):
        for name, _ in SEARCHES:
            ratio = search_ratios[name]["torch_timers"]
            verdict = "meets" if ratio <= results["search_goal"] else "does not meet"
            lines.append(f"- compiled search by regions, {name} blocks: {ratio:.2f}x (per plan compiled "
                         f"{search_ratios[name]['per_program']:.2f}x); {verdict} the goal of at most "
                         f"{results['search_goal']}x")
        lines += ["", "Stage 1's candidates do not grow with depth once tied; how many plans a search compiles "
                  "still depends on what it finds: where the first and last blocks are refined to precisions of "
                  "their own, Stage 2 times the ops between them, each a plan compiled. Per plan, the compile "
                  "seconds compare the cost of depth itself."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEPTHS))
    parser.add_argument("--inner", default="inductor", help="the inner backend (aot_eager for a quick check)")
    parser.add_argument("--steps", type=int, default=3, help="steady steps after the first")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of compiles (their median is reported)")
    parser.add_argument("--no-search", action="store_true", help="skip the compiled searches")
    parser.add_argument("--search-rounds", type=int, default=1, help="rounds of compiled searches")
    parser.add_argument("--search-budget", type=int, nargs=2, metavar=("STAGE1", "STAGE2"),
                        help="the searches' stage1_budget and stage2_budget (a quick check; default: SearchConfig's)")
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
            budgets = (dict(zip(("stage1_budget", "stage2_budget"), args.search_budget)) if args.search_budget
                       else None)
            results = measure(args.layers, inner=args.inner, steps=args.steps, rounds=args.rounds,
                              search=not args.no_search, search_rounds=args.search_rounds, search_budgets=budgets)
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
