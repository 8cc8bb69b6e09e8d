"""Analysis pass: count the dtype conversions in a graph (Campo's "casts per plan" metric).

A *cast* is a node that converts a floating-point tensor to another floating
dtype: ``x.to(dtype)``, ``x.float()`` / ``.half()`` / ``.bfloat16()``,
``aten._to_copy`` or ``prims.convert_element_type``. Whether the dtype really
changes is read from the metadata on both sides, so a ``.to()`` that only moves
a tensor between devices is not counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from compfx.analyze import model_device
from compfx.capture import normalize_example_inputs

from .insert_casts import CAST_META, AutocastRegion, meta_value

__all__ = ["CastReport", "cast_report", "count_casts", "count_autocast_casts", "is_cast"]

_CAST_METHODS = frozenset({"to", "type", "float", "half", "bfloat16", "double"})


def _cast_functions() -> frozenset:
    ops = [torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
           torch.ops.prims.convert_element_type.default]
    return frozenset(ops)


_CAST_FUNCTIONS = _cast_functions()


def _dtype_of(value):
    return value.dtype if isinstance(value, torch.Tensor) else None


def is_cast(node: fx.Node) -> bool:
    """True when ``node`` converts a floating tensor to a different floating dtype."""
    cast_like = (node.op == "call_method" and node.target in _CAST_METHODS) or (
        node.op == "call_function" and node.target in _CAST_FUNCTIONS)
    if not cast_like or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    before, after = _dtype_of(meta_value(node.args[0])), _dtype_of(meta_value(node))
    if before is None or after is None:
        return bool(node.meta.get(CAST_META))  # untyped: trust our own marker only
    return before.is_floating_point and after.is_floating_point and before != after


@dataclass(frozen=True)
class CastReport:
    """Casts in one graph: total, per ``"from->to"`` dtype pair, and how many convert parameters."""

    total: int
    by_dtypes: Mapping[str, int] = field(default_factory=dict)
    parameter_casts: int = 0
    autocast_regions: int = 0  # composite ops run under torch.autocast: their casts happen inside

    def __str__(self) -> str:
        pairs = ", ".join(f"{pair}: {n}" for pair, n in sorted(self.by_dtypes.items())) or "none"
        return (f"{self.total} casts ({pairs}); {self.parameter_casts} of parameters; "
                f"{self.autocast_regions} autocast regions")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def cast_report(gm: fx.GraphModule) -> CastReport:
    """Count the casts in ``gm`` (inserted by compfx or already in the model).

    >>> import torch, compfx
    >>> from compfx.apply import apply
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> print(cast_report(apply(model, compfx.Plan.amp(a), analysis=a)))
    6 casts (bfloat16->float32: 1, float32->bfloat16: 5); 4 of parameters; 0 autocast regions
    """
    pairs: Counter[str] = Counter()
    total = parameter_casts = 0
    for node in gm.graph.nodes:
        if not is_cast(node):
            continue
        total += 1
        source = node.args[0]
        before, after = _dtype_of(meta_value(source)), _dtype_of(meta_value(node))
        if before is not None and after is not None:
            pairs[f"{_short(before)}->{_short(after)}"] += 1
        parameter_casts += source.op == "get_attr" or isinstance(meta_value(source), nn.Parameter)
    regions = sum(node.op == "call_module" and isinstance(gm.get_submodule(node.target), AutocastRegion)
                  for node in gm.graph.nodes)
    return CastReport(total, dict(pairs), parameter_casts, regions)


def count_casts(gm: fx.GraphModule) -> int:
    """Number of cast nodes in ``gm`` (see :func:`cast_report` for the breakdown)."""
    return cast_report(gm).total


class _CastCounter(TorchDispatchMode):
    """Counts dtype-changing casts as they reach the dispatcher, below autocast."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in _CAST_FUNCTIONS and isinstance(args[0], torch.Tensor) and isinstance(result, torch.Tensor):
            before, after = args[0].dtype, result.dtype
            self.count += before.is_floating_point and after.is_floating_point and before != after
        return result


def count_autocast_casts(model: nn.Module, example_inputs, dtype: torch.dtype | None = None,
                         device_type: str | None = None) -> int:
    """Casts that real ``torch.autocast`` performs in one forward of ``model``.

    Runs the forward under autocast on FakeTensors (no arithmetic; the model's
    parameters and buffers are not touched) and counts the casts that reach the
    dispatcher. Autocast's weight-cast cache works as in eager AMP, so a
    parameter used twice is cast once.

    >>> import torch
    >>> count_autocast_casts(torch.nn.Linear(4, 2), torch.randn(3, 4), torch.bfloat16)
    3
    """
    args, kwargs = normalize_example_inputs(example_inputs)
    if device_type is None:
        device_type = model_device(model).type
    dtype = dtype or torch.get_autocast_dtype(device_type)
    counter = _CastCounter()
    with FakeTensorMode(allow_non_fake_inputs=True), counter, torch.autocast(device_type, dtype=dtype):
        model(*args, **kwargs)
    return counter.count
