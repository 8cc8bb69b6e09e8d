"""Can this op use Tensor Cores? Small pure functions, one per op family.

Hardware facts behind the rules:

* Tensor Cores exist on NVIDIA GPUs from Volta (compute capability 7.0) for
  fp16 and from Ampere (8.0) for bf16. CPUs have none.
* cuBLAS/cuDNN pick Tensor Core kernels for fp16/bf16 when the GEMM dims
  M, N, K (or a convolution's input and output channels) are multiples of 8,
  the 16-byte alignment of 8 half-precision elements (NVIDIA's "Deep Learning
  Performance" guide; CoMP section 3.2 uses the same rule).

Eligibility is "can we"; whether it pays off is measured by the search.
Padding is the same split (Campo; Inductor's ``pad_mm``): :func:`pad_eligible`
says, from shapes alone, whether zero-padding the dims that miss the rule would
make an op meet it; the search measures whether the padded op is faster.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .vocabulary import LOW_DTYPES, Category

__all__ = [
    "tc_eligible",
    "device_tensor_core_reason",
    "gemm_reason",
    "conv_reason",
    "gemm_dims_reason",
    "conv_channels_reason",
    "GEMM_KINDS",
    "CONV_KINDS",
    "TC_MULTIPLE",
    "gemm_mnk",
    "conv_channels",
    "padded_size",
    "pad_eligible",
    "PAD_KINDS",
]

#: Dimension multiple that fp16/bf16 Tensor Core kernels need.
TC_MULTIPLE = 8

GEMM_KINDS = frozenset("linear matmul mm bmm addmm baddbmm addbmm".split())
CONV_KINDS = frozenset(
    "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution".split()
)

Shape = Sequence[int]

_NOT_LOW_PRECISION = {
    Category.BLACKLIST: "blacklist op: autocast runs it in fp32",
    Category.OTHER: "other op: runs in its input's dtype, no GEMM",
}


def device_tensor_core_reason(*, device: torch.device, low_dtype: torch.dtype,
                              capability: tuple[int, int] | None) -> str | None:
    """Why ``device`` cannot run ``low_dtype`` on Tensor Cores, or None if it can.

    Tensor Cores arrived with Volta (compute capability 7.0) for fp16 and with
    Ampere (8.0) for bf16; CPUs have none.
    """
    if device.type != "cuda":
        return f"{device.type} has no tensor cores"
    if low_dtype not in LOW_DTYPES:
        return f"{low_dtype} is not a tensor core dtype"
    if capability is None:
        return "cuda capability unknown"
    needed = (8, 0) if low_dtype == torch.bfloat16 else (7, 0)
    if tuple(capability) < needed:
        return f"compute capability {capability[0]}.{capability[1]} < {needed[0]}.{needed[1]} for {low_dtype}"
    return None


def _multiple_reason(name: str, value: int) -> str | None:
    return None if value % TC_MULTIPLE == 0 else f"{name}={value} is not a multiple of {TC_MULTIPLE}"


def gemm_dims_reason(m: int, n: int, k: int, names: tuple[str, str, str] = ("M", "N", "K")) -> str | None:
    """First GEMM dim that is not a multiple of 8, as a reason, or None."""
    for name, value in zip(names, (m, n, k)):
        reason = _multiple_reason(name, value)
        if reason:
            return reason
    return None


def conv_channels_reason(in_channels: int, out_channels: int) -> str | None:
    """First conv channel count that is not a multiple of 8, as a reason, or None."""
    return _multiple_reason("in_channels", in_channels) or _multiple_reason("out_channels", out_channels)


def gemm_mnk(kind: str, shapes: Sequence[Shape]) -> tuple[tuple[int, int, int], tuple[str, str, str]]:
    """GEMM dims (M, N, K) and their names, read from the operand shapes of one GEMM-family op."""
    if kind == "linear":  # input (..., K), weight (N, K): leading dims fold into M
        x, w = shapes[0], shapes[1]
        return (math.prod(x[:-1]), w[0], w[1]), ("input rows", "out_features", "in_features")
    if kind in ("addmm", "baddbmm", "addbmm"):
        shapes = shapes[1:]  # first operand is the added bias
    a, b = shapes[0], shapes[1]
    a = a if len(a) > 1 else (1, *a)  # matmul promotes vectors to 1-row / 1-column matrices
    b = b if len(b) > 1 else (*b, 1)
    return (a[-2], b[-1], a[-1]), ("M", "N", "K")


def gemm_reason(kind: str, input_shapes: Sequence[Shape]) -> str | None:
    """GEMM family (linear, matmul, mm, bmm, addmm, baddbmm, addbmm).

    cuBLAS runs fp16/bf16 GEMMs on Tensor Cores when M, N and K are multiples
    of 8 (16-byte aligned rows of 2-byte elements).
    """
    (m, n, k), names = gemm_mnk(kind, input_shapes)
    return gemm_dims_reason(m, n, k, names)


def conv_channels(kind: str, shapes: Sequence[Shape], groups: int = 1) -> tuple[int, int]:
    """(in_channels, out_channels) of a convolution, read from its weight's shape."""
    weight = shapes[1]
    if kind.startswith("conv_transpose"):  # weight (in, out/groups, ...)
        return weight[0], weight[1] * groups
    return weight[1] * groups, weight[0]  # weight (out, in/groups, ...)


