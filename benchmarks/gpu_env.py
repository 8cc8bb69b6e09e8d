"""What the GPU suite measured on: the device, the software, and a matmul probe (the roofline for MFU).

The probe multiplies two random ``n x n`` matrices (random data: zeros can run
faster than real data) in bf16, fp16 and FP32 with the process's own settings,
after warm-up calls, timing blocks of calls with the
device synchronised on both sides (:func:`compfx.measure.time_repeats`), and
reports the median block's rate. ``2 n^3`` FLOPs per product.

What "FP32" computes in is recorded, not set (``fp32_math``:
:func:`compfx.measure.fp32_math`): PyTorch's defaults run FP32 matmuls in IEEE
FP32, so the probe's FP32 rate is true FP32, but FP32 **convolutions in TF32**,
so the suite's ``fp32`` rows of convolutional models are TF32 there.

Run as ``python -m benchmarks.gpu_env --out env.json [--smoke]``; the suite runs
it in a time-boxed subprocess (:mod:`benchmarks.timebox`).

>>> env = environment(torch.device("cpu"))
>>> env["device_type"], "torch" in env
('cpu', True)
>>> probe = matmul_tflops(torch.device("cpu"), torch.float32, n=64, calls=2, repeats=2)
>>> probe["tflops"] > 0, probe["n"]
(True, 64)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import torch

from compfx.files import write_json_atomic
from compfx.measure import fp32_math, hardware_name, time_repeats
from compfx.vocabulary import dtype_name

__all__ = ["environment", "matmul_tflops", "probe", "main"]

#: Probe sizes: 8192^3 fills an H100 (a bf16 product takes about 1.4 ms); the smoke size is a CPU's.
PROBE_N = {"gpu": 8192, "smoke": 128}


def _nvidia_driver() -> str | None:
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or broken: the record says None
        return None


def environment(device: torch.device) -> dict:
    """Names and versions: the device (name, capability, memory, multiprocessors), torch, CUDA, cuDNN, Python."""
    env = {
        "device_type": device.type, "device_name": hardware_name(device), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "triton": _version("triton"), "transformers": _version("transformers"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(), "fp32_math": fp32_math(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            capability=list(torch.cuda.get_device_capability(device)), memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version(),
            driver=_nvidia_driver(),
        )
    return env


def matmul_tflops(device: torch.device, dtype: torch.dtype, *, n: int, calls: int = 10, repeats: int = 10,
                  warmup: int = 3) -> dict:
    """Median TFLOP/s of ``n x n @ n x n`` in ``dtype``: ``repeats`` timed blocks of ``calls`` products each."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def block(_):
        for _ in range(calls):
            torch.mm(a, b, out=out)

    timing = time_repeats(block, warmup=warmup, repeats=repeats, device=device)
    seconds = timing.median / calls
    return {"dtype": dtype_name(dtype), "n": n, "calls_per_block": calls, "blocks": repeats,
            "median_s": seconds, "tflops": 2 * n ** 3 / seconds / 1e12}


def probe(device: torch.device, n: int) -> dict:
    """The bf16, fp16 and FP32 rates, by dtype name (an error in one dtype is recorded, not raised)."""
    rates = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        try:
            rates[dtype_name(dtype)] = matmul_tflops(device, dtype, n=n)
        except Exception as error:  # e.g. a dtype this device cannot multiply
            rates[dtype_name(dtype)] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return rates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_env", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="CPU, small probe")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device is visible (torch.cuda.is_available() is False); on a CPU, run the suite with --smoke",
              file=sys.stderr)
        return 2
    env = environment(device)
    env["matmul_probe"] = probe(device, PROBE_N["smoke" if args.smoke else "gpu"])
    write_json_atomic(args.out, env)
    print(json.dumps({name: float(f"{rate.get('tflops', float('nan')):.4g}") for name, rate in env["matmul_probe"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
