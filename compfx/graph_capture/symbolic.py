"""The symbolic tracer: ``torch.fx`` proxies that carry FakeTensor values, traced through ``torch.nn``.

:func:`compfx.graph_capture.capture` tries it first. ``nn.Linear`` becomes
``F.linear`` reading its parameters with ``get_attr``; each proxy carries the
FakeTensor value its op gives on the example inputs, so the Python checks
inside ``torch.nn`` (``if input.dim() != 4``) and shape-driven branches in user
code resolve the way the example inputs take them. Shape arithmetic stays in
the graph, so its graphs compute shapes at run time. ``torch.no_grad()`` blocks
become ``_set_grad_enabled`` nodes; ``leaf_modules`` (and batch norms that read
their own buffers in Python) stay one ``call_module`` op.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import threading
import warnings
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import BadInputError, CaptureError
from ._sites import ValueBranchError, error_site, first_line, user_line, with_progress
from .autocast_blocks import AutocastBlocks
from .checkpoints import CheckpointRegions, is_reentrant_checkpoint
from .draws import DrawsAsCalls, branch_on_draw
from .functions import NOT_TRACED, FunctionCall, functions_as_calls
from .model_state import get_attribute, named_tensors, reassignment_error
from .nodes import has_side_effects

__all__ = ["symbolic_capture", "reads_its_state_in_python"]


def symbolic_capture(model: nn.Module, args: tuple, kwargs: dict, leaf_modules) -> fx.GraphModule:
    """Trace ``model`` through ``torch.nn`` with FakeTensor-valued proxies; ``meta["val"]`` on every node.

    ``leaf_modules`` (types or qualified names) stay one ``call_module`` op.
    Raises :class:`~compfx.errors.BadInputError` when the inputs do not fit
    ``forward``'s signature, :class:`~compfx.errors.CaptureError` when tracing
    fails (the caller then tries the recording tracer), and its subclass
    ``ValueBranchError`` when the code branches on a tensor's value.
    """
    provided, concrete_args = _bind_inputs(model, args, kwargs)
    tracer = _SpecializingTracer(leaf_modules, FakeTensorMode(allow_non_fake_inputs=True), provided)
    try:
        with (functions_as_calls(tracer.trace_function), AutocastBlocks(tracer.add_call),
              DrawsAsCalls(tracer.trace_draw, is_traced=lambda value: isinstance(value, fx.Proxy))):
            graph = tracer.trace(model, concrete_args=concrete_args or None)
    except CaptureError as error:
        raise with_progress(error, tracer.nodes_traced())
    except Exception as error:  # torch.fx TraceError and friends: say where
        module = tracer.innermost_module()
        raise with_progress(CaptureError(
            f"symbolic tracing failed with {first_line(error)} at {error_site(error)}"
            + (f" inside module {module}" if module else "")
        ), tracer.nodes_traced()) from error
    reassigned = [name for name, value in named_tensors(model) if isinstance(value, fx.Proxy)]
    if reassigned:  # ``self.steps += 1``: a proxy adds out of place, so the graph would lose the update
        raise with_progress(reassignment_error(reassigned), tracer.nodes_traced())
    tracer.restore_grad_mode_before(graph)
    for node in graph.nodes:
        value = tracer.values.get(node)
        if node.op != "output" and not isinstance(value, _UnknownValue):
            node.meta["val"] = value
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__ + "Captured")
    # Dead code here is shape arithmetic that only fed Python control flow.
    gm.graph.eliminate_dead_code(is_impure_node=has_side_effects)
    gm.recompile()
    unknown = [
        f"{node.format_node()} ({first_line(tracer.values[node].error)})"
        for node in gm.graph.nodes
        if isinstance(tracer.values.get(node), _UnknownValue)
    ]
    if unknown:
        raise CaptureError(f"symbolic tracing could not compute example values for: {'; '.join(unknown[:3])}")
    return gm


_CAPTURE_MODES = (AutocastBlocks, DrawsAsCalls)


@contextlib.contextmanager
def _capture_modes_suspended():
    """The capture's own torch-function modes (:data:`_CAPTURE_MODES`), off the top of the mode stack while inside;
    a mode of anyone else's above them keeps them all where they are."""
    stack = torch.overrides._get_current_function_mode_stack()
    ours = 0
    for mode in reversed(stack):
        if not isinstance(mode, _CAPTURE_MODES):
            break
        ours += 1
    with contextlib.ExitStack() as popped:
        for _ in range(ours):
            popped.enter_context(torch.overrides._pop_mode_temporarily())
        yield


class _UnknownValue:
    """Marker for a proxy whose value could not be computed on FakeTensors."""

    def __init__(self, error: BaseException):
        self.error = error


