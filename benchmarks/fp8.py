"""FP8 on a GPT-style decoder: bf16 AMP, torchao float8 (all linears), compfx (searched FP8 / bf16 / FP32).

::

    python -m benchmarks.fp8 [--smoke] [--out ROOT]

Every mode trains the same model copy on the same batches; step times are medians of device-synchronised
steps (:func:`compfx.measure.time_repeats`), and the final loss of a short run is kept beside them. compfx
searches with ``SearchConfig(fp8=True)`` and the measured seconds as its cost.

Only a GPU of compute capability 8.9+ (H100, L4, RTX 40xx) runs float8 GEMMs. Elsewhere torchao emulates them
in high precision: the script still runs (on CPU, tiny shapes), checks that every path trains, and says that
its times mean nothing. Results: ``ROOT/<device>/fp8.json`` and ``fp8.md`` (default ROOT ``benchmarks/results``;
the CPU folder is ``cpu``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import compfx
from compfx.float8 import fp8_runs_natively, require_torchao
from compfx.measure import time_repeats

from .models.gpt import GPT

__all__ = ["run", "main"]

_ROOT = Path(__file__).parent / "results"
#: (model config, batch size, batches, steps timed) on a GPU and on CPU (emulated: tiny, only to show it runs)
_GPU = (dict(vocab=50304, seq_len=1024, dim=768, heads=12, layers=12), 8, 8, 20)
_CPU = (dict(vocab=256, seq_len=32, dim=64, heads=4, layers=2), 8, 4, 3)


def _batches(config: dict, batch_size: int, n: int, device) -> list:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab"], (n, batch_size, config["seq_len"] + 1), generator=g)
    return [(b[:, :-1].contiguous().to(device), b[:, 1:].contiguous().to(device)) for b in ids]


def _loss(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[-1].flatten())


def _measure(module, model, batches, *, autocast: bool, device, steps: int) -> dict:
    """Median step time and the mean loss over the batches (one pass), training ``model``'s own parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []

    def step(i):
        batch = batches[i % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(module(batch[0]), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    timing = time_repeats(step, warmup=1, repeats=steps, device=device)
    return {"step_ms": timing.median * 1e3, "mean_loss": statistics.fmean(losses)}


def run(*, smoke: bool = False, device: str | None = None) -> dict:
    """Measure the three modes; returns the result dict (what ``fp8.json`` holds).

    >>> result = run(smoke=True)  # doctest: +SKIP
    """
    float8 = require_torchao()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    native = fp8_runs_natively(device)
    config, batch_size, n_batches, steps = _GPU if native and not smoke else _CPU
    batches = _batches(config, batch_size, n_batches, device)
    torch.manual_seed(0)
    base = GPT(**config).to(device)
    rows = {}

    model = copy.deepcopy(base)
    rows["bf16 AMP"] = _measure(model, model, batches, autocast=True, device=device, steps=steps)

    model = copy.deepcopy(base)
    fp8_config = float8.Float8LinearConfig(emulate=not native)
    converted = float8.convert_to_float8_training(model, config=fp8_config)  # every nn.Linear: torchao's default
    rows["torchao float8 (all linears)"] = _measure(converted, converted, batches, autocast=False, device=device,
                                                    steps=steps)

    model = copy.deepcopy(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    search = compfx.optimize(model, batches, optimizer=optimizer, loss_fn=_loss, config=compfx.SearchConfig(
        fp8=True, progress=False, warmup=1, repeats=2, stage1_budget=16, stage2_budget=4, cache_plan=False))
    model.load_state_dict(base.state_dict())  # the same start as the other modes
    counts = {str(p): sum(v is p for v in search.plan.values()) for p in set(search.plan.values())}
    rows["compfx (searched)"] = {**_measure(search.module, model, batches, autocast=False, device=device,
                                            steps=steps),
                                 "plan": search.plan.bitstring(search.analysis), "precisions": counts,
                                 "fp8_recipe": str(search.plan.fp8_recipe), "search_s": search.search_seconds}
    return {"benchmark": "benchmarks.fp8", "device": compfx.measure.device_name(device), "native_fp8": native,
            "model": {"name": "gpt", **config, "batch_size": batch_size}, "steps_timed": steps,
            "torch": torch.__version__, "torchao": getattr(sys.modules.get("torchao"), "__version__", "?"),
            "times_mean_nothing": not native,
            "note": ("float8 GEMMs run natively" if native else
                     "no float8 GEMMs on this device: torchao emulates them in high precision, so these times "
                     "mean nothing; the run only shows that each path trains"),
            "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# FP8 on {result['device']} ({result['model']['name']}, {result['model']['layers']} layers, "
             f"dim {result['model']['dim']})", "", f"**{result['note']}.**", "",
             "| mode | step (ms) | mean loss | plan |", "|---|---|---|---|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['step_ms']:.2f} | {row['mean_loss']:.4f} | {row.get('plan', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, whatever the device")
    parser.add_argument("--out", default=str(_ROOT), help="results root (a <device> folder is made in it)")
    args = parser.parse_args(argv)
    result = run(smoke=args.smoke)
    folder = Path(args.out) / ("cpu" if not torch.cuda.is_available() else
                               compfx.measure.hardware_name("cuda").lower().replace(" ", "-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fp8.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / "fp8.md").write_text(markdown(result))
    print(markdown(result))
    print(f"written to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
