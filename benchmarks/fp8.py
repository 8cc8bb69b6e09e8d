"""FP8 on a GPT-style decoder, in bf16 terms: bf16 AMP, torchao float8 (all linears), compfx's searched plan.

::

    python -m benchmarks.fp8 [--smoke] [--out ROOT]

Each contender runs the way its authors recommend, and the table says which:

* **bf16 AMP**: ``torch.autocast(dtype=torch.bfloat16)``, PyTorch's AMP recipe, eager (its reference) and
  under ``torch.compile``;
* **torchao float8**: ``convert_to_float8_training`` (every ``nn.Linear``, tensorwise scaling) under bf16
  autocast and ``torch.compile``, as torchao's float8 training README runs it (eager float8 is not its
  fast path: the scaling is left unfused);
* **compfx**: ``compfx.optimize(..., low_dtype=torch.bfloat16, config=SearchConfig(fp8=True))`` searches an
  FP8 / bf16 / FP32 plan, which then runs under ``torch.compile`` through ``compfx.compile_with_plan``.

Every contender starts from the same weights with its own AdamW, and its k-th step trains on the same batch.
After untimed warm-up steps (which compile), the contenders are timed **interleaved**: each round runs
every contender for a window of steps, in a rotated order, with the device synchronised only at the
window's ends (the losses are read after it); a row's step time is the median window's per-step time over
the rounds, with the fastest and slowest beside it. The mean loss is over every timed step.

Only a GPU of compute capability 8.9+ (H100, L4, RTX 40xx) runs float8 GEMMs. Elsewhere torchao emulates them
in high precision: the script still runs (on CPU, tiny shapes, ``aot_eager`` instead of Inductor), checks that
every path trains, and says that its times mean nothing. Results: ``ROOT/<device>/fp8.json`` and ``fp8.md``
(default ROOT ``benchmarks/results``; the CPU folder is ``cpu``). It needs torchao (``pip install compfx[fp8]``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import compfx
from compfx.compile_backend import compile_with_plan
from compfx.float8 import fp8_runs_natively, require_torchao
from compfx.measure import timed
from compfx.vocabulary import dtype_name

from .models.gpt import GPT

__all__ = ["run", "main", "markdown", "take_turns", "Contender", "batches_of", "gpt_loss", "compiler_of",
           "results_folder", "RESULTS_ROOT", "WARMUP_STEPS"]

RESULTS_ROOT = Path(__file__).parent / "results"
#: (model config, batch size, batches, rounds, steps per round) on a GPU and on CPU (emulated: tiny, only to show it runs)
_GPU = (dict(vocab=50304, seq_len=1024, dim=768, heads=12, layers=12), 8, 8, 5, 8)
_CPU = (dict(vocab=256, seq_len=32, dim=64, heads=4, layers=2), 8, 4, 2, 2)
WARMUP_STEPS = 3  # untimed: compiles, autotunes, creates the optimizer state


def batches_of(config: dict, batch_size: int, n: int, device) -> list:
    """``n`` batches of random token ids (inputs, next-token targets) for a GPT of ``config``, the same every run."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab"], (n, batch_size, config["seq_len"] + 1), generator=g)
    return [(b[:, :-1].contiguous().to(device), b[:, 1:].contiguous().to(device)) for b in ids]