class _ValueProxy(fx.Proxy):
    """A Proxy that knows its example value, so ``len()`` works on it."""

    def __len__(self):
        return len(self.tracer.value_of(self))

    # torch.fx maps these Python 2 names to operator.div, which Python 3 does not have.
    def __div__(self, other):
        return self.tracer.create_proxy("call_function", operator.truediv, (self, other), {})

    def __rdiv__(self, other):
        return self.tracer.create_proxy("call_function", operator.truediv, (other, self), {})


class _SpecializingTracer(fx.Tracer):
    """FX tracer that goes through torch.nn and resolves Python control flow on example values."""

    def __init__(self, leaf_modules: Iterable, fake_mode: FakeTensorMode, inputs: dict[str, Any]):
        super().__init__()
        leaf_modules = tuple(leaf_modules)
        self._leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self._leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.fake_mode = fake_mode
        self._inputs = inputs
        self._fakes: dict[int, torch.Tensor] = {}
        self.values: dict[fx.Node, Any] = {}
        self._computing = False  # True while running an op on example values
        self._thread = threading.get_ident()  # the thread that traces; others pass through its patches
        # Buffers become get_attr nodes too, so in-place updates such as
        # BatchNorm's num_batches_tracked.add_(1) land in the graph instead of
        # running on the user's model while we trace.
        self.proxy_buffer_attributes = True
        self.record_stack_traces = False
        self._grad_mode_at_start = torch.is_grad_enabled()
        self._graph_grad_mode = self._grad_mode_at_start
        self._saved_grad_mode: fx.Node | None = None
        self.regions = CheckpointRegions()  # which ops run inside torch.utils.checkpoint

    # While computing values the tracer's patches must stay out of the way; so must they for other threads, whose
    # module calls and attribute reads go through torch.fx's process-wide patches while this one traces.
    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._computing or threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if self._computing or threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    # -- which modules stay opaque ------------------------------------------
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (qualname in self._leaf_names or (bool(self._leaf_types) and isinstance(m, self._leaf_types))
                or reads_its_state_in_python(m))

    def innermost_module(self) -> str | None:
        """``'path (Class)'`` of the module being traced (after a failure: the one that failed)."""
        if not self.module_stack:
            return None
        path, module_type = list(self.module_stack.values())[-1]
        name = getattr(module_type, "__name__", str(module_type))
        return f"{path or '<root>'} ({name})"

    def nodes_traced(self) -> int:
        """How far tracing got: the nodes written so far (a failure's progress, to compare tracers by)."""
        graph = getattr(self, "graph", None)
        return len(graph.nodes) if graph is not None else 0

    # -- custom autograd Functions and checkpointed regions ---------------------
    def trace_function(self, call: FunctionCall, args, kwargs):
        """``SomeFunction.apply`` on proxies: one node that calls it (its own backward kept); a reentrant
        ``checkpoint`` runs its function in a checkpointed region instead."""
        if self._computing or not any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args, kwargs))):
            return NOT_TRACED
        if is_reentrant_checkpoint(call):
            return self.regions.run_reentrant(args)
        return self.create_proxy("call_function", call, args, kwargs)

    def trace_draw(self, func, args, kwargs):
        """A draw from a factory (``torch.rand([])``): one node, drawn at every call (:class:`DrawsAsCalls`)."""
        if self._computing:
            return func(*args, **kwargs)
        return self.create_proxy("call_function", func, args, kwargs)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        self.regions.mark(node)
        return node

    # -- values ---------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def _fake(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            key = id(value)
            if key not in self._fakes:
                self._fakes[key] = self.fake_mode.from_tensor(value, static_shapes=True)
            return self._fakes[key]
        return value

    def value_of(self, proxy: fx.Proxy):
        value = self.values.get(proxy.node)
        if isinstance(value, _UnknownValue):
            raise CaptureError(
                f"compfx could not compute an example value for {proxy.node.format_node()} "
                f"({first_line(value.error)}), and the model's Python code needs it at {user_line()}. "
                "Mark the module that issues it as a leaf with capture(..., leaf_modules=[...])."
            ) from value.error
        return value

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind != "placeholder":
            self._follow_grad_mode()
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        self.values[proxy.node] = self._compute(kind, target, args, kwargs, proxy.node)
        return proxy

    def _compute(self, kind, target, args, kwargs, node):
        """The node's example value, computed on FakeTensors (an :class:`_UnknownValue` when it cannot be)."""
        self._computing = True
        try:
            # The tracer's own torch calls (making fakes, running the op) are not the model's: they skip the
            # capture's modes, which pass them through anyway, and would cost a Python call each (a quarter of
            # the trace of a small CNN). An autocast block a leaf module opens then runs as autocast.
            with _capture_modes_suspended():
                return self._value_on_fakes(kind, target, args, kwargs, node)
        except Exception as error:  # noqa: BLE001 - only fatal if control flow needs the value
            return _UnknownValue(error)
        finally:
            self._computing = False

    def _value_on_fakes(self, kind, target, args, kwargs, node):
        def concrete(a):
            return self.values.get(a.node) if isinstance(a, fx.Proxy) else self._fake(a)

        if kind == "placeholder":
            return self._fake(self._inputs.get(node.name, self._inputs.get(target.lstrip("*"))))
        if kind == "get_attr":
            return self._fake(get_attribute(self.root, target))
        args, kwargs = pytree.tree_map(concrete, (args, kwargs))
        unknown = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, _UnknownValue)]
        if unknown:
            return unknown[0]
        # Warnings here repeat what the eager run will say anyway.
        with self.fake_mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if kind == "call_function":
                return target(*args, **kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if kind == "call_module":
                return self._run_leaf_on_fakes(self.root.get_submodule(target), args, kwargs)
        return None

    def _run_leaf_on_fakes(self, module: nn.Module, args, kwargs):
        if reads_its_state_in_python(module):
            # Its forward reads a buffer into a Python float, which fakes cannot give;
            # batch norm returns a tensor shaped and typed like its input.
            return torch.empty_like(args[0])
        # functional_call swaps fake copies in for the module's own tensors, so
        # in-place updates (BatchNorm running stats) never touch the user's model.
        state = {name: self._fake(t) for name, t in named_tensors(module)}
        return torch.func.functional_call(module, state, args, kwargs, tie_weights=False)

    # -- torch.no_grad() blocks -------------------------------------------------
    def _follow_grad_mode(self) -> None:
        """Record grad-mode switches (``with torch.no_grad():``) as graph nodes.

        Tracing runs the ``with`` block in Python, so without this the graph
        would compute the block with autograd on. The first switch saves the
        caller's mode at run time; switching back restores that saved mode.
        """
        mode = torch.is_grad_enabled()
        if mode == self._graph_grad_mode:
            return
        if self._saved_grad_mode is None:
            self._saved_grad_mode = self.create_node("call_function", torch.is_grad_enabled, (), {})
            self.values[self._saved_grad_mode] = self._grad_mode_at_start
        target_mode = self._saved_grad_mode if mode == self._grad_mode_at_start else mode
        switch = self.create_node("call_function", torch._C._set_grad_enabled, (target_mode,), {})
        self.values[switch] = None
        self._graph_grad_mode = mode

    def add_call(self, target, args: tuple) -> fx.Node:
        """A call kept for its effect, not a value (the enter and exit of the model's autocast blocks)."""
        self._follow_grad_mode()
        node = self.create_node("call_function", target, args, {})
        self.values[node] = None
        return node

    def restore_grad_mode_before(self, graph: fx.Graph) -> None:
        if self._saved_grad_mode is None or self._graph_grad_mode == self._grad_mode_at_start:
            return
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            restore = graph.call_function(torch._C._set_grad_enabled, (self._saved_grad_mode,))
        self.values[restore] = None

    # -- control flow ---------------------------------------------------------
    def to_bool(self, obj: fx.Proxy) -> bool:
        decided = branch_on_draw(obj.node, value_of=self.values.get)  # layer drop at a setting that fixes it: that side, the draw kept
        if decided is not None:
            return decided
        value = self.value_of(obj)
        try:
            return bool(value)
        except Exception as error:
            raise ValueBranchError(
                f"The model branches on tensor values at {user_line()}. One FX graph cannot hold "
                "both sides of that branch. Rewrite it with torch.where, move it out of forward(), mark "
                "that module as a leaf with capture(..., leaf_modules=[...]), or use "
                "torch.compile(model, backend='compfx'), which splits the graph there."
            ) from error

    def iter(self, obj: fx.Proxy):
        return iter([obj[i] for i in range(len(self.value_of(obj)))])


def reads_its_state_in_python(module: nn.Module) -> bool:
    """Does ``module``'s forward turn one of its own buffers into a Python number at run time?

    BatchNorm with ``momentum=None`` (a cumulative average) computes its factor
    as ``1 / float(num_batches_tracked)`` in training. One graph cannot hold a
    Python number that changes every step, so the symbolic tracer keeps such a
    module whole (one ``call_module`` op that runs its own forward, exactly as
    eager), under the same op key a traced-through batch norm gets.

    >>> import torch
    >>> reads_its_state_in_python(torch.nn.BatchNorm1d(4, momentum=None)), reads_its_state_in_python(torch.nn.BatchNorm1d(4))
    (True, False)
    """
    return (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None and module.training
            and module.track_running_stats)


def _bind_inputs(model: nn.Module, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """(provided arguments by name, defaults of the rest as FX concrete_args)."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise BadInputError(
            f"example inputs do not fit {type(model).__name__}.forward{signature}: {error}. "
            "Pass a tuple of positional arguments or a dict of keyword arguments that forward() accepts."
        ) from error
    provided = dict(bound.arguments)
    concrete_args = {
        name: p.default
        for name, p in signature.parameters.items()
        if name not in provided and p.default is not inspect.Parameter.empty
    }
    return provided, concrete_args
