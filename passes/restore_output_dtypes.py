"""Rewrite pass: return a graph's floating outputs in the dtypes the original model returned.

After :mod:`compfx.passes.insert_casts` an output can leave in the low dtype
(the last op ran low). The loss and whatever code reads the model's outputs
were written for the model's own dtypes, so this pass casts each such output
back, including the tensors inside a tuple or list an op returns as a whole
(``torch._native_multi_head_attention`` returns ``(output, weights)``). Read
the dtypes with :func:`output_dtypes` *before* the rewrite.

>>> import torch, compfx
>>> from compfx.passes import insert_casts, output_dtypes, restore_output_dtypes
>>> gm = compfx.capture(torch.nn.Linear(4, 2), torch.randn(3, 4))
>>> before = output_dtypes(gm)
>>> gm = insert_casts(gm, {k.meta["compfx_key"]: "low" for k in compfx.graph_capture.op_nodes(gm)}, low_dtype=torch.bfloat16)
>>> restore_output_dtypes(gm, before)(torch.randn(3, 4)).dtype
torch.float32
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from compfx.graph_capture import meta_value
from compfx.cast_policy import CAST_META
from compfx.errors import PassError
from compfx.vocabulary import short_dtype_name

from .propagate_dtypes import UNKNOWN, DtypePropagator

__all__ = ["output_dtypes", "restore_output_dtypes"]

PASS_NAME = "restore_output_dtypes"

#: Containers an op may return whole whose items this pass restores one by one (FX writes them as literals).
_CONTAINERS = (tuple, list)


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _output_args(gm: fx.GraphModule) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(_output_node(gm).args, lambda n: found.append(n) or n)
    return found


def output_dtypes(gm: fx.GraphModule) -> list[Any]:
    """What each node the graph returns holds, in order: a floating tensor's dtype, a tuple or list of those
    (for an op that returns one whole), or None (anything else).

    >>> import torch, compfx
    >>> class Halves(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.split(x, 2)  # one node holding a tuple
    >>> output_dtypes(compfx.capture(Halves(), torch.randn(4)))
    [(torch.float32, torch.float32)]
    """
    return [_dtypes_in(meta_value(node)) for node in _output_args(gm)]


def _dtypes_in(value):
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    if type(value) in _CONTAINERS:
        return type(value)(_dtypes_in(item) for item in value)
    return None


def restore_output_dtypes(gm: fx.GraphModule, dtypes: Sequence[Any]) -> fx.GraphModule:
    """Cast each returned node back to ``dtypes[i]`` (from :func:`output_dtypes`) where it differs; returns ``gm``.

    A returned tuple or list whose items changed dtype is returned as a new one
    of the same type, item by item. Being returned is a use like any other
    (:func:`compfx.cast_policy.shares_cast`): an output gets a cast of its own
    even where an op already reads a cast of the same tensor to the same dtype.
    """
    outputs = _output_args(gm)
    if len(outputs) != len(dtypes):
        raise PassError(f"{PASS_NAME}: the graph returns {len(outputs)} nodes but {len(dtypes)} dtypes were given; "
                        "read them with output_dtypes(gm) before rewriting gm.")
    output = _output_node(gm)
    restorer = _Restorer(gm, output)
    replace: dict[fx.Node, Any] = {}
    for node, wanted in zip(outputs, dtypes):
        if node not in replace:
            restored = restorer.restored(node, meta_value(node), wanted)
            if restored is not node:
                replace[node] = restored
    if replace:
        output.args = fx.node.map_arg(output.args, lambda n: replace.get(n, n))
        gm.graph.lint()
        gm.recompile()
    return gm


class _Restorer:
    """Builds, before the output node, what the graph returns in place of a node whose dtypes changed."""

    def __init__(self, gm: fx.GraphModule, output: fx.Node):
        self.gm, self.output = gm, output
        self.propagator = DtypePropagator(gm)

    def restored(self, node: fx.Node, value, wanted):
        """``node`` itself when it holds ``wanted``'s dtypes; else its cast, or a container of its restored items."""
        if isinstance(value, torch.Tensor):
            if not isinstance(wanted, torch.dtype) or not value.is_floating_point() or value.dtype == wanted:
                return node
            return self._cast(node, value, wanted)
        if type(value) in _CONTAINERS and type(wanted) is type(value) and len(wanted) == len(value):
            if _dtypes_in(value) == wanted:
                return node
            items = [self.restored(self._item(node, value, i), item, want)
                     for i, (item, want) in enumerate(zip(value, wanted))]
            return type(value)(items)
        return node

    def _item(self, node: fx.Node, value, index: int) -> fx.Node:
        with self.gm.graph.inserting_before(self.output):
            item = self.gm.graph.call_function(operator.getitem, (node, index))
        for name in ("nn_module_stack", "stack_trace"):
            if name in node.meta:
                item.meta[name] = node.meta[name]
        self.propagator.record(item, value[index], like=node)
        return item

    def _cast(self, node: fx.Node, value, dtype: torch.dtype) -> fx.Node:
        converted = self.propagator.converted(value, dtype)
        if converted is UNKNOWN:
            raise PassError(f"{PASS_NAME} could not cast output {node.name} to {dtype} on fake values; please "
                            "report this with the model that triggers it.")
        with self.gm.graph.inserting_before(self.output):
            cast = self.gm.graph.create_node("call_method", "to", (node, dtype), {},
                                             name=f"{node.name}_{short_dtype_name(dtype)}")
        for name in ("nn_module_stack", "stack_trace"):
            if name in node.meta:
                cast.meta[name] = node.meta[name]
        cast.meta[CAST_META] = True
        self.propagator.record(cast, converted, like=node)
        return cast