def conv_reason(kind: str, input_shapes: Sequence[Shape], groups: int = 1) -> str | None:
    """Convolution family (conv1d/2d/3d, conv_transpose1d/2d/3d).

    cuDNN runs fp16/bf16 convolutions as implicit GEMMs on Tensor Cores when
    the input and output channel counts are multiples of 8.
    """
    return conv_channels_reason(*conv_channels(kind, input_shapes, groups))


def tc_eligible(
    kind: str,
    category: Category | str,
    input_shapes: Sequence[Shape],
    *,
    low_dtype: torch.dtype,
    device: torch.device,
    capability: tuple[int, int] | None = None,
    groups: int = 1,
) -> tuple[bool, str]:
    """``(eligible, reason)`` for one op.

    >>> import torch
    >>> tc_eligible("linear", "whitelist", [(32, 64), (100, 64)], low_dtype=torch.float16,
    ...             device=torch.device("cuda"), capability=(8, 0))
    (False, 'out_features=100 is not a multiple of 8')
    >>> tc_eligible("linear", "whitelist", [(32, 64), (128, 64)], low_dtype=torch.bfloat16, device=torch.device("cpu"))
    (False, 'cpu has no tensor cores')
    """
    if category != Category.WHITELIST:
        return False, _NOT_LOW_PRECISION.get(category, f"{category} op")
    reason = device_tensor_core_reason(device=device, low_dtype=low_dtype, capability=capability)
    if reason:
        return False, reason
    if kind not in GEMM_KINDS and kind not in CONV_KINDS:
        return False, f"no tensor-core rule for {kind} (only GEMMs and convolutions are checked)"
    if len(input_shapes) < 2 or any(s is None for s in input_shapes[:2]):
        return False, "input shapes unknown"
    if kind in GEMM_KINDS:
        reason = gemm_reason(kind, input_shapes)
    else:
        reason = conv_reason(kind, input_shapes, groups)
    return (reason is None), (reason or f"dims are multiples of {TC_MULTIPLE}")


#: Ops the padding pass (:mod:`compfx.passes.pad_shapes`) knows how to pad: their operands' dims are read as
#: :func:`gemm_mnk` and :func:`conv_channels` read them. Batched GEMMs with a bias operand (addmm, baddbmm,
#: addbmm) and transposed convolutions are not padded.
PAD_KINDS = frozenset("linear matmul mm bmm conv1d conv2d conv3d".split())


def padded_size(size: int) -> int:
    """``size`` rounded up to the Tensor Core multiple (zero-padding adds the difference).

    >>> padded_size(1001), padded_size(1000), padded_size(3)
    (1008, 1000, 8)
    """
    return -(-size // TC_MULTIPLE) * TC_MULTIPLE


def _padding_misses(kind: str, shapes: Sequence[Shape], groups: int) -> list[tuple[str, int]]:
    """The dims that miss the rule, as (name, size), in the order the rule checks them."""
    if kind in CONV_KINDS:
        sizes = zip(("in_channels", "out_channels"), conv_channels(kind, shapes, groups))
    else:
        (m, n, k), names = gemm_mnk(kind, shapes)
        sizes = zip(names, (m, n, k))
    return [(name, size) for name, size in sizes if size % TC_MULTIPLE]


def pad_eligible(kind: str, category: Category | str, input_shapes: Sequence[Shape], *, groups: int = 1,
                 is_module_call: bool = False) -> tuple[bool, str]:
    """``(eligible, reason)``: does this op miss the Tensor Core rule, and would zero-padding make it meet it?

    Judged from the shapes alone, on any device: the rule is the same
    everywhere, and whether padding *pays* (it only can where Tensor Cores
    exist) is measured by the search. An op that already meets the rule is
    not eligible, so it is never padded. Padding a GEMM's K or a convolution's
    input channels adds zero products; padding M, N or output channels adds
    rows or columns that are sliced off again.

    >>> pad_eligible("linear", "whitelist", [(64, 768), (50257, 768)])
    (True, 'out_features 50257 -> 50264')
    >>> pad_eligible("linear", "whitelist", [(64, 768), (1000, 768)])
    (False, 'dims are multiples of 8 already')
    >>> pad_eligible("conv2d", "whitelist", [(8, 3, 32, 32), (64, 3, 3, 3)])
    (True, 'in_channels 3 -> 8')
    """
    if category != Category.WHITELIST:
        return False, "only whitelist ops run low on Tensor Cores"
    if kind not in PAD_KINDS:
        return False, f"no padding rule for {kind} (only linear, matmul, mm, bmm and conv1d/2d/3d are padded)"
    if is_module_call:
        return False, "a leaf module call: its weight is not a graph input the pass can pad"
    if len(input_shapes) < 2 or any(s is None for s in input_shapes[:2]):
        return False, "input shapes unknown"
    if any(len(s) < 2 for s in input_shapes[:2]):
        return False, "a 1-D operand (a matrix-vector product): nothing to pad into a Tensor Core tile"
    if kind in CONV_KINDS and groups != 1:
        return False, f"grouped convolution (groups={groups}): its channels are not padded"
    misses = _padding_misses(kind, input_shapes, groups)
    if not misses:
        return False, f"dims are multiples of {TC_MULTIPLE} already"
    return True, ", ".join(f"{name} {size} -> {padded_size(size)}" for name, size in misses)
