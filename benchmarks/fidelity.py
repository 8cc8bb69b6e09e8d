"""Does a compfx plan train as well as FP32? Final held-out accuracy / perplexity over seeds, five ways.

Two models on data that ships with packages, each trained from the same
initial weights, on the same batches, in five modes:

* ``fp32``: plain FP32;
* ``amp``: ``torch.autocast`` in the low dtype (with ``GradScaler`` for fp16);
* ``all_low``: the plan that runs every op in the low dtype;
* ``compfx``: the plan ``compfx.optimize`` picks with a ``cost_fn`` that rewards
  low precision (the count of ops not running low; seconds only break ties),
  so that the convergence guard, not this CPU's slow low precision, decides;
* ``compfx_guard``: that same plan trained under :class:`compfx.Guard`.

The digits CNN (``compfx.examples.cnn``) is scored by accuracy on the whole
held-out split of scikit-learn's digits (360 images); a small GPT
(``benchmarks.models.gpt``) by perplexity on every non-overlapping window of
the held-out tenth of Python's own source text (``benchmarks.data``)::

    python -m benchmarks.fidelity --seeds 0 1 2 --out benchmarks/results/cpu

writes ``fidelity.json`` and ``fidelity.md`` there (mean, spread and each seed).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import compfx
from compfx.planned_module import PlannedModule
from compfx.examples import cnn
from compfx.files import write_json_atomic
from compfx.vocabulary import Precision, dtype_name

from . import data
from .models.gpt import GPT

__all__ = ["MODES", "Task", "reward_low_precision", "run", "main"]

MODES = ("fp32", "amp", "all_low", "compfx", "compfx_guard")


def reward_low_precision(plan, seconds: float) -> float:
    """A cost that falls with every op that runs low: what a device with fast low precision would reward.

    >>> import torch, compfx
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), torch.randn(1, 2))
    >>> reward_low_precision(compfx.Plan.uniform(a, "low"), 1.0) < reward_low_precision(compfx.Plan.fp32(a), 0.5)
    True
    """
    return sum(p is not Precision.LOW for p in plan.values()) + 1e-6 * seconds  # seconds: ties only, monotone


@dataclass
class Task:
    """One model and its data: how to build it, its batches, its loss and its held-out score."""

    name: str
    metric: str  # "accuracy" (higher is better) or "perplexity" (lower is better)
    build: Callable[[], nn.Module]
    train: list
    held_out: list
    loss: Callable
    lr: float

    def score(self, module: nn.Module) -> float:
        module.eval()
        try:
            with torch.no_grad():
                if self.metric == "accuracy":
                    hits = sum(int((module(x).argmax(-1) == y).sum()) for x, y in self.held_out)
                    return 100.0 * hits / sum(len(y) for _, y in self.held_out)
                total = sum(float(self.loss(module(x), (x, y))) * y.numel() for x, y in self.held_out)
                mean = total / sum(y.numel() for _, y in self.held_out)
                return math.exp(mean) if math.isfinite(mean) else math.inf
        finally:
            module.train()


def _nll(output, batch):
    return F.nll_loss(output.float(), batch[-1])  # the CNN returns log-probabilities


def _next_char(output, batch):
    return F.cross_entropy(output.float().flatten(0, 1), batch[-1].flatten())


def digits_task(batch_size: int = 64) -> Task:
    train_x, train_y = data.digits("train")
    eval_x, eval_y = data.digits("eval")
    train = data.image_batches(train_x, train_y, batch_size)
    held_out = [(eval_x[i:i + 120], eval_y[i:i + 120]) for i in range(0, len(eval_y), 120)]  # all 360
    return Task("digits_cnn", "accuracy", cnn, train, held_out, _nll, 2e-3)


def char_lm_task(seq_len: int = 32, batch_size: int = 16, batches: int = 30) -> Task:
    held = data._text_split(data.encode_ascii(data.stdlib_text()), "eval")
    windows = (len(held) - 1) // seq_len
    ids = held[:windows * seq_len + 1]
    x, y = ids[:-1].view(windows, seq_len), ids[1:].view(windows, seq_len)
    held_out = [(x[i:i + 64], y[i:i + 64]) for i in range(0, windows, 64)]  # every non-overlapping window
    train = data.char_lm_batches(seq_len, batch_size, batches, "train", seed=0)
    return Task("char_lm_gpt", "perplexity", lambda: GPT(data.VOCAB_SIZE, seq_len, 64, 4, 2), train, held_out,
                _next_char, 3e-3)


def _train(task: Task, module: nn.Module, model: nn.Module, epochs: int, low_dtype: torch.dtype, *,
           autocast: bool = False, guard_plan: bool = False) -> dict:
    """Train ``module`` (sharing ``model``'s Parameters); returns the score and what the run met."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=low_dtype == torch.float16 and module is not model)  # not in FP32
    guard = compfx.Guard(module, scaler=scaler) if guard_plan else None
    context = (lambda: torch.autocast("cpu", dtype=low_dtype)) if autocast else contextlib.nullcontext
    nonfinite = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in task.train:
            optimizer.zero_grad(set_to_none=True)
            with context():
                loss = task.loss(module(batch[0]), batch)
            nonfinite += not bool(torch.isfinite(loss))
            scaler.scale(loss).backward()
            if guard is not None:
                guard.step(optimizer, loss)
            else:
                scaler.step(optimizer)
                scaler.update()
    seconds = time.perf_counter() - start
    if autocast:
        with torch.autocast("cpu", dtype=low_dtype):
            score = task.score(module)
    else:
        score = task.score(module)
    result = {"score": score, "nonfinite_losses": nonfinite, "train_seconds": round(seconds, 2)}
    if guard is not None:
        result["repairs"] = [r.to_dict() for r in guard.repairs]
        result["skipped"] = guard.skipped
    return result


class _Autocast(nn.Module):
    """The model itself, as a distinct module object (so that AMP gets its GradScaler, FP32 none)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model(*args)


def _fresh(task: Task, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return task.build()


def run_seed(task: Task, seed: int, epochs: int, low_dtype: torch.dtype, sample_batches: int) -> dict:
    """Every mode of one task from the same initial weights (seed)."""
    example = task.train[0][0]
    results = {}
    model = _fresh(task, seed)
    results["fp32"] = _train(task, model, model, epochs, low_dtype)
    model = _fresh(task, seed)
    results["amp"] = _train(task, _Autocast(model), model, epochs, low_dtype, autocast=True)
    model = _fresh(task, seed)
    analysis = compfx.analyze(model, example, low_dtype=low_dtype)
    results["all_low"] = _train(task, PlannedModule(model, compfx.Plan.uniform(analysis, Precision.LOW),
                                                    analysis=analysis), model, epochs, low_dtype)
    model = _fresh(task, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr)
    config = compfx.SearchConfig(seed=seed, progress=False, cost_fn=reward_low_precision,
                                 keep_search_training=False, cache_plan=False)
    start = time.perf_counter()
    searched = compfx.optimize(model, task.train[:sample_batches], loss_fn=task.loss, optimizer=optimizer,
                               low_dtype=low_dtype, config=config)
    search_seconds = time.perf_counter() - start
    plan = searched.plan
    results["compfx"] = _train(task, searched.module, model, epochs, low_dtype)
    results["compfx"].update(search_seconds=round(search_seconds, 2), plan=plan.bitstring(searched.analysis),
                             low_ops=sum(p is Precision.LOW for p in plan.values()), ops=len(plan))
    model = _fresh(task, seed)
    analysis = compfx.analyze(model, example, low_dtype=low_dtype)
    results["compfx_guard"] = _train(task, PlannedModule(model, plan, analysis=analysis), model, epochs, low_dtype,
                                     guard_plan=True)
    return results


def summarise(task: Task, per_seed: dict[int, dict]) -> dict:
    """Per mode: mean, sample standard deviation, min and max of the score across seeds, and the mean's gap to FP32."""
    summary = {}
    for mode in MODES:
        scores = [per_seed[s][mode]["score"] for s in per_seed]
        finite = all(math.isfinite(s) for s in scores)
        mean = statistics.fmean(scores) if finite else math.inf
        summary[mode] = {"mean": mean, "std": statistics.stdev(scores) if finite and len(scores) > 1 else 0.0,
                         "min": min(scores), "max": max(scores), "scores": scores}
    for mode in MODES:
        summary[mode]["vs_fp32"] = summary[mode]["mean"] - summary["fp32"]["mean"]
    return summary


def run(tasks: list[Task], seeds: list[int], epochs: dict[str, int], low_dtype: torch.dtype,
        sample_batches: int) -> dict:
    results = {"low_dtype": dtype_name(low_dtype), "seeds": seeds, "epochs": epochs, "sample_batches": sample_batches,
               "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "tasks": {}}
    for task in tasks:
        per_seed = {}
        for seed in tqdm(seeds, desc=task.name):
            per_seed[seed] = run_seed(task, seed, epochs[task.name], low_dtype, sample_batches)
        results["tasks"][task.name] = {"metric": task.metric, "train_batches": len(task.train),
                                       "held_out_examples": sum(len(y) for _, y in task.held_out),
                                       "per_seed": per_seed, "summary": summarise(task, per_seed)}
    return results


def markdown(results: dict) -> str:
    lines = [f"Low dtype {results['low_dtype']}, seeds {results['seeds']}, epochs {results['epochs']}, "
             f"{results['threads']} thread(s), torch {results['torch']}. Mean ± sample std over seeds [min, max]; "
             "Δ = mean - FP32's mean.", "",
             "| model | metric | mode | mean ± std | [min, max] | Δ vs FP32 | non-finite losses | guard repairs |",
             "|---|---|---|---|---|---|---|---|"]
    for name, task in results["tasks"].items():
        for mode in MODES:
            s = task["summary"][mode]
            runs = [task["per_seed"][seed][mode] for seed in task["per_seed"]]
            repairs = sorted({r["key"] for run_ in runs for r in run_.get("repairs", [])})
            lines.append(f"| {name} | {task['metric']} | {mode} | {s['mean']:.2f} ± {s['std']:.2f} | "
                         f"[{s['min']:.2f}, {s['max']:.2f}] | {s['vs_fp32']:+.2f} | "
                         f"{sum(r['nonfinite_losses'] for r in runs)} | "
                         f"{', '.join(repairs) if mode == 'compfx_guard' else ''} |")
    lines.append("")
    for name, task in results["tasks"].items():
        plans = {seed: task["per_seed"][seed]["compfx"] for seed in task["per_seed"]}
        lines.append(f"{name}: searched plans (low ops / ops): " + ", ".join(
            f"seed {seed} {p['low_ops']}/{p['ops']} `{p['plan']}`" for seed, p in plans.items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--digits-epochs", type=int, default=3)
    parser.add_argument("--lm-epochs", type=int, default=3)
    parser.add_argument("--lm-batches", type=int, default=30, help="training batches per LM epoch")
    parser.add_argument("--sample-batches", type=int, default=4, help="the search's sample loader")
    parser.add_argument("--low-dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tasks", nargs="+", default=["digits_cnn", "char_lm_gpt"])
    parser.add_argument("--out", default="benchmarks/results/cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    low_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.low_dtype]
    builders = {"digits_cnn": digits_task, "char_lm_gpt": lambda: char_lm_task(batches=args.lm_batches)}
    tasks = [builders[name]() for name in args.tasks]
    epochs = {"digits_cnn": args.digits_epochs, "char_lm_gpt": args.lm_epochs}
    results = run(tasks, args.seeds, epochs, low_dtype, args.sample_batches)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "fidelity.json", results, "fidelity results")
    (out / "fidelity.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
