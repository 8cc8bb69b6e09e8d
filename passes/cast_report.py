"""Analysis pass: the dtype conversions in a graph (Campo's "casts per plan" metric).

A cast is what :func:`compfx.cast_policy.is_cast` says it is: a conversion
node (``.to``, ``.float()``, ``.type_as``, ``aten._to_copy``, ...) that changes
the floating dtype of its input, read from the metadata on both sides.
:func:`casts_in` lists them with their sizes (the cost model prices that
list), :func:`cast_report` counts them, and :func:`count_autocast_casts`
counts the casts real ``torch.autocast`` performs, for comparison.
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

from compfx.batches import model_device
from compfx.graph_capture import meta_value, normalize_example_inputs
from compfx.cast_policy import AutocastRegion, is_cast, is_model_tensor
from compfx.errors import BadInputError
from compfx.vocabulary import dtype_name

__all__ = ["CastInfo", "CastReport", "casts_in", "cast_report", "count_casts", "count_autocast_casts"]

# What real autocast's casts look like when they reach the dispatcher.
_DISPATCHED_CASTS = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
                               torch.ops.aten.to.dtype_layout, torch.ops.prims.convert_element_type.default})


@dataclass(frozen=True)
class CastInfo:
    """One cast of a graph (a node :func:`compfx.cast_policy.is_cast` accepts)."""

    node: str
    src: torch.dtype
    dst: torch.dtype
    numel: int
    backward: bool  # its input needs a gradient, so backward casts the gradient back
    parameter: bool  # it converts a parameter or buffer (cast_policy.is_model_tensor): one cast shared by all uses


def casts_in(gm: fx.GraphModule) -> list[CastInfo]:
    """Every cast in ``gm`` with its dtypes and size, read from the nodes' ``meta["val"]``, in graph order.

    A cast whose dtypes the metadata does not hold (a compfx cast in an untyped
    graph) is listed with ``numel`` 0 and ``src == dst == None``.
    """
    casts = []
    for node in gm.graph.nodes:
        if not is_cast(node):
            continue
        source = node.args[0]
        before, after = meta_value(source), meta_value(node)
        typed = isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
        casts.append(CastInfo(
            node.name, before.dtype if typed else None, after.dtype if typed else None,
            after.numel() if typed else 0, bool(typed and before.requires_grad), is_model_tensor(source, before)))
    return casts


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


def cast_report(gm: fx.GraphModule) -> CastReport:
    """Count the casts in ``gm`` (inserted by compfx or already in the model); a planned module (``result.module``
    of a search, a :class:`~compfx.planned_module.PlannedModule`) is read through its ``graph_module``, the graph of its
    example inputs.

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> print(cast_report(compfx.apply(model, compfx.Plan.amp(a), analysis=a)))
    6 casts (bfloat16->float32: 1, float32->bfloat16: 5); 4 of parameters; 0 autocast regions
    """
    gm = _graph_of(gm)
    casts = casts_in(gm)
    pairs = Counter(f"{dtype_name(c.src)}->{dtype_name(c.dst)}" for c in casts if c.src is not None)
    regions = sum(node.op == "call_module" and isinstance(gm.get_submodule(node.target), AutocastRegion)
                  for node in gm.graph.nodes)
    return CastReport(len(casts), dict(pairs), sum(c.parameter for c in casts), regions)


def _graph_of(module) -> fx.GraphModule:
    if not isinstance(module, fx.GraphModule):
        module = getattr(module, "graph_module", module)  # a planned module's graph of its example inputs
    if not isinstance(module, fx.GraphModule):
        raise BadInputError(f"cast_report() reads a graph: a GraphModule (compfx.apply's) or a planned module "
                            f"(result.module); got {type(module).__name__}.")
    return module


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
        if func in _DISPATCHED_CASTS and isinstance(args[0], torch.Tensor) and isinstance(result, torch.Tensor):
            before, after = args[0].dtype, result.dtype
            self.count += before.is_floating_point and after.is_floating_point and before != after
        return result


def count_autocast_casts(model: nn.Module, example_inputs, *, dtype: torch.dtype | None = None,
                         device_type: str | None = None) -> int:
    """Casts that real ``torch.autocast`` performs in one forward of ``model``.

    Runs the forward under autocast on FakeTensors (no arithmetic; the model's
    parameters and buffers are not touched) and counts the casts that reach the
    dispatcher. Autocast's weight-cast cache works as in eager AMP, so a
    parameter used twice is cast once.

    >>> import torch
    >>> count_autocast_casts(torch.nn.Linear(4, 2), torch.randn(3, 4), dtype=torch.bfloat16)
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
