"""Custom ``torch.autograd.Function`` s captured as one call each, so that they keep their own backward.

``SomeFunction.apply(x)`` runs ``forward`` under no-grad and attaches
``backward`` to the result. A tracer that followed ``forward`` would write
down its ops with autograd switched off, and every parameter upstream of the
Function would get no gradient. So while a tracer runs, ``apply`` goes to the
tracer (:func:`functions_as_calls`), which writes one node whose target is a
:class:`FunctionCall`: the graph calls ``SomeFunction.apply`` itself, and the
plan treats it as one op (its inputs are cast like any op's).

``torch.autograd.Function`` offers no hook for this (``apply`` does not go
through ``__torch_function__``), so :func:`functions_as_calls` swaps
``Function.apply`` for the duration of one trace, as ``torch.fx`` swaps
``nn.Module.__call__`` while it traces; it is put back whatever happens.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

__all__ = ["FunctionCall", "functions_as_calls", "NOT_TRACED", "unrepresentable_argument"]

#: What a tracer's handler returns for a call that is not on its values (the Function then runs as usual).
NOT_TRACED = object()

_FUNCTION = torch.autograd.Function
_APPLY = _FUNCTION.__dict__["apply"]  # the classmethod itself, to put back


class FunctionCall:
    """A graph node's target that calls ``function.apply``: one custom autograd Function, run as itself.

    Its ``__name__`` is the Function's class name in snake case (``FusedGelu``
    -> ``fused_gelu``), which becomes the op kind of its OpKey, as a leaf
    module's class name does.

    >>> class Twice(torch.autograd.Function):
    ...     @staticmethod
    ...     def forward(ctx, x): return 2 * x
    ...     @staticmethod
    ...     def backward(ctx, g): return 2 * g
    >>> call = FunctionCall(Twice)
    >>> call.__name__, type(call(torch.ones(2, requires_grad=True)).grad_fn).__name__
    ('twice', 'TwiceBackward')
    """

    def __init__(self, function: type):
        self.function = function
        self.__name__ = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", function.__name__).lower()
        self.__qualname__ = self.__name__

    def __call__(self, *args, **kwargs):
        return self.function.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionCall({self.function.__qualname__})"

    def __eq__(self, other) -> bool:
        return isinstance(other, FunctionCall) and other.function is self.function

    def __hash__(self) -> int:
        return hash(self.function)

    def __reduce__(self):
        return (FunctionCall, (self.function,))


# What a graph node's arguments can hold besides nodes (torch.fx writes them into Python code as literals).
_LITERALS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format,
             slice, range, type(...))


def unrepresentable_argument(args: tuple, kwargs: dict) -> str | None:
    """The type name of the first argument leaf that is neither a tensor nor a literal a graph can hold, else None.

    >>> unrepresentable_argument((torch.ones(1), 2.0, torch.float16), {}), unrepresentable_argument((print,), {})
    (None, 'builtin_function_or_method')
    """
    for leaf in pytree.tree_leaves((args, kwargs)):
        if not isinstance(leaf, (torch.Tensor, *_LITERALS)):
            return type(leaf).__name__
    return None


# The tracers' handlers, per thread: ``Function.apply`` is swapped for the whole process, and another thread's
# Functions (a training step running while this one captures) must run as usual.
_local = threading.local()
_swaps = [0]  # threads inside functions_as_calls; the last one out puts apply back
_swap_lock = threading.Lock()


def _handlers() -> list[Callable[[FunctionCall, tuple, dict], Any]]:
    if not hasattr(_local, "handlers"):
        _local.handlers = []
    return _local.handlers


def _apply(cls, *args, **kwargs):
    """``Function.apply`` while a tracer runs: the innermost tracer's handler first (this thread's), the real
    ``apply`` if no tracer takes the call (its arguments are none of the tracer's values)."""
    handlers = getattr(_local, "handlers", ())
    if handlers:
        call = FunctionCall(cls)
        for handler in reversed(handlers):
            result = handler(call, args, kwargs)
            if result is not NOT_TRACED:
                return result
    return _APPLY.__get__(None, cls)(*args, **kwargs)


@contextlib.contextmanager
def functions_as_calls(handler: Callable[[FunctionCall, tuple, dict], Any]):
    """While inside, ``SomeFunction.apply(*args, **kwargs)`` in this thread returns
    ``handler(FunctionCall(SomeFunction), args, kwargs)``; a handler returns :data:`NOT_TRACED` for calls that are
    not its own (then ``apply`` runs as usual, as it does in every other thread)."""
    handlers = _handlers()
    handlers.append(handler)
    with _swap_lock:
        _swaps[0] += 1
        _FUNCTION.apply = classmethod(_apply)
    try:
        yield
    finally:
        handlers.remove(handler)
        with _swap_lock:
            _swaps[0] -= 1
            if not _swaps[0]:
                _FUNCTION.apply = _APPLY
