"""Rewrite pass: a ``torch.finfo`` limit the model read from a tensor's dtype follows the dtype the plan gives it.

Capture marks every call that takes a limit of its own result's dtype as a
literal (:mod:`compfx.graph_capture.dtype_limits`: ``masked_fill(mask, -3.4e38)`` is
``finfo(float32).min``). After :mod:`compfx.passes.insert_casts`, the call may
return another dtype; this pass gives each marked literal the same limit of
that dtype, which is what the model's own ``torch.finfo(x.dtype)`` reads under
autocast. Unmarked literals, and calls whose dtype did not change, are left
as they are.

>>> import torch, compfx
>>> from compfx.passes import follow_dtype_limits, insert_casts
>>> class Masked(torch.nn.Module):
...     def forward(self, q, k, keep):
...         s = q @ k.T
...         return s.masked_fill(~keep, torch.finfo(s.dtype).min)
>>> q, keep = torch.randn(2, 4), torch.tensor([[True, False], [True, True]])
>>> gm = compfx.capture(Masked(), (q, q, keep))
>>> gm = insert_casts(gm, {n.meta["compfx_key"]: "low" for n in compfx.graph_capture.op_nodes(gm)}, low_dtype=torch.bfloat16)
>>> follow_dtype_limits(gm)(q, q, keep)[0, 1].item() == torch.finfo(torch.bfloat16).min
True
"""

from __future__ import annotations

import torch
import torch.fx as fx

from compfx.graph_capture import LIMIT_META, meta_value
from compfx.graph_capture.dtype_limits import limit_value

__all__ = ["follow_dtype_limits"]

PASS_NAME = "follow_dtype_limits"


def follow_dtype_limits(gm: fx.GraphModule) -> fx.GraphModule:
    """Give each marked ``torch.finfo`` literal the limit of the dtype its call returns now; returns ``gm``."""
    changed = False
    for node in gm.graph.nodes:
        if LIMIT_META not in node.meta:
            continue
        captured, limits = node.meta[LIMIT_META]
        value = meta_value(node)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == captured:
            continue
        node.args = tuple(limit_value(limits[i], value.dtype) if i in limits else arg for i, arg in enumerate(node.args))
        node.kwargs = {name: limit_value(limits[name], value.dtype) if name in limits else arg
                       for name, arg in node.kwargs.items()}
        node.meta[LIMIT_META] = (value.dtype, limits)
        changed = True
    if changed:
        gm.recompile()
    return gm
