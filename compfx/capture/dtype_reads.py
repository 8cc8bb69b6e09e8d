"""Dtypes the model's Python reads from activations: a recorded graph keeps them as they were at capture.

The recording tracer runs the model's own Python, so ``out.to(hidden.dtype)``
reaches the graph as ``out.to(torch.float32)``: the dtype ``hidden`` had at
capture. Under a plan that runs ``hidden`` low, eager autocast would have cast
``out`` to the low dtype; the graph still casts it to FP32. No tracer that runs
the model's Python can tell ``hidden.dtype`` from a literal ``torch.float32``
(a dtype is one object, whoever reads it), so the constant stays; what compfx
can do is say so. The recorder marks each activation whose dtype the model
read (``meta[DTYPE_READ_META]``: its dtype and the line), and
:func:`changed_dtype_reads` names those a planned graph runs in another dtype:
there the plan may round differently from autocast. (The symbolic tracer keeps
``x.dtype`` as a node of the graph, which follows the plan; ``torch.finfo``
limits follow by :mod:`compfx.capture.dtype_limits`.)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .nodes import meta_value

__all__ = ["DTYPE_READ_META", "mark_dtype_read", "changed_dtype_reads"]

#: ``node.meta`` entry on an activation whose dtype the model's Python read: ``(its dtype then, "file:line (code)")``.
DTYPE_READ_META = "compfx_dtype_read"


def mark_dtype_read(node: fx.Node, dtype: torch.dtype, site: str) -> None:
    """Note that the model read ``node``'s dtype (the first read's line is kept)."""
    if node.op in ("call_function", "call_method") and dtype.is_floating_point:
        node.meta.setdefault(DTYPE_READ_META, (dtype, site))


def changed_dtype_reads(gm: fx.GraphModule) -> list[str]:
    """One line per activation whose dtype the model read and the (planned) graph changed, in graph order."""
    changed = []
    for node in gm.graph.nodes:
        if DTYPE_READ_META not in node.meta:
            continue
        dtype, site = node.meta[DTYPE_READ_META]
        value = meta_value(node)
        if isinstance(value, torch.Tensor) and value.dtype != dtype:
            changed.append(f"{site}: the model reads the dtype of {node.name}, {str(value.dtype)[6:]} under this plan, "
                           f"and the graph keeps the {str(dtype)[6:]} it read at capture")
    return changed
