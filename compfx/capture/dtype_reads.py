"""Dtypes the model's Python reads from activations: where a recorded graph can follow them, and where it keeps them.

The recording tracer runs the model's own Python, so ``x.dtype`` is a plain
``torch.dtype`` by the time the model passes it on. A dtype is one object,
whoever reads it: no tracer that runs the model's Python can tell, in general,
``out.to(hidden.dtype)`` from ``out.to(torch.float32)``. Under a plan that runs
``hidden`` low, eager autocast would cast ``out`` to the low dtype, while a
graph holding the constant still casts it to FP32.

**Followed:** the common case can be told apart. When the first torch call
after a read, on the read's own line, takes the dtype it read
(``out.to(hidden.dtype)``, ``torch.tensor([], dtype=keys.dtype)``: property
reads such as ``x.device`` in between do not count), the graph gets the read
itself, a ``getattr(hidden, "dtype")`` node, as the symbolic tracer writes it,
and the call follows the plan as it does in eager. :class:`DtypeReads` does
this for the recorder. A literal dtype on that line (``softmax(x,
dtype=torch.float32).to(q.dtype)``) comes before the read, so it stays a
literal. A call that also takes a limit of the dtype (``torch.full(shape,
torch.finfo(x.dtype).min, dtype=x.dtype)``) keeps its constant: FP32's limit
would overflow the low dtype.

**Kept, and said:** any other read (``input_dtype = x.dtype`` used lines
later) stays the constant it was at capture. The recorder marks each such
activation (``meta[DTYPE_READ_META]``: its dtype and the line), and
:func:`changed_dtype_reads` names those a planned graph runs in another dtype:
there the plan may round differently from autocast. (The symbolic tracer keeps
every ``x.dtype`` as a node of the graph, which follows the plan; ``torch.finfo``
limits follow by :mod:`compfx.capture.dtype_limits`.)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch.utils import _pytree as pytree

from ._sites import user_line
from .dtype_limits import limit_name
from .nodes import meta_value

__all__ = ["DTYPE_READ_META", "DtypeReads", "mark_dtype_read", "changed_dtype_reads"]

#: ``node.meta`` entry on an activation whose dtype the model's Python read: ``(its dtype then, "file:line (code)")``.
DTYPE_READ_META = "compfx_dtype_read"


def mark_dtype_read(node: fx.Node, dtype: torch.dtype, site: str) -> None:
    """Note that the model read ``node``'s dtype (the first read's line is kept)."""
    if _may_change(node, dtype):
        node.meta.setdefault(DTYPE_READ_META, (dtype, site))


class DtypeReads:
    """The recorder's dtype reads: each is followed by the call that takes it on its line, or marked.

    :meth:`read` holds the latest read until the next call: :meth:`taken_by` then
    says whether that call takes it (and the graph should read the dtype from
    the node), and marks the read as kept otherwise. :meth:`finish` marks a read
    no call came after.
    """

    def __init__(self):
        self._pending: tuple[fx.Node, torch.dtype, str] | None = None

    def read(self, node: fx.Node, dtype: torch.dtype) -> None:
        """The model's Python read ``node``'s dtype, ``dtype``."""
        self.finish()
        if _may_change(node, dtype):
            self._pending = (node, dtype, user_line())

    def taken_by(self, name: str, args, kwargs) -> tuple[fx.Node, torch.dtype] | None:
        """``(node, dtype)`` when the call ``name(*args, **kwargs)`` takes the pending read's dtype on its line."""
        if self._pending is None or name == "__get__":  # x.device, x.shape: property reads between
            return None
        node, dtype, site = self._pending
        self._pending = None
        leaves = pytree.tree_leaves((args, kwargs))
        if any(leaf is dtype for leaf in leaves) and not _holds_a_limit(leaves, dtype) and user_line() == site:
            return node, dtype
        mark_dtype_read(node, dtype, site)
        return None

    def finish(self) -> None:
        if self._pending is not None:
            mark_dtype_read(*self._pending)
            self._pending = None


def _holds_a_limit(leaves, dtype: torch.dtype) -> bool:
    """``torch.full(shape, torch.finfo(x.dtype).min, dtype=x.dtype)``: the limit stays FP32's, which overflows to
    -inf in a low dtype; that call keeps its constant dtype (and the read its note)."""
    return any(limit_name(leaf, dtype) is not None for leaf in leaves)


def _may_change(node: fx.Node, dtype: torch.dtype) -> bool:
    """A plan can change the dtype of a call's floating result (not of an input, a parameter or an integer)."""
    return node.op in ("call_function", "call_method") and dtype.is_floating_point


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