def gpt_loss(logits, batch):
    """Next-token cross-entropy, in FP32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[-1].flatten())


@dataclass
class Contender:
    """One way of training: a module (sharing ``model``'s parameters), how it runs, its optimizer and its steps."""

    name: str
    how: str
    module: Callable
    model: torch.nn.Module
    autocast: bool
    batches: list
    steps_done: int = 0
    windows: list = field(default_factory=list)  # per-step seconds of each timed window
    losses: list = field(default_factory=list)

    def __post_init__(self):
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self) -> torch.Tensor:
        """One training step on the next batch; the loss stays on the device (nothing is read inside a window)."""
        batch = self.batches[self.steps_done % len(self.batches)]
        with torch.autocast(batch[0].device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = gpt_loss(self.module(batch[0]), batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return loss.detach()

    def window(self, steps: int, device) -> None:
        losses, seconds = timed(lambda: [self.step() for _ in range(steps)], device=device)
        self.windows.append(seconds / steps)
        self.losses.extend(torch.stack(losses).float().tolist())  # read after the window: the device is idle

    def row(self) -> dict:
        return {"how": self.how, "step_ms": statistics.median(self.windows) * 1e3,
                "step_ms_min": min(self.windows) * 1e3, "step_ms_max": max(self.windows) * 1e3,
                "mean_loss": statistics.fmean(self.losses), "steps_timed": len(self.losses)}


def take_turns(contenders: list, *, rounds: int, steps: int, device, warmup_steps: int = WARMUP_STEPS) -> None:
    """Warm every contender up (untimed: compiles, autotunes, makes the optimizer state), then time them in turns:
    each round runs every contender for a window of ``steps`` steps, in an order rotated each round, so that no
    contender always runs first (or after another)."""
    for contender in contenders:
        for _ in range(warmup_steps):
            contender.step()
    for r in range(rounds):
        for contender in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            contender.window(steps, device)


def compiler_of(native: bool) -> tuple[str, Callable]:
    """(name, compile) of the compiler every compiled contender uses: Inductor on a GPU, aot_eager elsewhere."""
    backend = "inductor" if native or torch.cuda.is_available() else "aot_eager"
    return backend, lambda module: torch.compile(module, backend=backend)


def run(*, smoke: bool = False, device: str | None = None) -> dict:
    """Measure the contenders; returns the result dict (what ``fp8.json`` holds).

    >>> result = run(smoke=True)  # doctest: +SKIP
    """
    float8 = require_torchao()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    native = fp8_runs_natively(device)
    config, batch_size, n_batches, rounds, steps = _GPU if native and not smoke else _CPU
    batches = batches_of(config, batch_size, n_batches, device)
    backend, compiled = compiler_of(native and not smoke)
    torch.manual_seed(0)
    base = GPT(**config).to(device)

    def fresh():
        return copy.deepcopy(base)

    contenders = []
    model = fresh()
    contenders.append(Contender("bf16 AMP", "eager", model, model, True, batches))
    model = fresh()
    contenders.append(Contender("bf16 AMP", f"compiled ({backend})", compiled(model), model, True, batches))
    model = float8.convert_to_float8_training(fresh(), config=float8.Float8LinearConfig(emulate=not native))
    contenders.append(Contender("torchao float8 (all linears) + bf16 AMP", f"compiled ({backend})", compiled(model),
                                 model, True, batches))

    model = fresh()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    search = compfx.optimize(model, batches, optimizer=optimizer, loss_fn=gpt_loss, low_dtype=torch.bfloat16,
                             config=compfx.SearchConfig(fp8=True, progress=False, warmup=1, repeats=2,
                                                        stage1_budget=16, stage2_budget=4, cache_plan=False))
    model.load_state_dict(base.state_dict())  # the same start as the others (the search trained it)
    counts = {str(p): sum(v is p for v in search.plan.values()) for p in set(search.plan.values())}
    contenders.append(Contender("compfx (searched plan)", f"compiled ({backend}, compile_with_plan)",
                                 compile_with_plan(model, search.plan, inner=backend), model, False, batches))

    take_turns(contenders, rounds=rounds, steps=steps, device=device)

    rows = {f"{c.name} ({c.how.split(' (')[0]})": c.row() for c in contenders}
    rows["compfx (searched plan) (compiled)"].update(
        plan=search.plan.bitstring(search.analysis), precisions=counts, fp8_recipe=str(search.plan.fp8_recipe),
        low_dtype=dtype_name(search.plan.low_dtype), search_s=search.search_seconds)
    return {"benchmark": "benchmarks.fp8", "device": compfx.measure.device_name(device), "native_fp8": native,
            "model": {"name": "gpt", **config, "batch_size": batch_size}, "rounds": rounds,
            "steps_per_round": steps, "warmup_steps": WARMUP_STEPS, "compiler": backend,
            "torch": torch.__version__, "torchao": getattr(sys.modules.get("torchao"), "__version__", "?"),
            "times_mean_nothing": not native,
            "note": ("float8 GEMMs run natively" if native else
                     "no float8 GEMMs on this device: torchao emulates them in high precision, so these times "
                     "mean nothing; the run only shows that each path trains"),
            "rows": rows}


def markdown(result: dict, *, title: str = "FP8") -> str:
    """The result as a table: each contender's median step with its spread, its speed against compiled bf16 AMP,
    its mean loss and its plan."""
    rows = result["rows"]
    reference = rows.get("bf16 AMP (compiled)", {}).get("step_ms")
    lines = [f"# {title} on {result['device']} ({result['model']['name']}, {result['model']['layers']} layers, "
             f"dim {result['model']['dim']})", "", f"**{result['note']}.**", "",
             f"Same start, same batches; {result.get('rounds')} interleaved rounds of {result.get('steps_per_round')} "
             "steps each after warm-up; step: the median round (fastest - slowest).", "",
             "| contender | runs | step (ms) | x bf16 AMP compiled | mean loss | plan |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        ratio = f"{reference / row['step_ms']:.2f}" if reference and row.get("step_ms") else ""
        spread = f" ({row['step_ms_min']:.2f} - {row['step_ms_max']:.2f})" if "step_ms_min" in row else ""
        lines.append(f"| {name.rsplit(' (', 1)[0]} | {row.get('how', '')} | {row['step_ms']:.2f}{spread} | {ratio} | "
                     f"{row['mean_loss']:.4f} | {row.get('plan', '')} |")
    return "\n".join(lines) + "\n"


def results_folder(root) -> Path:
    """``root``'s folder for this machine's results (made): ``cpu``, or the GPU's name."""
    folder = Path(root) / ("cpu" if not torch.cuda.is_available() else
                           compfx.measure.hardware_name("cuda").lower().replace(" ", "-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, whatever the device")
    parser.add_argument("--out", default=str(RESULTS_ROOT), help="results root (a <device> folder is made in it)")
    args = parser.parse_args(argv)
    result = run(smoke=args.smoke)
    folder = results_folder(args.out)
    (folder / "fp8.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / "fp8.md").write_text(markdown(result))
    print(markdown(result))
    print(f"written to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
