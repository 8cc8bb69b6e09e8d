"""Dtypes the model's Python reads from activations: where a recorded graph can follow them, and where it keeps them.

The recording tracer runs the model's own Python, so ``x.dtype`` is a plain
``torch.dtype`` by the time the model passes it on. A dtype is one object,
whoever reads it: no tracer that runs the model's Python can tell, in general,
``out.to(hidden.dtype)`` from ``out.to(torch.float32)``. Under a plan that runs
``hidden`` low, eager autocast would cast ``out`` to the low dtype, while a
graph holding the constant still casts it to FP32.

**Followed:** the common cases can be told apart, and then the graph gets
the read itself, a ``getattr(hidden, "dtype")`` node, as the symbolic tracer
writes it, so the call follows the plan as it does in eager
(:class:`DtypeReads` does this for the recorder):

* the first torch call after a read, on the read's own line, takes the dtype
  it read (``out.to(hidden.dtype)``, ``torch.tensor([], dtype=keys.dtype)``:
  property reads such as ``x.device`` in between do not count). A literal
  earlier on that line (``softmax(x, dtype=torch.float32).to(q.dtype)``) comes
  before the read, so it stays a literal;
* the read's line assigns a local (an RMSNorm's ``input_dtype =
  hidden.dtype``), and a later call in the same frame takes the dtype on a
  line that names that local and spells no dtype (``hidden.to(input_dtype)``;
  ``hidden.to(torch.float32)`` between is a literal).

A call that also takes a limit of the dtype (``torch.full(shape,
torch.finfo(x.dtype).min, dtype=x.dtype)``) follows too, and its limit with it:
:mod:`compfx.graph_capture.dtype_limits` marks the literal, and the follow pass gives
it the planned dtype's limit (FP32's would overflow the low dtype). A read for
a ``finfo`` limit alone gets no note where such a limit downstream followed.

**Kept, and said:** any other read (a dtype passed to a helper that casts,
``a, b = x.dtype, y.dtype``) stays the constant it was at capture. The recorder marks each such
activation (``meta[DTYPE_READ_META]``: its dtype and the line), and
:func:`changed_dtype_reads` names those a planned graph runs in another dtype:
there the plan may round differently from autocast. (The symbolic tracer keeps
every ``x.dtype`` as a node of the graph, which follows the plan; ``torch.finfo``
limits follow by :mod:`compfx.graph_capture.dtype_limits`.)
"""

from __future__ import annotations

import linecache
import re
import types
from dataclasses import dataclass

import torch
import torch.fx as fx

from torch.utils import _pytree as pytree

from ._sites import frame_site, user_frame
from .dtype_limits import LIMIT_META
from .nodes import meta_value

__all__ = ["DTYPE_READ_META", "DtypeReads", "mark_dtype_read", "changed_dtype_reads"]

#: ``node.meta`` entry on an activation whose dtype the model's Python read: ``(its dtype then, "file:line (code)")``.
DTYPE_READ_META = "compfx_dtype_read"


def mark_dtype_read(node: fx.Node, dtype: torch.dtype, site: str) -> None:
    """Note that the model read ``node``'s dtype (the first read's line is kept)."""
    if _may_change(node, dtype):
        node.meta.setdefault(DTYPE_READ_META, (dtype, site))


@dataclass(eq=False)
class _Read:
    """One read of an activation's dtype: where (the frame, and its line then), and what became of it."""

    node: fx.Node
    dtype: torch.dtype
    frame: types.FrameType | None
    lineno: int
    site: str
    followed: bool = False  # a call took it, and the graph reads it from the node
    on_its_line: bool = False  # ... the first call after it, on its line: the value went nowhere else
    kept: bool = False  # a call took it, or maybe took it, as a constant


