"""Tensor Core eligibility: fixed cases with their reasons, and random shapes against an oracle."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compfx.tensor_cores import tc_eligible

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "kind, shapes, dtype, device, capability, expected",
    [
        ("linear", [(32, 64), (100, 64)], torch.float16, CUDA, (8, 0), (False, "out_features=100 is not a multiple of 8")),
        ("linear", [(32, 60), (128, 60)], torch.float16, CUDA, (8, 0), (False, "in_features=60 is not a multiple of 8")),
        ("linear", [(3, 5, 64), (128, 64)], torch.float16, CUDA, (8, 0), (False, "input rows=15 is not a multiple of 8")),
        ("linear", [(32, 64), (128, 64)], torch.float16, CUDA, (7, 0), (True, "dims are multiples of 8")),
        ("linear", [(32, 64), (128, 64)], torch.bfloat16, CUDA, (7, 5), (False, "compute capability 7.5 < 8.0 for torch.bfloat16")),
        ("linear", [(32, 64), (128, 64)], torch.float16, CUDA, (6, 1), (False, "compute capability 6.1 < 7.0 for torch.float16")),
        ("linear", [(32, 64), (128, 64)], torch.bfloat16, CPU, None, (False, "cpu has no tensor cores")),
        ("bmm", [(4, 16, 24), (4, 24, 12)], torch.float16, CUDA, (8, 0), (False, "N=12 is not a multiple of 8")),
        ("baddbmm", [(4, 16, 8), (4, 16, 24), (4, 24, 8)], torch.float16, CUDA, (9, 0), (True, "dims are multiples of 8")),
        ("addmm", [(8,), (16, 20), (20, 8)], torch.float16, CUDA, (8, 0), (False, "K=20 is not a multiple of 8")),
        ("conv2d", [(2, 3, 16, 16), (8, 3, 3, 3)], torch.float16, CUDA, (8, 0), (False, "in_channels=3 is not a multiple of 8")),
        ("conv1d", [(2, 16, 30), (12, 16, 3)], torch.float16, CUDA, (8, 0), (False, "out_channels=12 is not a multiple of 8")),
        ("conv_transpose2d", [(2, 16, 5, 5), (16, 8, 3, 3)], torch.float16, CUDA, (8, 0), (True, "dims are multiples of 8")),
        ("softmax", [(8, 8)], torch.float16, CUDA, (8, 0), (False, "blacklist op: autocast runs it in fp32")),
    ],
)
def test_tc_rule_cases(kind, shapes, dtype, device, capability, expected):
    category = "blacklist" if kind == "softmax" else "whitelist"
    assert tc_eligible(kind, category, shapes, low_dtype=dtype, device=device, capability=capability) == expected


def test_grouped_conv_counts_all_input_channels():
    # weight (out=16, in/groups=4): 4 groups of 4 input channels = 16 input channels
    assert tc_eligible("conv2d", "whitelist", [(2, 16, 8, 8), (16, 4, 3, 3)], low_dtype=torch.float16, device=CUDA,
                       capability=(8, 0), groups=4)[0]
    assert not tc_eligible("conv2d", "whitelist", [(2, 16, 8, 8), (16, 4, 3, 3)], low_dtype=torch.float16, device=CUDA,
                           capability=(8, 0))[0]


# ---------------------------------------------------------------------------
# random shapes against an independent oracle: dims come from the *output* of the
# op (run on meta tensors) instead of being read off the operand shapes.


def _oracle(kind, operands, dtype, device, capability):
    if device.type != "cuda" or capability < ((8, 0) if dtype == torch.bfloat16 else (7, 0)):
        return False
    metas = [torch.empty(s, device="meta") for s in operands]
    if kind == "linear":
        out = torch.nn.functional.linear(*metas)
        n = out.shape[-1]
        dims = (out.numel() // n, n, operands[0][-1])
    elif kind in ("bmm", "matmul", "mm"):
        out = getattr(torch, kind)(*metas)
        dims = (out.shape[-2], out.shape[-1], operands[0][-1])
    elif kind == "baddbmm":
        out = torch.baddbmm(*metas)
        dims = (out.shape[-2], out.shape[-1], operands[1][-1])
    else:  # conv2d: channels of input and output
        out = torch.nn.functional.conv2d(*metas)
        dims = (operands[0][1], out.shape[1])
    return all(d % 8 == 0 for d in dims)


dims = st.sampled_from([1, 3, 4, 8, 12, 16, 24, 30, 32, 64])


@st.composite
def gemm_case(draw):
    kind = draw(st.sampled_from(["linear", "bmm", "matmul", "mm", "baddbmm", "conv2d"]))
    m, n, k, b = draw(dims), draw(dims), draw(dims), draw(st.integers(1, 3))
    if kind == "linear":
        lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
        operands = [(*lead, m, k), (n, k)]
    elif kind in ("bmm", "matmul"):
        operands = [(b, m, k), (b, k, n)]
    elif kind == "mm":
        operands = [(m, k), (k, n)]
    elif kind == "baddbmm":
        operands = [(b, m, n), (b, m, k), (b, k, n)]
    else:
        operands = [(b, k, 6, 6), (n, k, 3, 3)]
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    device = draw(st.sampled_from([CUDA, CPU]))
    capability = draw(st.sampled_from([(6, 1), (7, 0), (7, 5), (8, 0), (9, 0)]))
    return kind, operands, dtype, device, capability


@settings(max_examples=25, deadline=None)
@given(gemm_case())
def test_tc_rule_matches_oracle(case):
    kind, operands, dtype, device, capability = case
    eligible, reason = tc_eligible(kind, "whitelist", operands, low_dtype=dtype, device=device, capability=capability)
    assert eligible == _oracle(kind, operands, dtype, device, capability), reason
    assert (reason == "dims are multiples of 8") == eligible


@settings(max_examples=15, deadline=None)
@given(gemm_case(), st.sampled_from(["blacklist", "other"]))
def test_only_whitelisted_ops_are_eligible(case, category):
    kind, operands, dtype, device, capability = case
    assert tc_eligible(kind, category, operands, low_dtype=dtype, device=device, capability=capability)[0] is False

