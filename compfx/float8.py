"""FP8 as a precision: which ops *can* run in float8 ("can it"), and the torchao pieces that run them.

compfx does no float8 quantisation of its own. An FP8 op runs through
torchao's float8 training path (``torchao.float8``): its autograd function
``matmul_with_hp_or_float8_args`` scales each operand dynamically (one scale
per tensor, or per row) to ``float8_e4m3fn`` / ``float8_e5m2`` and runs the
forward and both backward GEMMs as scaled matmuls, exactly as
``convert_to_float8_training`` does for an ``nn.Linear``. Parameters stay FP32
master weights; nothing is registered on the model.

Hardware facts behind the rules:

* ``torch._scaled_mm`` (cuBLAS / CUTLASS float8 GEMMs) needs NVIDIA compute
  capability 8.9 (Ada, Hopper) or newer; torchao emulates the scaled matmuls
  in high precision elsewhere (``Float8LinearConfig(emulate=True)``): same
  numbers, no speed.
* Its operands' dims must be multiples of 16 (the 16-byte alignment of 16
  one-byte elements). Training runs three GEMMs per matmul, ``out = x @ w``
  (inner dim K), ``grad_x = grad_out @ w.t()`` (inner N) and
  ``grad_w = grad_out.t() @ x`` (inner M, the rows), so M, N and K all count.
* torchao's float8 training path takes a 2-D right operand (a weight); a
  batched matmul of two activations (attention scores) is not on it.

On CPU eligibility is by shape alone, because execution there is emulated.
Whether FP8 *should* run is the search's decision (as in Inductor's ``pad_mm``).

torchao is optional (``pip install compfx[fp8]``): it is imported only when
an FP8 op is built, and its absence is a :class:`~compfx.errors.BadInputError`.

>>> import torch
>>> fp8_eligible("linear", [(64, 32), (48, 32)], device=torch.device("cpu"))
(True, 'emulated on cpu: dims are multiples of 16')
>>> fp8_eligible("linear", [(64, 32), (40, 32)], device=torch.device("cuda"), capability=(9, 0))
(False, 'out_features=40 is not a multiple of 16')
>>> fp8_eligible("linear", [(64, 32), (48, 32)], device=torch.device("cuda"), capability=(8, 0))
(False, 'compute capability 8.0 < 8.9: no float8 GEMMs')
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import torch

from .errors import BadInputError
from .vocabulary import Float8Recipe

__all__ = ["FP8_MULTIPLE", "FP8_KINDS", "FP8_MIN_CAPABILITY", "fp8_eligible", "fp8_runs_natively", "float8_config",
           "require_torchao", "torchao_missing", "DEFAULT_RECIPE"]

#: Dimension multiple that float8 scaled-matmul kernels need.
FP8_MULTIPLE = 16
#: Op kinds torchao's float8 training path can run: a matmul with a 2-D right operand.
FP8_KINDS = frozenset({"linear", "matmul", "mm"})
#: Float8 GEMMs arrived with Ada / Hopper.
FP8_MIN_CAPABILITY = (8, 9)
DEFAULT_RECIPE = Float8Recipe.TENSORWISE

Shape = Sequence[int]


def fp8_runs_natively(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """True where float8 GEMMs run in hardware: CUDA with compute capability >= 8.9.

    ``capability`` defaults to the device's own (read when CUDA is available).

    >>> fp8_runs_natively(torch.device("cpu")), fp8_runs_natively(torch.device("cuda"), (9, 0))
    (False, True)
    """
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    return capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY


def _mnk(kind: str, shapes: Sequence[Shape]) -> tuple[tuple[int, int, int], tuple[str, str, str]] | str:
    """(M, N, K) and their names, or why the operands are not a matmul torchao's float8 path runs."""
    if len(shapes) < 2:
        return "input shapes unknown"
    x, w = shapes[0], shapes[1]
    if kind == "linear":  # input (..., K), weight (N, K)
        if len(x) < 2 or len(w) != 2:
            return "a linear of a 1-D input: no row dim to scale"
        return (math.prod(x[:-1]), w[0], w[1]), ("input rows", "out_features", "in_features")
    if len(x) < 2 or len(w) != 2 or (kind == "mm" and len(x) != 2):
        return "a batched or vector matmul: torchao's float8 training path takes a 2-D right operand"
    return (math.prod(x[:-1]), w[1], w[0]), ("M", "N", "K")