class DtypeReads:
    """The recorder's dtype reads: each followed by the calls that take it, where that can be told, or marked.

    A call that takes a dtype the model read follows the read (:meth:`taken_by`
    returns the node to read it from) in two cases that can be told from a
    literal: the first call after the read, on its line; and a call, in the
    same frame, on a line that names the local the read's line assigned
    (``input_dtype = x.dtype`` ... ``y.to(input_dtype)``) and spells no dtype
    literally. A call that takes the dtype otherwise, on a line that spells no
    dtype (a helper passed ``input_dtype``), keeps it as a constant, for every
    read of that dtype that it may have come from (all but those a call on
    their own line took: that value went nowhere else). A read
    that no call followed, or one that some call kept, is marked at
    :meth:`finish` (:func:`mark_dtype_read`): the plan may round otherwise there.
    """

    def __init__(self):
        self._pending: _Read | None = None  # the latest read, until the next call
        self._reads: list[_Read] = []

    def read(self, node: fx.Node, dtype: torch.dtype) -> None:
        """The model's Python read ``node``'s dtype, ``dtype``."""
        self._pending = None
        if _may_change(node, dtype):
            frame = user_frame()
            self._pending = _Read(node, dtype, frame, frame.f_lineno if frame else 0, frame_site(frame))
            self._reads.append(self._pending)

    def taken_by(self, name: str, args, kwargs) -> tuple[fx.Node, torch.dtype] | None:
        """``(node, dtype)`` when the call ``name(*args, **kwargs)`` takes a read dtype the graph should follow."""
        if name == "__get__":  # x.device, x.shape: property reads between a read and its call
            return None
        pending, self._pending = self._pending, None
        dtypes = [a for a in (*args, *kwargs.values()) if type(a) is torch.dtype]
        if not dtypes or not self._reads:
            return None
        frame = user_frame()
        read = None
        if pending is not None and pending.dtype in dtypes and _at(frame, pending):
            read = pending  # the first call after the read, on its line
        elif frame is not None:
            read = _named_local_read(frame, [r for r in self._reads if r.frame is frame and r.dtype in dtypes])
        if read is not None:
            read.followed, read.on_its_line = True, read is pending
            return read.node, read.dtype
        if frame is None or not _spells_a_dtype(_source(frame)):  # not a literal: maybe one of the reads
            for other in self._reads:
                other.kept |= other.dtype in dtypes and not other.on_its_line
        return None

    def finish(self) -> None:
        """Mark every read that no call followed, or that some call kept as a constant."""
        for read in self._reads:
            if read.kept or not read.followed:
                mark_dtype_read(read.node, read.dtype, read.site)
        self._reads, self._pending = [], None


def _at(frame: types.FrameType | None, read: _Read) -> bool:
    return frame is not None and frame is read.frame and frame.f_lineno == read.lineno


#: ``name = ...`` (or ``name: type = ...``) at the start of a line: the local a read's line assigns.
_ASSIGNMENT = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)")

#: A dtype spelled out on a line (``torch.float32``, ``torch.half``): a call there may take the literal.
_DTYPE_LITERAL = re.compile(r"\btorch\.(?:float|double|half|bfloat16|float(?:8_\w+|16|32|64))\b")


def _named_local_read(frame: types.FrameType, reads: list[_Read]) -> _Read | None:
    """The one read, of ``reads`` (this frame's, of the call's dtype), whose line assigned a local that the
    current line names, and that still holds the dtype read; None when there is none, or more than one."""
    line = _source(frame)
    if len(reads) != 1 or _spells_a_dtype(line):
        return None
    (read,) = reads
    assigned = _ASSIGNMENT.match(linecache.getline(frame.f_code.co_filename, read.lineno))
    if assigned is None or frame.f_locals.get(assigned.group(1)) is not read.dtype:
        return None
    return read if re.search(rf"\b{assigned.group(1)}\b", line) else None


def _source(frame: types.FrameType) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def _spells_a_dtype(line: str) -> bool:
    return _DTYPE_LITERAL.search(line) is not None


def _may_change(node: fx.Node, dtype: torch.dtype) -> bool:
    """A plan can change the dtype of a call's floating result (not of an input, a parameter or an integer)."""
    return node.op in ("call_function", "call_method") and dtype.is_floating_point


def changed_dtype_reads(gm: fx.GraphModule) -> list[str]:
    """One line per activation whose dtype the model read and the (planned) graph changed, in graph order.

    A read for a ``torch.finfo`` limit is left out where a call downstream holds a limit that
    :mod:`compfx.passes.follow_dtype_limits` gave the planned dtype: the graph already reads what the model would
    (``s.masked_fill(~mask, torch.finfo(q.dtype).min)``, DeBERTa's masking).
    """
    changed = []
    for node in gm.graph.nodes:
        if DTYPE_READ_META not in node.meta:
            continue
        dtype, site = node.meta[DTYPE_READ_META]
        value = meta_value(node)
        if isinstance(value, torch.Tensor) and value.dtype != dtype and not _limit_followed(node, site, value.dtype):
            changed.append(f"{site}: the model reads the dtype of {node.name}, {str(value.dtype)[6:]} under this plan, "
                           f"and the graph keeps the {str(dtype)[6:]} it read at capture")
    return changed


#: ``x.dtype`` inside ``torch.finfo(...)`` (or ``finfo(...)``).
_LIMIT_READ = re.compile(r"\bfinfo\(\s*[\w.\[\]]+\.dtype\s*\)")


def _limit_followed(node: fx.Node, site: str, dtype: torch.dtype) -> bool:
    """Does ``site``'s line read the dtype for a ``finfo`` limit (the read a line's call does not take: that one is
    followed), and does a call downstream of ``node`` hold a limit of ``dtype``
    (:data:`~compfx.graph_capture.dtype_limits.LIMIT_META`, as the follow pass leaves it)?"""
    if not _LIMIT_READ.search(site):
        return False
    seen, frontier = set(), [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            if LIMIT_META in user.meta and user.meta[LIMIT_META][0] == dtype:
                return True
            frontier.append(user)
    return False
