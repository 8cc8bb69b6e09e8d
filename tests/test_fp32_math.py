"""What "fp32" computes in is the user's setting, read (never changed) and said in the search report: PyTorch runs
CUDA's FP32 convolutions in TF32 by default, so an FP32 baseline is not true FP32 unless the settings say so."""

from __future__ import annotations

import pytest
import torch

import compfx
from compfx.measure import describe_fp32_math, fp32_math
from tests.helpers import batches, ce


@pytest.fixture
def settings_restored():
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_pytorchs_cuda_defaults_are_ieee_matmuls_and_tf32_convolutions(settings_restored):
    torch.backends.cuda.matmul.fp32_precision = "none"  # inherit: the defaults
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    assert fp32_math("cuda") == {"matmul": "ieee", "convolution": "tf32"}
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    assert fp32_math("cuda") == {"matmul": "tf32", "convolution": "ieee"}
    assert describe_fp32_math(fp32_math("cuda")) == "FP32 matmuls in TF32, FP32 convolutions in IEEE FP32"


def test_the_report_says_what_fp32_meant_and_the_settings_are_kept(settings_restored):
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # a user's choice, for another device: kept as it is
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = compfx.optimize(model, batches(2, (6, 4)), optimizer=optimizer, loss_fn=ce, config=compfx.SearchConfig(
        progress=False, warmup=0, repeats=1, stage2_check_batches=1, predictor=False, cache_plan=False))
    [note] = [r for r in result.log.notes() if "'fp32'" in r.reason]
    assert note.extra["fp32_math"] == fp32_math("cpu")
    assert f"means {describe_fp32_math(fp32_math('cpu'))} on cpu" in result.report()
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
