"""Floating-point operations of one training step, counted, for model FLOP utilisation (MFU).

``torch.utils.flop_counter.FlopCounterMode`` counts the matrix products and
convolutions (attention included) of one forward and backward of the FP32
model: the work the step must do, whatever precision a mode runs it in.
Elementwise ops and the optimizer step are not counted (as in the usual MFU
definition). MFU is then ``flops x steps/s`` over a measured matmul rate
(:mod:`benchmarks.gpu_env`'s probe).

>>> from benchmarks.models import get_spec
>>> spec = get_spec("gpt")
>>> training_step_flops(spec, spec.config("small"), "cpu") > 0
True
>>> mfu_percent(flops_per_step=2e12, steps_per_s=100.0, peak_tflops=800.0)
25.0
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from .models.spec import ModelSpec

__all__ = ["training_step_flops", "mfu_percent"]


def training_step_flops(spec: ModelSpec, config, device: torch.device | str, seed: int = 0) -> int:
    """FLOPs of one forward + loss + backward of a fresh FP32 model on one synthetic batch of the config's size."""
    device = torch.device(device)
    torch.manual_seed(seed)
    model = spec.build(config).to(device)
    batch = spec.example_batch(config, config["batch_size"], torch.Generator().manual_seed(seed))
    batch = tuple(part.to(device) for part in batch)
    with FlopCounterMode(display=False) as counter:
        spec.loss_fn(model(*batch[:-1]), batch).backward()
    return int(counter.get_total_flops())


def mfu_percent(*, flops_per_step: float | None, steps_per_s: float | None, peak_tflops: float | None) -> float | None:
    """Achieved FLOP/s as a percentage of ``peak_tflops`` (None when a figure is missing)."""
    if not flops_per_step or not steps_per_s or not peak_tflops:
        return None
    return round(100.0 * flops_per_step * steps_per_s / (peak_tflops * 1e12), 2)
