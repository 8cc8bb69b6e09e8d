"""Rewrite pass: return a graph's floating outputs in the dtypes the original model returned.

After :mod:`compfx.passes.insert_casts` an output can leave in the low dtype
(the last op ran low). The loss and whatever code reads the model's outputs
were written for the model's own dtypes, so this pass casts each such output
back. Read the dtypes with :func:`output_dtypes` *before* the rewrite.

>>> import torch, compfx
>>> from compfx.passes import insert_casts, output_dtypes, restore_output_dtypes
>>> gm = compfx.capture(torch.nn.Linear(4, 2), torch.randn(3, 4))
>>> before = output_dtypes(gm)
>>> gm = insert_casts(gm, {k.meta["compfx_key"]: "low" for k in compfx.op_nodes(gm)}, low_dtype=torch.bfloat16)
>>> restore_output_dtypes(gm, before)(torch.randn(3, 4)).dtype
torch.float32
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx as fx

from compfx.capture import meta_value
from compfx.cast_policy import CAST_META
from compfx.errors import PassError
from compfx.vocabulary import short_dtype_name

from .propagate_dtypes import UNKNOWN, DtypePropagator

__all__ = ["output_dtypes", "restore_output_dtypes"]

PASS_NAME = "restore_output_dtypes"


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _output_args(gm: fx.GraphModule) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(_output_node(gm).args, lambda n: found.append(n) or n)
    return found


def output_dtypes(gm: fx.GraphModule) -> list[torch.dtype | None]:
    """The dtype of each node the graph returns (None where it is not one floating tensor), in order."""
    dtypes = []
    for node in _output_args(gm):
        value = meta_value(node)
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        dtypes.append(value.dtype if floating else None)
    return dtypes


def restore_output_dtypes(gm: fx.GraphModule, dtypes: Sequence[torch.dtype | None]) -> fx.GraphModule:
    """Cast each returned node back to ``dtypes[i]`` (from :func:`output_dtypes`) where it differs; returns ``gm``.

    Being returned is a use like any other (:func:`compfx.cast_policy.shares_cast`):
    an output gets a cast of its own even where an op already reads a cast of the
    same tensor to the same dtype.
    """
    outputs = _output_args(gm)
    if len(outputs) != len(dtypes):
        raise PassError(f"{PASS_NAME}: the graph returns {len(outputs)} nodes but {len(dtypes)} dtypes were given; "
                        "read them with output_dtypes(gm) before rewriting gm.")
    output = _output_node(gm)
    propagator = DtypePropagator(gm)
    replace: dict[fx.Node, fx.Node] = {}
    for node, wanted in zip(outputs, dtypes):
        value = meta_value(node)
        if (wanted is None or node in replace or not isinstance(value, torch.Tensor)
                or not value.is_floating_point() or value.dtype == wanted):
            continue
        replace[node] = _insert_cast(gm, propagator, node, wanted, output)
    if replace:
        output.args = fx.node.map_arg(output.args, lambda n: replace.get(n, n))
        gm.graph.lint()
        gm.recompile()
    return gm


def _insert_cast(gm: fx.GraphModule, propagator: DtypePropagator, node: fx.Node, dtype: torch.dtype,
                 output: fx.Node) -> fx.Node:
    value = propagator.converted(meta_value(node), dtype)
    if value is UNKNOWN:
        raise PassError(f"{PASS_NAME} could not cast output {node.name} to {dtype} on fake values; please report "
                        "this with the model that triggers it.")
    with gm.graph.inserting_before(output):
        cast = gm.graph.create_node("call_method", "to", (node, dtype), {},
                                    name=f"{node.name}_{short_dtype_name(dtype)}")
    for name in ("nn_module_stack", "stack_trace"):
        if name in node.meta:
            cast.meta[name] = node.meta[name]
    cast.meta[CAST_META] = True
    propagator.record(cast, value, like=node)
    return cast
