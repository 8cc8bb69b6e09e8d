"""Branches on a random draw: decided by the model's settings, or different from step to step.

Layer drop is written ``if torch.rand([]) < self.layerdrop: skip the layer``
(Hugging Face's BART, Whisper and about forty other models of some
transformers releases run the draw even when ``layerdrop`` is 0). A uniform
draw from ``[0, 1)`` compared with 0 (or with 1 and above) has one outcome
whatever it draws, so that branch is a setting, not data: the tracer takes
the side the setting fixes and keeps the draw itself in the graph, since it
advances the generator and later dropout masks must match eager's. Compared
with a value inside ``(0, 1)``, the branch goes either way from step to step,
and no single graph holds it: the error names the setting to change.

>>> import operator
>>> fixed_outcome(operator.lt, 0.0), fixed_outcome(operator.lt, 0.1), fixed_outcome(operator.ge, 0)
(False, None, True)
"""

from __future__ import annotations

import functools
import math
import operator
import re
from typing import Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._sites import ValueBranchError, user_line

__all__ = ["fixed_outcome", "branch_on_draw", "draws_random_numbers", "DrawsAsCalls"]

#: Calls that draw uniformly from [0, 1).
_UNIFORM_DRAWS = (torch.rand, torch.rand_like)
#: Comparisons, as the tracers write them (operator functions, torch functions, Tensor method names).
_COMPARISONS = {operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=",
                torch.lt: "<", torch.le: "<=", torch.gt: ">", torch.ge: ">=",
                "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
                "__lt__": "<", "__le__": "<=", "__gt__": ">", "__ge__": ">="}


def fixed_outcome(comparison, bound: float, dtype: torch.dtype = torch.float32) -> bool | None:
    """``u <comparison> bound`` for every draw ``u`` in ``[0, 1)``: True, False, or None when it depends on ``u``.

    ``comparison`` is ``operator.lt`` (or another key of the comparisons the
    tracers write); ``u`` can be exactly 0 but never 1. The draw's ``dtype``
    is the comparison's: torch rounds a Python number to it first (``-1e-300``
    is ``-0.0`` in float32, and ``u <= -0.0`` holds for ``u == 0``).
    """
    symbol = _COMPARISONS[comparison]
    with unset_fake_temporarily():  # called while a tracer's FakeTensorMode runs: round on a real tensor
        bound = torch.tensor(bound, dtype=torch.float64).to(dtype).item()
    if math.isnan(bound):
        return False
    if symbol == "<":
        return False if bound <= 0 else True if bound >= 1 else None
    if symbol == "<=":
        return False if bound < 0 else True if bound >= 1 else None
    if symbol == ">":
        return True if bound < 0 else False if bound >= 1 else None
    return True if bound <= 0 else False if bound >= 1 else None  # >=


def _draw_comparison(node: fx.Node | None, value_of: Callable) -> tuple[object, float, torch.dtype] | None:
    """(comparison, bound, the draw's dtype) when ``node`` compares a uniform [0, 1) draw with a Python number, else None."""
    if node is None or node.op not in ("call_function", "call_method") or len(node.args) != 2:
        return None
    comparison = node.target
    if comparison not in _COMPARISONS:
        return None
    draw, bound = node.args
    value = value_of(draw) if isinstance(draw, fx.Node) else None
    is_draw = (draw.op == "call_function" and draw.target in _UNIFORM_DRAWS and isinstance(value, torch.Tensor)
               and value.is_floating_point()) if isinstance(draw, fx.Node) else False
    if not is_draw or isinstance(bound, bool) or not isinstance(bound, (int, float)):
        return None
    return comparison, float(bound), value.dtype


def branch_on_draw(node: fx.Node | None, value_of: Callable = lambda node: node.meta.get("val")) -> bool | None:
    """The side a branch on ``node``'s value takes, when ``node`` is a draw compared with a bound that fixes it.
    ``value_of`` reads a node's example value (``meta["val"]``, where the tracer has written it).

    None when ``node`` is no such comparison (the caller refuses the branch as
    any other); :class:`ValueBranchError` naming the setting when the outcome
    depends on the draw.
    """
    found = _draw_comparison(node, value_of)
    if found is None:
        return None
    comparison, bound, dtype = found
    outcome = fixed_outcome(comparison, bound, dtype)
    if outcome is not None:
        return outcome
    line = user_line()
    names = sorted(set(re.findall(r"\b(?:self|config)\.(\w+)", line)) - {"training"})
    setting = f"the setting it compares with ({', '.join(names)}, now {bound:g})" if names else \
        f"the value it compares with (now {bound:g})"
    raise ValueBranchError(
        f"The model branches on a random draw at {line}: a uniform draw {_COMPARISONS[comparison]} {bound:g} is "
        "true on some steps and false on others, and one FX graph cannot hold both sides. Set "
        f"{setting} to a value that fixes the outcome, 0 or 1 (0 turns layer drop off: for a Hugging Face model, "
        "layerdrop=0, encoder_layerdrop=0 or decoder_layerdrop=0 in its config).")


@functools.lru_cache(maxsize=None)
def draws_random_numbers(func) -> bool:
    """Does the torch function ``func`` draw from the random generator (``torch.rand``, ``torch.randn``,
    ``torch.randint``, ``torch.normal``, ...)? Read from the ATen operator's ``nondeterministic_seeded`` tag.

    >>> draws_random_numbers(torch.randn), draws_random_numbers(torch.zeros)
    (True, False)
    """
    name = getattr(func, "__name__", None)
    packet = getattr(torch.ops.aten, name, None) if isinstance(name, str) else None
    if packet is None:
        return False
    try:
        return any(torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags for overload in packet.overloads())
    except (AttributeError, RuntimeError):
        return False


class DrawsAsCalls(TorchFunctionMode):
    """While tracing: a draw from a torch factory whose arguments hold no traced value (``torch.rand([])``,
    ``torch.randn(16)``) goes to ``record(func, args, kwargs)``, which writes it down as a call.

    A tracer that follows the model's Python with proxies would otherwise run the draw once, at capture, and keep
    its result as a constant: the same "random" numbers on every step, and a branch on them taken once for all.
    """

    def __init__(self, record: Callable, is_traced: Callable[[object], bool]):
        super().__init__()
        self.record, self.is_traced = record, is_traced

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (draws_random_numbers(func) and not _is_tensor_method(func)
                and not any(self.is_traced(leaf) for leaf in pytree.tree_leaves((args, kwargs)))):
            return self.record(func, args, kwargs)
        return func(*args, **kwargs)


def _is_tensor_method(func) -> bool:
    return getattr(func, "__qualname__", "").startswith(("Tensor.", "TensorBase.")) or \
        getattr(func, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase)
