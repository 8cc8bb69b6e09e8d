"""What the capture verification costs, in seconds and in FP32 training steps (a benchmark, not a test).

``compfx.analyze`` (and so ``optimize``, ``apply`` and the callbacks) checks the
captured graph against the model before planning: one forward and backward of
the eager model and one of the graph on the example inputs, compared bitwise
(:mod:`compfx.graph_capture.verify`). This measures that check on BERT-base
(``transformers.BertForSequenceClassification`` from its default config: 12
layers, hidden 768; no download), batch 8, sequence 32, with labels, in
training mode.

Each of ``--rounds`` rounds, interleaved so that the machine's load hits all
alike, times: ``--steps`` FP32 training steps of the model (forward, backward,
SGD step; their median is the round's step), ``compfx.analyze(...,
verify=False)`` and ``compfx.analyze(...)`` (verified). The verification's cost
is the time the check itself reports (``Analysis.verification.seconds``); the
difference of the two analyses is printed beside it as a cross-check. Figures
are medians over rounds with their min-max range; the first round is a warm-up
and not counted.

Run from the repository root::

    python -m benchmarks.verify_cost                # BERT-base, 5 rounds
    python -m benchmarks.verify_cost --tiny         # a 2-layer BERT: checks that the script runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from pathlib import Path

import torch

import compfx
from compfx.files import write_json_atomic

__all__ = ["bert", "fp32_step_seconds", "measure", "markdown", "main"]


def bert(tiny: bool = False):
    """BERT for sequence classification from a config (BERT-base, or a 2-layer hidden-32 one); training mode."""
    import transformers

    sizes = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                 vocab_size=64) if tiny else {}
    config = transformers.BertConfig(num_labels=2, problem_type="single_label_classification", **sizes)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def _batch(model, batch: int, length: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, model.config.vocab_size, (batch, length), generator=g),
            "labels": torch.randint(0, 2, (batch,), generator=g)}


def fp32_step_seconds(model, batch: dict, steps: int) -> float:
    """Median seconds of an eager FP32 training step (forward, backward, SGD step) on ``batch``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights, and so the captures, stay put
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _analyze_seconds(model, batch: dict, verify: bool) -> tuple[float, compfx.Analysis]:
    gc.collect()
    start = time.perf_counter()
    analysis = compfx.analyze(model, batch, verify=verify)
    return time.perf_counter() - start, analysis


def measure(model, batch: dict, *, rounds: int, steps: int) -> dict:
    """Interleaved rounds of FP32 steps, an unverified and a verified analysis (see the module docstring)."""
    per_round = []
    for _ in range(rounds + 1):  # the first round warms caches and allocators up
        step = fp32_step_seconds(model, batch, steps)
        plain, _ = _analyze_seconds(model, batch, verify=False)
        verified, analysis = _analyze_seconds(model, batch, verify=True)
        check = analysis.verification
        per_round.append({"fp32_step": step, "analyze_unverified": plain, "analyze_verified": verified,
                          "verification": check.seconds, "verification_in_steps": check.seconds / step,
                          "exact": check.exact, "summary": check.summary()})
    counted = per_round[1:]
    return {"rounds": len(counted), "steps_per_round": steps, "per_round": counted,
            **{name: spread_of([r[name] for r in counted])
               for name in ("fp32_step", "analyze_unverified", "analyze_verified", "verification",
                            "verification_in_steps")},
            "analyze_difference": spread_of([r["analyze_verified"] - r["analyze_unverified"] for r in counted])}


def spread_of(values: list[float]) -> dict:
    """Median and min-max of ``values``.

    >>> spread_of([3.0, 1.0, 2.0])
    {'median': 2.0, 'min': 1.0, 'max': 3.0}
    """
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _range(figures: dict, unit: str = " s", digits: int = 2) -> str:
    return (f"{figures['median']:.{digits}f}{unit} (range {figures['min']:.{digits}f}-{figures['max']:.{digits}f}"
            f"{unit})")


def markdown(result: dict) -> str:
    """The results as a markdown table: median and range over the rounds.

    >>> spread = {"median": 2.0, "min": 1.5, "max": 2.5}
    >>> print(markdown({"verification": spread, "verification_in_steps": spread, "fp32_step": spread,
    ...                 "analyze_unverified": spread, "analyze_verified": spread}).splitlines()[2])
    | the verification | 2.00 s | 1.50-2.50 s |
    """
    def cells(figures: dict, unit: str = " s", digits: int = 2) -> str:
        return (f"{figures['median']:.{digits}f}{unit} | {figures['min']:.{digits}f}-{figures['max']:.{digits}f}"
                f"{unit}")

    off, on = result["analyze_unverified"], result["analyze_verified"]
    return "\n".join([
        "| | median | range |", "|---|---|---|",
        f"| the verification | {cells(result['verification'])} |",
        f"| the same, in FP32 training steps (forward, backward, SGD step) | "
        f"{cells(result['verification_in_steps'], ' steps')} |",
        f"| one FP32 training step | {cells(result['fp32_step'])} |",
        f"| `compfx.analyze` without / with verification | {off['median']:.2f} s / {on['median']:.2f} s | "
        f"{off['min']:.2f}-{off['max']:.2f} s / {on['min']:.2f}-{on['max']:.2f} s |",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=5, help="FP32 steps per round (their median is the round's)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer BERT instead of BERT-base (a smoke run)")
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model = bert(tiny=args.tiny)
    batch = _batch(model, args.batch, args.length)
    result = measure(model, batch, rounds=args.rounds, steps=args.steps)
    result.update(model=f"BertForSequenceClassification ({'2 layers, hidden 32' if args.tiny else 'BERT-base'}), "
                        f"batch {args.batch}, sequence {args.length}, training mode",
                  torch=torch.__version__, threads=torch.get_num_threads())
    print(result["model"], f"- {result['rounds']} interleaved rounds, {torch.get_num_threads()} thread(s)")
    print(f"  FP32 training step:        {_range(result['fp32_step'], digits=3)}")
    print(f"  capture verification:      {_range(result['verification'])} = "
          f"{_range(result['verification_in_steps'], ' FP32 steps', 1)}")
    print(f"  analyze, verified:         {_range(result['analyze_verified'])}; unverified: "
          f"{_range(result['analyze_unverified'])}; difference {_range(result['analyze_difference'])}")
    print(f"  {result['per_round'][-1]['summary']}")
    if args.out:
        write_json_atomic(Path(args.out), result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
