"""Tensor Core shape padding on a model with unfit shapes: one plan, with and without padding, timed in turns.

::

    python -m benchmarks.padding [--smoke] [--device cuda] [--rounds 5] [--steps 5]

The model is the GPT-style decoder (:mod:`benchmarks.models.gpt`) with GPT-2's own vocabulary of 50,257 tokens
(the suite's GPT row rounds it up to 50,304, a multiple of 64, for exactly this reason). Its LM head, 768 ->
50,257 and tied to the token embedding, misses the Tensor Core rule in ``out_features``; every other GEMM fits.
The plan is AMP's (``Plan.amp``: whitelist ops low); the padded plan is the same plan with every op the analysis
marks ``pad_eligible`` padded (``Plan.with_padding``). Both modules share the model's Parameters and train on the
same batch; they take turns, ``rounds`` times, each turn the median of ``steps`` device-synchronised training steps
after one untimed step. Reported: every round's median, the median of those, the ratio, and a verdict by the
search's own rule (:mod:`compfx.search.padding`): "padded faster" only when every padded round beat every unpadded
one, "padded slower" the other way round, else "no measurable difference". The cost model's prediction for each
padded op alone (:func:`compfx.costmodel.profile_padding`) is listed beside it.

The GPU suite runs it as its padding row (``benchmarks.gpu_bench``); ``--smoke`` runs tiny shapes on any device.
Off a GPU with Tensor Cores the times mean nothing for the question (there is nothing for padding to reach), and
the result says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

import compfx
from compfx.costmodel import profile_padding
from compfx.measure import time_repeats
from compfx.search.padding import padding_candidates
from compfx.tensor_cores import device_tensor_core_reason

from .models.gpt import GPT

__all__ = ["run", "verdict", "markdown", "main", "MODEL"]

#: The row's model name in the GPU suite.
MODEL = "gpt_vocab50257"
#: (model config, batch size): GPT-2 small with its real vocabulary on a GPU; tiny, and as unfit, for the smoke run
_GPU = (dict(vocab=50257, seq_len=1024, dim=768, heads=12, layers=12), 8)
_SMOKE = (dict(vocab=131, seq_len=32, dim=32, heads=2, layers=2), 4)
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def verdict(unpadded: list[float], padded: list[float]) -> str:
    """The search's rule on round medians: a difference the rounds' spread could explain is no difference.

    >>> verdict([10.0, 10.2, 10.1], [9.0, 9.1, 9.3]), verdict([10.0, 10.2], [10.1, 9.9])
    ('padded faster', 'no measurable difference')
    """
    if max(padded) < min(unpadded):
        return "padded faster"
    if min(padded) > max(unpadded):
        return "padded slower"
    return "no measurable difference"


def run(*, smoke: bool = False, device: str | None = None, low: str = "fp16", rounds: int = 5,
        steps: int = 5) -> dict:
    """Measure the plan with and without padding; returns the result (what ``padding.json`` holds).

    >>> result = run(smoke=True, device="cpu", rounds=1, steps=1)  # doctest: +SKIP
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[low]
    config, batch_size = _SMOKE if smoke else _GPU
    torch.manual_seed(0)
    model = GPT(**config).to(device)
    ids = torch.randint(0, config["vocab"], (batch_size, config["seq_len"] + 1),
                        generator=torch.Generator().manual_seed(0)).to(device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    analysis = compfx.analyze(model, (inputs,), low_dtype=dtype)
    plan = compfx.Plan.amp(analysis)
    keys = padding_candidates(analysis, plan)
    padded = plan.with_padding(keys, analysis=analysis)
    modules = {"unpadded": compfx.apply(model, plan, analysis=analysis),
               "padded": compfx.apply(model, padded, analysis=analysis)}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16 and device.type == "cuda")

    def training_step(module):
        def step(i):
            loss = F.cross_entropy(module(inputs).flatten(0, 1).float(), targets.flatten())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        return step

    medians: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(rounds):  # turns: drift on a busy device hits both alike
        for name, module in modules.items():
            medians[name].append(time_repeats(training_step(module), warmup=1, repeats=steps, device=device).median)
    predicted = profile_padding(analysis, keys, use_cache=False)
    no_tensor_cores = device_tensor_core_reason(
        device=device, low_dtype=dtype,
        capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
    unpadded_ms = [s * 1e3 for s in medians["unpadded"]]
    padded_ms = [s * 1e3 for s in medians["padded"]]
    infos = {op.key: op for op in analysis.ops}
    return {
        "benchmark": "benchmarks.padding", "device": compfx.measure.device_name(device), "low_dtype": low,
        "model": {"name": MODEL, **config, "batch_size": batch_size}, "plan": "Plan.amp",
        "padded_ops": {str(key): infos[key].pad_reason for key in keys},
        "rounds": rounds, "steps_per_round": steps,
        "unpadded_ms": unpadded_ms, "padded_ms": padded_ms,
        "unpadded_median_ms": statistics.median(unpadded_ms), "padded_median_ms": statistics.median(padded_ms),
        "speedup": statistics.median(unpadded_ms) / statistics.median(padded_ms),
        "verdict": verdict(unpadded_ms, padded_ms),
        "predicted": {str(key): {"unpadded_ms": p.low_s * 1e3, "padded_ms": p.padded_s * 1e3,
                                 "skipped": p.skipped} for key, p in predicted.items()},
        "times_mean_nothing": no_tensor_cores is not None,
        "note": (f"{no_tensor_cores}: padding has no Tensor Cores to reach here, so these times only show that "
                 "both plans train" if no_tensor_cores else "Tensor Cores present for the low dtype"),
        "torch": torch.__version__,
    }


def _ms_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def markdown(result: dict) -> str:
    """The result as a short markdown section (the GPU suite's "Shape padding" part shows the same table)."""
    model = result["model"]
    lines = [f"# Shape padding on {result['device']}", "",
             f"{model['name']}: the GPT-style decoder with a vocabulary of {model['vocab']} (not a multiple of 8), "
             f"{model['layers']} layers, dim {model['dim']}, batch {model['batch_size']}x{model['seq_len']}; "
             f"{result['steps_per_round']} timed steps per round. **{result['note']}.**", "", table(result)]
    return "\n".join(lines) + "\n"


def table(result: dict) -> str:
    """One markdown table row per plan: step ms (median and range over rounds), ratio, verdict, padded ops."""
    predicted = "; ".join(f"{key}: {p['unpadded_ms']:.3g} -> {p['padded_ms']:.3g} ms" if not p["skipped"]
                          else f"{key}: {p['skipped']}" for key, p in result["predicted"].items())
    return "\n".join([
        f"| plan ({result['low_dtype']}) | step ms, median (range) over {result['rounds']} rounds | x unpadded | "
        "padded ops | cost model, op alone |",
        "|---|---|---|---|---|",
        f"| {result['plan']} | {_ms_range(result['unpadded_ms'])} | 1.00 | none | |",
        f"| {result['plan']}, padded | {_ms_range(result['padded_ms'])} | {result['speedup']:.2f} "
        f"({result['verdict']}) | " + ", ".join(f"{k} ({why})" for k, why in result["padded_ops"].items())
        + f" | {predicted} |"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, whatever the device")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--low", choices=sorted(_DTYPES), default="fp16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = run(smoke=args.smoke, device=args.device, low=args.low, rounds=args.rounds, steps=args.steps)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
