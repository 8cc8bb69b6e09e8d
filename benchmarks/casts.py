"""Cast counting for the AMP-vs-compfx comparison.

One counter for every mode: trace the forward with ``make_fx`` on FakeTensors
(nothing runs) under the mode's autocast, and count the ``aten._to_copy`` /
``prims.convert_element_type`` nodes that change a floating dtype. For AMP that
counts autocast's own casts; for compfx it counts the casts the plan inserted
(plus any inside composite ops it runs under autocast). Both the traced forward
and an applied GraphModule are counted with ``compfx.passes.count_casts``.

>>> import torch
>>> from contextlib import nullcontext
>>> count_forward_casts(torch.nn.Linear(4, 2), (torch.randn(3, 4),), lambda: nullcontext())
0
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from compfx.passes import count_casts

__all__ = ["count_forward_casts", "count_graph_casts", "unwrap_compiled"]


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The eager module under a ``torch.compile`` wrapper (casts are counted on the eager graph); for a
    :class:`compfx.planned_module.PlannedModule`, its graph of the inputs the search started from."""
    module = getattr(module, "_orig_mod", module)
    return getattr(module, "graph_module", module)


def count_forward_casts(module: nn.Module, inputs: tuple, autocast: Callable) -> int:
    """Dtype casts in one forward of ``module`` under ``autocast()`` (a context-manager factory)."""
    module = unwrap_compiled(module)
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def forward(state, inputs):
        with autocast():
            return torch.func.functional_call(module, state, inputs)

    return count_casts(make_fx(forward, tracing_mode="fake")(state, inputs))


def count_graph_casts(gm: nn.Module) -> tuple[int, str]:
    """Cast nodes in an applied GraphModule, with the name of the counter used."""
    return count_casts(unwrap_compiled(gm)), "compfx.passes.count_casts"
