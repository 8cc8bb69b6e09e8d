"""Constants a model reads from a tensor's dtype: ``torch.finfo(x.dtype).min`` and its kin.

The tracers run the model's Python on the values of one capture, in FP32, so
the masking of many attention implementations,
``scores.masked_fill(~mask, torch.finfo(scores.dtype).min)``, reaches the graph
as the literal ``-3.4e38``. Under a plan that runs ``scores`` in bf16 the
literal overflows bf16 (PyTorch refuses it; Inductor makes it ``-inf``, and
training turns to NaN), where eager autocast would have read bf16's limit.

**The rule**, applied in one place: a float literal argument of a call that
equals ``min``, ``max``, ``eps`` or ``tiny`` of the floating dtype the call
returned at capture is that limit of that dtype. :func:`mark_dtype_limits`
writes which limit each such argument is (``node.meta[LIMIT_META]``), and
:mod:`compfx.passes.follow_dtype_limits` gives it the same limit of the dtype
the plan makes the call return. The call's own result stands for the tensor
whose dtype the model read: ``masked_fill``, ``where``, ``clamp``, ``full_like``
and arithmetic return that tensor's dtype. A limit read from one tensor and
applied to a tensor of another dtype is not seen. ``torch.iinfo`` limits need
nothing: a plan never changes an integer dtype.

>>> import torch
>>> limit_name(torch.finfo(torch.float32).min, torch.float32), limit_name(-1e9, torch.float32)
('min', None)
>>> limit_value("min", torch.bfloat16) == torch.finfo(torch.bfloat16).min
True
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .nodes import meta_value

__all__ = ["LIMIT_META", "DTYPE_LIMITS", "limit_name", "limit_value", "mark_dtype_limits"]

#: ``node.meta`` entry: ``(the dtype the literals are limits of, {argument position: limit name})``.
LIMIT_META = "compfx_dtype_limits"

#: The ``torch.finfo`` fields models read to mask, clamp and guard divisions.
DTYPE_LIMITS = ("min", "max", "eps", "tiny")


def limit_name(value, dtype: torch.dtype) -> str | None:
    """The :data:`DTYPE_LIMITS` field of ``dtype`` that ``value`` is, or None."""
    if type(value) is not float or not dtype.is_floating_point:
        return None
    info = torch.finfo(dtype)
    return next((name for name in DTYPE_LIMITS if getattr(info, name) == value), None)


def limit_value(name: str, dtype: torch.dtype) -> float:
    """The ``name`` limit of ``dtype`` (``torch.finfo(dtype).<name>``)."""
    return float(getattr(torch.finfo(dtype), name))


def mark_dtype_limits(gm: fx.GraphModule) -> int:
    """Write :data:`LIMIT_META` on every call whose literal arguments are limits of its floating result's dtype.

    Returns how many calls it marked. Literals nested in lists or tuples are not read.
    """
    marked = 0
    for node in gm.graph.nodes:
        node.meta.pop(LIMIT_META, None)
        value = meta_value(node)
        if node.op not in ("call_function", "call_method") or not isinstance(value, torch.Tensor):
            continue
        positions = {position: limit_name(arg, value.dtype)
                     for position, arg in [*enumerate(node.args), *node.kwargs.items()]}
        positions = {position: name for position, name in positions.items() if name is not None}
        if positions:
            node.meta[LIMIT_META] = (value.dtype, positions)
            marked += 1
    return marked
