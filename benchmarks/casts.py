"""Cast counting for the AMP-vs-compfx comparison.

One counter for every mode: trace the forward with ``make_fx`` on FakeTensors
(nothing runs) under the mode's autocast, and count the ``aten._to_copy`` /
``prims.convert_element_type`` nodes that change a floating dtype. For AMP that
counts autocast's own casts; for compfx it counts the casts the plan inserted
(plus any inside composite ops it runs under autocast). The project's counters
(``compfx.passes.count_autocast_casts`` / ``count_casts``) are used when they
import; otherwise the local fallback below, and the row says which counted.

>>> import torch
>>> from contextlib import nullcontext
>>> count_forward_casts(torch.nn.Linear(4, 2), (torch.randn(3, 4),), lambda: nullcontext())
0
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["count_forward_casts", "count_graph_casts", "unwrap_compiled"]

_ATEN_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
_METHOD_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type"})


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The eager module under a ``torch.compile`` wrapper (casts are counted on the eager graph)."""
    return getattr(module, "_orig_mod", module)


def _changes_float_dtype(node: fx.Node) -> bool:
    before = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    after = node.meta.get("val")
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return False
    return before.dtype.is_floating_point and after.dtype.is_floating_point and before.dtype != after.dtype


def _count_aten_casts(gm: fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes
               if node.op == "call_function" and node.target in _ATEN_CASTS and _changes_float_dtype(node))


def count_forward_casts(module: nn.Module, inputs: tuple, autocast: Callable) -> int:
    """Dtype casts in one forward of ``module`` under ``autocast()`` (a context-manager factory)."""
    module = unwrap_compiled(module)
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def forward(state, inputs):
        with autocast():
            return torch.func.functional_call(module, state, inputs)

    return _count_aten_casts(make_fx(forward, tracing_mode="fake")(state, inputs))


def count_graph_casts(gm: nn.Module) -> tuple[int, str]:
    """Cast nodes in an applied GraphModule, with the name of the counter used."""
    gm = unwrap_compiled(gm)
    try:
        from compfx.passes import count_casts
    except ImportError:
        count = sum(1 for node in gm.graph.nodes
                    if (node.op == "call_method" and node.target in _METHOD_CASTS)
                    or (node.op == "call_function" and node.target is torch.Tensor.to))
        return count, "benchmarks.casts fallback (call_method to/float/half... nodes, dtype change not checked)"
    return count_casts(gm), "compfx.passes.count_casts"
