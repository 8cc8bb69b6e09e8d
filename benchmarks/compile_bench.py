"""Training-step time under ``torch.compile``: compiled FP32 vs compiled AMP vs compiled compfx.

Three ways to compile the same model and train it:

* ``fp32``:   ``torch.compile(model, backend=inner)``,
* ``amp``:    the same, with the forward under ``torch.autocast(device, low_dtype)``
  (dynamo traces the autocast region),
* ``compfx``: ``compile_with_plan(model, plan, inner=inner)``: the plan's casts are
  inserted into dynamo's graph before AOT autograd and ``inner``.

A step is forward + loss + backward + optimizer step (with a GradScaler for
fp16). Times are ``torch.utils.benchmark`` medians over whole steps after the
compile step, which synchronises CUDA itself. The compile step's wall time is
reported apart. On CUDA the low dtype is fp16, on CPU bf16 (CPU bf16 GEMMs are
often *slower* than FP32 on CPUs without AMX/AVX512-BF16: that is measured
here, not assumed).

Run from the repository root::

    python -m benchmarks.compile_bench                      # CPU: mlp + encoder, inductor
    python -m benchmarks.compile_bench --device cuda --models encoder --steps 50
    python -m benchmarks.compile_bench --plan path/to/plan.json --models mlp

Results go to ``benchmarks/results/<device>/compile_bench.json`` and a table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate
from torch.utils.benchmark import Timer

import compfx
from compfx.vocabulary import default_low_dtype
from compfx.compile_backend import compile_with_plan
from compfx.files import write_json_atomic
from compfx.measure import timed

__all__ = ["MODELS", "bench_model", "main"]

RESULTS = Path(__file__).parent / "results"
MODES = ("fp32", "amp", "compfx")


class MLP(nn.Module):
    def __init__(self, width: int = 256, classes: int = 10):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, classes)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(self.norm(F.relu(self.fc1(x))))))


class Encoder(nn.Module):
    """Two pre-norm transformer blocks with SDPA attention, then a classifier on the mean token."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


#: name -> (model factory, batch factory (inputs, targets) on a device)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.device], tuple]]] = {
    "mlp": (MLP, lambda d: ((torch.randn(128, 256, device=d),), torch.randint(0, 10, (128,), device=d))),
    "encoder": (Encoder, lambda d: ((torch.randn(16, 32, 64, device=d),), torch.randint(0, 10, (16,), device=d))),
}


def _train_step(compiled: nn.Module, model: nn.Module, inputs, targets, autocast, scaler) -> Callable[[], float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        with autocast():
            loss = F.cross_entropy(compiled(*inputs).float(), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _compiled(mode: str, model: nn.Module, inputs, inner: str, low_dtype: torch.dtype, plan_arg):
    """(compiled module, autocast factory, plan description) for one mode."""
    device = inputs[0].device
    if mode == "fp32":
        return torch.compile(model, backend=inner), contextlib.nullcontext, "-"
    if mode == "amp":
        return (torch.compile(model, backend=inner),
                lambda: torch.autocast(device.type, dtype=low_dtype), "autocast")
    analysis = compfx.analyze(model, inputs, low_dtype=low_dtype)
    if plan_arg == "amp":
        plan, label = compfx.Plan.amp(analysis), "Plan.amp"
    elif plan_arg == "cache":
        plan, label = None, "plan cache / default"
    else:
        plan, label = compfx.Plan.load(plan_arg), str(plan_arg)
    return compile_with_plan(model, plan, inner=inner), contextlib.nullcontext, label


def bench_model(name: str, device: torch.device, inner: str, min_run_time: float, plan_arg: str,
                modes=MODES) -> list[dict]:
    """One row per mode: compile-step seconds and median / IQR step milliseconds."""
    factory, batch = MODELS[name]
    low_dtype = default_low_dtype(device)
    rows = []
    for mode in modes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = factory().to(device)
        inputs, targets = batch(device)
        compiled, autocast, plan_label = _compiled(mode, model, inputs, inner, low_dtype, plan_arg)
        scaler = torch.amp.GradScaler(device.type, enabled=(low_dtype == torch.float16 and mode != "fp32"))
        step = _train_step(compiled, model, inputs, targets, autocast, scaler)
        first_loss, compile_s = timed(step, device)  # compiles forward and backward
        measurement = Timer("step()", globals={"step": step}).blocked_autorange(min_run_time=min_run_time)
        rows.append(dict(model=name, mode=mode, inner=inner, device=str(device), low_dtype=str(low_dtype),
                         plan=plan_label, compile_s=round(compile_s, 2),
                         step_ms=round(measurement.median * 1e3, 3), iqr_ms=round(measurement.iqr * 1e3, 3),
                         steps_timed=len(measurement.times) * measurement.number_per_run,
                         first_loss=round(first_loss, 4)))
    fp32 = next((r["step_ms"] for r in rows if r["mode"] == "fp32"), None)
    for row in rows:
        row["speedup_vs_fp32"] = round(fp32 / row["step_ms"], 3) if fp32 else None
    return rows


def _environment(device: torch.device) -> dict:
    env = dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
               cpu_threads=torch.get_num_threads())
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inner", default="inductor", help="inner backend: inductor, aot_eager, eager")
    parser.add_argument("--plan", default="amp",
                        help="compfx plan: 'amp' (Plan.amp), 'cache' (plan cache, else default), or a plan file")
    parser.add_argument("--min-run-time", type=float, default=2.0, help="seconds of timed steps per mode")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/<device>/...)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [row for name in args.models
            for row in bench_model(name, device, args.inner, args.min_run_time, args.plan)]
    out = args.out or RESULTS / device.type / "compile_bench.json"
    write_json_atomic(out, dict(benchmark="compile_bench", environment=_environment(device), rows=rows))
    columns = ["model", "mode", "plan", "compile_s", "step_ms", "iqr_ms", "speedup_vs_fp32", "first_loss"]
    print(tabulate([[row[c] for c in columns] for row in rows], headers=columns))
    print(f"\nwritten to {out}")
    return rows


if __name__ == "__main__":
    main()