def fp8_eligible(kind: str, input_shapes: Sequence[Shape], *, device: torch.device,
                 capability: tuple[int, int] | None = None, is_module_call: bool = False) -> tuple[bool, str]:
    """``(eligible, reason)``: can this op run through torchao's float8 training path?

    The category does not matter: FP8 is a precision of GEMMs, and autocast's
    lists say nothing about it. See the module docstring for the rules.
    """
    if kind not in FP8_KINDS:
        return False, f"no float8 path for {kind} (only linear, matmul and mm with a 2-D right operand)"
    if is_module_call:
        return False, "a leaf module call: its weight is not a graph input the float8 path can take"
    device = torch.device(device)
    native = fp8_runs_natively(device, capability)
    if device.type == "cuda" and not native:
        if capability is None and not torch.cuda.is_available():
            return False, "cuda capability unknown (pass capability=(major, minor))"
        cap = capability or torch.cuda.get_device_capability(device)
        return False, f"compute capability {cap[0]}.{cap[1]} < 8.9: no float8 GEMMs"
    dims = _mnk(kind, input_shapes)
    if isinstance(dims, str):
        return False, dims
    for name, value in zip(dims[1], dims[0]):
        if not isinstance(value, int):  # a symbolic size (torch.compile's dynamic shapes): no guarantee
            return False, f"{name} is dynamic ({value}); the float8 path needs it known to be a multiple of {FP8_MULTIPLE}"
        if value % FP8_MULTIPLE:
            return False, f"{name}={value} is not a multiple of {FP8_MULTIPLE}"
    where = "native" if native else f"emulated on {device.type}"
    return True, f"{where}: dims are multiples of {FP8_MULTIPLE}"


def require_torchao():
    """``torchao.float8``, or a :class:`BadInputError` that says how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise BadInputError(f"an FP8 plan needs torchao's float8 training ({error}); install it with "
                            "`pip install compfx[fp8]` (torchao >= 0.18), or use a plan without 'fp8' ops.") from None
    return float8


@functools.lru_cache(maxsize=None)
def torchao_missing() -> str | None:
    """Why torchao's float8 training cannot be imported here (None: it can). For callers that skip FP8 work.

    >>> torchao_missing() is None or torchao_missing().startswith("torchao not installed")
    True
    """
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        return f"torchao not installed ({error})"
    return None


def float8_config(recipe: Float8Recipe | str = DEFAULT_RECIPE, *, emulate: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``, emulated (high-precision matmuls) when ``emulate``.

    >>> float8_config("rowwise", emulate=True).round_scales_to_power_of_2
    True
    """
    recipe = Float8Recipe.parse(recipe, "fp8_recipe")
    float8 = require_torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe.value)
    return dataclasses.replace(config, emulate=emulate)


def fp8_fallbacks(ops, precisions, *, device: torch.device, categories=None) -> dict:
    """The ops ``precisions`` gives FP8 that cannot run it at their shapes here: op key -> (the precision it runs
    instead, why). ``ops`` describe the ops at these shapes (``key``, ``kind``, ``input_shapes``, ``category``: an
    :class:`~compfx.analysis.OpInfo`, or the compile backend's view of a graph's node); ``categories`` overrides
    theirs where the caller classified the op itself.

    FP8 eligibility depends on shapes (M, N and K multiples of 16: :func:`fp8_eligible`), and a plan is searched
    at the first batch's. Another input signature (a ragged last batch, another sequence length, torch.compile's
    dynamic shapes) can break it, where torch's scaled matmul would refuse the op; the op then runs at the
    precision AMP gives it (low, for the GEMMs FP8 covers), at those shapes only.

    >>> import torch, compfx
    >>> from compfx.vocabulary import Precision
    >>> ragged = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(32, 16)), torch.randn(10, 32))  # 10 rows
    >>> {str(k): v for k, v in fp8_fallbacks(ragged.ops, {ragged.keys[0]: Precision.FP8}, device=ragged.device).items()}
    {'0:linear#0': (<Precision.LOW: 'low'>, 'input rows=10 is not a multiple of 16')}
    """
    from .plan import AMP_PRECISION  # what AMP gives the op; plan.py reads float8 only through the analysis
    from .vocabulary import Precision

    fallbacks = {}
    for op in ops:
        if precisions.get(op.key) is Precision.FP8:
            eligible, why = fp8_eligible(op.kind, op.input_shapes, device=device)
            if not eligible:
                fallbacks[op.key] = (AMP_PRECISION[(categories or {}).get(op.key, op.category)], why)
    return fallbacks
