"""How long capture takes on a real model, and what variable input shapes cost per step (a benchmark, not a test).

**Capture + analysis** of BERT-base (``transformers.BertForSequenceClassification``
from its default config: 12 layers, hidden 768; no download), batch 8, sequence
32, with labels, in training mode: ``compfx.analyze`` as a user calls it
(``method="auto"``: symbolic tracing cannot follow Hugging Face's ``forward``,
so the recording tracer captures it), and, for comparison, with
``torch._dynamo.export`` (``method="dynamo"``, the path Hugging Face models took
before the recording tracer). Each is timed ``--repeats`` times in this process
(the first run is reported apart: it pays imports and caches); ``apply`` of
``Plan.amp`` is timed too.

**Variable shapes.** A recorded graph is specialised to its inputs' shapes;
:class:`compfx.planned_module.PlannedModule` (``compfx.optimize(...).module``) keeps one
planned graph per input signature, made on first use. Its costs, on a tiny
BERT and a tiny GPT-2 (2 layers, hidden 32; training steps of a few ms, where
any per-step overhead shows) and on BERT-base:

* ``dispatch_us``: what every call pays, computing the signature and finding
  its graph (microseconds; median of many calls);
* ``step_ratio_known_signature``: a training step through the PlannedModule
  against the same step through its GraphModule directly (interleaved, median
  of ``--ab-steps``);
* ``new_signature_seconds``: the first call with a new sequence length: capture
  plus rewrite, paid once per signature (and per plan, for the rewrite);
* ``varying_run``: ``--steps`` steps whose sequence length cycles through
  four lengths, against the same steps again once every graph exists: the
  extra seconds, per new length and per step amortised (median of 3 rounds).

Run from the repository root::

    python -m benchmarks.capture_speed           # writes benchmarks/results/cpu/capture_speed.json
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

import compfx
from compfx.analysis import analyze_graph
from compfx.planned_module import PlannedModule
from compfx.graph_capture import input_signature
from compfx.files import write_json_atomic

__all__ = ["bert", "gpt2", "time_capture", "shape_costs", "markdown", "main"]


def bert(layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 30522):
    """BERT for sequence classification from a config (BERT-base by default); in training mode."""
    import transformers

    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                     intermediate_size=4 * hidden, vocab_size=vocab, num_labels=2,
                                     problem_type="single_label_classification")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def gpt2(layers: int = 2, hidden: int = 32, heads: int = 2, vocab: int = 64):
    """GPT-2 with a language-model head from a config (tiny by default); in training mode."""
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def _batch(model, batch: int, length: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + batch * 100 + length)
    ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=g)
    labels = ids if model.config.model_type == "gpt2" else torch.randint(0, 2, (batch,), generator=g)
    return {"input_ids": ids, "labels": labels}


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> dict:
    wall, cpu = _clock()
    return {"wall": wall - start[0], "cpu": cpu - start[1]}


def time_capture(model, inputs: dict, method: str, repeats: int) -> dict:
    """Seconds of ``compfx.capture`` + analysis (wall and process CPU): first run, then the median of the rest."""
    runs = []
    for _ in range(repeats + 1):
        gc.collect()
        start = _clock()
        graph = compfx.capture(model, inputs, method=method)
        analysis = analyze_graph(graph, device=torch.device("cpu"), low_dtype=torch.bfloat16)
        runs.append(_since(start))
    rest = runs[1:] or runs
    return {"method": graph.meta["compfx_capture_method"], "ops": len(analysis.ops), "first": runs[0],
            "median_wall": statistics.median(r["wall"] for r in rest),
            "median_cpu": statistics.median(r["cpu"] for r in rest), "runs": len(rest)}


def _step(module, optimizer, batch) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = module(**batch).loss
    loss.backward()
    optimizer.step()
    return float(loss)


def _median_step(module, optimizer, batch, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(module, optimizer, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shape_costs(model, *, batch: int, lengths: list[int], steps: int, ab_steps: int, rounds: int = 3) -> dict:
    """The costs of variable shapes for one model (see the module docstring)."""
    first = _batch(model, batch, lengths[0])
    analysis = compfx.analyze(model, first)
    plan = compfx.Plan.fp32(analysis)
    planned = PlannedModule(model, plan, analysis=analysis)
    graph = planned.graphs[analysis.example_signature]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    signature_calls = 2000
    args, kwargs = (), first
    start = time.perf_counter()
    for _ in range(signature_calls):
        planned._graphs.get(input_signature(args, kwargs, planned.training))
    dispatch_us = (time.perf_counter() - start) / signature_calls * 1e6

    _step(planned, optimizer, first), _step(graph, optimizer, first)  # warm both
    direct, through = [], []
    for _ in range(ab_steps):  # interleaved: the machine's load hits both alike
        direct.append(_median_step(graph, optimizer, first, 1))
        through.append(_median_step(planned, optimizer, first, 1))
    direct_s, through_s = statistics.median(direct), statistics.median(through)

    new = []
    for length in lengths[1:]:
        start = time.perf_counter()
        planned.specialize((), _batch(model, batch, length))
        new.append(time.perf_counter() - start)

    batches = [_batch(model, batch, lengths[i % len(lengths)], seed=1) for i in range(steps)]
    runs, spec = [], []
    for _ in range(rounds):  # the median round: a shared machine's load comes and goes
        fresh = PlannedModule(model, plan, analysis=analysis)  # has seen only the first signature
        gc.collect()
        start = time.perf_counter()
        for b in batches:
            _step(fresh, optimizer, b)
        varying = time.perf_counter() - start
        # the same steps again, every graph built now: the difference is what specialising cost
        start = time.perf_counter()
        for b in batches:
            _step(fresh, optimizer, b)
        runs.append((varying - (time.perf_counter() - start), varying, time.perf_counter() - start))
        spec += fresh.specializations
    extra, varying, warm = sorted(runs)[len(runs) // 2]
    return {
        "ops": len(analysis.ops), "capture_method": analysis.capture_method, "batch": batch, "lengths": lengths,
        "dispatch_us": dispatch_us,
        "step_seconds_graph_module": direct_s, "step_seconds_planned_module": through_s,
        "step_ratio_known_signature": through_s / direct_s,
        "new_signature_seconds": new, "new_signature_capture_seconds": [s.capture_seconds for s in spec],
        "new_signature_rewrite_seconds": [s.rewrite_seconds for s in spec],
        "varying_run": {"steps": steps, "rounds": rounds, "seconds_first_pass": varying,
                        "seconds_all_graphs_built": warm, "extra_seconds": extra,
                        "extra_per_step_seconds": extra / steps, "signatures": len(lengths),
                        "extra_per_new_signature_seconds": extra / max(1, len(lengths) - 1)},
    }


def run(repeats: int, steps: int, threads: int | None, ab_steps: int = 200) -> dict:
    if threads:
        torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    base = bert()
    inputs = _batch(base, 8, 32)
    result = {
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "threads": torch.get_num_threads(),
        "bert_base": {"model": "BertForSequenceClassification, default config (12 layers, hidden 768), batch 8, "
                               "sequence 32, training mode",
                      "auto": time_capture(base, inputs, "auto", repeats),
                      "dynamo": time_capture(base, inputs, "dynamo", max(1, repeats // 2))},
    }
    analysis = compfx.analyze(base, inputs)
    start = time.perf_counter()
    compfx.apply(base, compfx.Plan.amp(analysis), analysis=analysis)
    result["bert_base"]["apply_amp_seconds"] = time.perf_counter() - start
    result["shapes"] = {
        "bert_tiny": shape_costs(bert(layers=2, hidden=32, heads=2, vocab=64), batch=8, lengths=[16, 24, 32, 12],
                                 steps=steps, ab_steps=ab_steps),
        "gpt2_tiny": shape_costs(gpt2(), batch=8, lengths=[16, 24, 32, 12], steps=steps, ab_steps=ab_steps),
        # one-second steps: the per-step A/B would only show the machine's noise; a few steps say as much
        "bert_base": shape_costs(base, batch=8, lengths=[32, 24, 16], steps=6, ab_steps=3, rounds=1),
    }
    return result


_SHAPE_MODELS = {"bert_tiny": "tiny BERT", "gpt2_tiny": "tiny GPT-2", "bert_base": "BERT-base"}


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def _varying(figures: dict) -> str:
    run_ = figures["varying_run"]
    per_step = (f", {run_['extra_per_step_seconds'] * 1e3:.1f} ms/step" if run_["steps"] >= 10 else "")
    return (f"{run_['steps']} steps, {run_['signatures']} lengths: +{run_['extra_seconds']:.2f} s "
            f"({run_['extra_per_new_signature_seconds']:.2f} s a length{per_step})")


def markdown(result: dict) -> str:
    """Two markdown tables: BERT-base's capture by tracer, and what a ``PlannedModule`` costs per input signature."""
    bert_base = result["bert_base"]
    lines = ["| BERT-base: capture + analysis | graph from | first call | median of the later calls |",
             "|---|---|---|---|"]
    for method in ("auto", "dynamo"):
        figures = bert_base[method]
        lines.append(f"| `method=\"{method}\"` | {figures['method']} tracer | {figures['first']['wall']:.2f} s | "
                     f"{figures['median_wall']:.2f} s ({figures['runs']} calls) |")
    lines += ["", f"`compfx.apply` of `Plan.amp` to BERT-base: {bert_base['apply_amp_seconds']:.2f} s.", ""]
    shapes = {name: result["shapes"][name] for name in _SHAPE_MODELS if name in result["shapes"]}
    lines += ["| | " + " | ".join(_SHAPE_MODELS[name] for name in shapes) + " |", "|---" * (len(shapes) + 1) + "|"]
    rows = {
        "every step, known signature: dispatch": lambda f: f"{f['dispatch_us']:.1f} us",
        "step through `PlannedModule` / through its graph (interleaved)":
            lambda f: f"{f['step_ratio_known_signature']:.3f}x of {_seconds(f['step_seconds_graph_module'])}",
        "a new signature: capture + rewrite (medians)":
            lambda f: (f"{statistics.median(f['new_signature_capture_seconds']):.3f} + "
                       f"{statistics.median(f['new_signature_rewrite_seconds']):.3f} s"),
        "steps cycling over sequence lengths: extra": _varying,
    }
    for label, cell in rows.items():
        lines.append(f"| {label} | " + " | ".join(cell(figures) for figures in shapes.values()) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed captures after the first")
    parser.add_argument("--steps", type=int, default=40, help="training steps of the varying-length run")
    parser.add_argument("--ab-steps", type=int, default=200,
                        help="interleaved steps per side of the PlannedModule vs GraphModule comparison")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0: leave as is; 1, the default, is steadiest on a shared machine)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu" / "capture_speed.json"))
    args = parser.parse_args(argv)
    result = run(args.repeats, args.steps, args.threads or None, args.ab_steps)
    bert_base = result["bert_base"]
    for method in ("auto", "dynamo"):
        figures = bert_base[method]
        print(f"BERT-base capture+analysis, {method:6s} ({figures['method']}, {figures['ops']} ops): first "
              f"{figures['first']['wall']:.2f} s, then median {figures['median_wall']:.2f} s wall, "
              f"{figures['median_cpu']:.2f} s CPU")
    print(f"BERT-base apply(Plan.amp): {bert_base['apply_amp_seconds']:.2f} s")
    for name, figures in result["shapes"].items():
        varying = figures["varying_run"]
        print(f"{name}: dispatch {figures['dispatch_us']:.1f} us/call; known-signature step "
              f"{figures['step_ratio_known_signature']:.3f}x the GraphModule's ({figures['step_seconds_graph_module'] * 1e3:.2f} ms); "
              f"new signature {statistics.median(figures['new_signature_seconds']):.3f} s (capture "
              f"{statistics.median(figures['new_signature_capture_seconds']):.3f} s, rewrite "
              f"{statistics.median(figures['new_signature_rewrite_seconds']):.3f} s); {varying['steps']} steps over "
              f"{varying['signatures']} lengths: +{varying['extra_seconds']:.2f} s "
              f"({varying['extra_per_new_signature_seconds']:.3f} s per new length, "
              f"{varying['extra_per_step_seconds'] * 1e3:.2f} ms/step amortised)")
    write_json_atomic(Path(args.out), result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
