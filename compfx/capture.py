"""Stage 1 of the pipeline: model -> functional FX graph with an OpKey on every op.

Two tracers, one result:

* **symbolic** (tried first): ``torch.fx`` tracing that goes *through* built-in
  ``torch.nn`` modules, so ``nn.Linear`` becomes ``F.linear`` reading its
  parameters with ``get_attr``. Each proxy carries a FakeTensor value, so the
  Python checks inside ``torch.nn`` (``if input.dim() != 4``) and shape-driven
  branches in user code resolve the way the example inputs take them.
* **dynamo** (fallback): ``torch._dynamo.export``, for models that plain FX
  cannot follow (Hugging Face models, for example). Its parameters are
  re-pointed at the model's own FQNs so both graphs look alike.

Either way every node gets ``meta["val"]`` (a FakeTensor or Python value),
tensor nodes get ``meta["tensor_meta"]`` (shape, dtype), and every numerical op
gets ``meta[KEY_META]`` (an :class:`~compfx.opkey.OpKey`). Capture leaves the
model as it found it: same mode, same parameters, same buffers.

Graphs that ``torch.compile`` hands a backend are keyed the same way with
:func:`key_dynamo_graph`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import os
import traceback
import warnings
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from .errors import BadInputError, CaptureError
from .opkey import KEY_META, OpKey, assign_op_keys, normalize_kind

__all__ = [
    "capture",
    "key_dynamo_graph",
    "buffers_restored",
    "normalize_example_inputs",
    "ExampleInputs",
    "DATA_MOVEMENT_KINDS",
    "is_data_movement",
    "is_in_place",
    "writes_input",
    "has_side_effects",
    "is_numerical_op",
    "produces_float",
    "op_nodes",
    "meta_value",
    "get_attribute",
    "named_tensors",
]

#: Positional args and keyword args for one forward call.
ExampleInputs = tuple[tuple, dict]

# Ops that only move or reinterpret data (or build constants). They get no
# precision bit of their own: their output dtype follows their input (CoMP's
# "pure data movement"). Explicit casts (.float(), .to()) are the user's own.
DATA_MOVEMENT_KINDS = frozenset(
    """view reshape permute transpose t contiguous flatten unflatten squeeze unsqueeze expand
    expand_as repeat repeat_interleave getitem cat concat concatenate stack split chunk unbind
    narrow select slice index_select gather clone detach to type_as size dim getattr numel flip
    roll movedim swapaxes split_with_sizes tensor_split masked_fill zeros_like ones_like
    empty_like full_like new_zeros new_ones new_empty new_full pad constant_pad_nd zeros ones
    arange full empty type float half bfloat16 double cpu cuda tril triu""".split()
)


def is_data_movement(kind: str) -> bool:
    """True for kinds that only move data and so follow their input's precision.

    >>> is_data_movement("permute"), is_data_movement("linear")
    (True, False)
    """
    return kind in DATA_MOVEMENT_KINDS


def meta_value(node: fx.Node, default=None):
    """The node's recorded value: ``meta["val"]`` (compfx, export) or ``meta["example_value"]`` (dynamo), else ``default``."""
    for name in ("val", "example_value"):
        if node.meta.get(name) is not None:
            return node.meta[name]
    return default


def produces_float(node: fx.Node) -> bool:
    """True when the node's recorded value holds a floating-point tensor."""
    value = meta_value(node)
    return any(
        isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in pytree.tree_leaves(value)
    )


def is_numerical_op(node: fx.Node) -> bool:
    """The filter that decides which call nodes get an OpKey (both tracers use it).

    A numerical op computes floating-point values: leaf modules that return
    floats, and every float-producing call that is not pure data movement.
    """
    if node.op == "call_module":
        return produces_float(node)
    return not is_data_movement(normalize_kind(node.op, node.target)) and produces_float(node)


def op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that carry an OpKey, in graph order."""
    return [n for n in gm.graph.nodes if KEY_META in n.meta]


def normalize_example_inputs(example_inputs) -> ExampleInputs:
    """Accept a tensor, a tuple/list of positional args, a dict of kwargs, or ``(args, kwargs)``.

    >>> import torch
    >>> normalize_example_inputs({"input_ids": torch.zeros(1, 3)})[0]
    ()
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        if len(example_inputs) == 2 and isinstance(example_inputs[0], tuple) and isinstance(example_inputs[1], dict):
            return tuple(example_inputs[0]), dict(example_inputs[1])
        return tuple(example_inputs), {}
    raise BadInputError(
        f"example_inputs is a {type(example_inputs).__name__}; compfx expected a tensor, a tuple of "
        "positional arguments or a dict of keyword arguments for model.forward."
    )


# ---------------------------------------------------------------------------
# where did it go wrong? (file:line of the user's code, not of torch or compfx)

_SKIPPED_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, __file__)
)


def _is_user_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return not path.startswith(_SKIPPED_DIRS) and not filename.startswith("<")


def _format_frame(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"


def _user_line(frames: Iterable[traceback.FrameSummary] | None = None) -> str:
    """File:line and source of the innermost frame outside torch and compfx."""
    frames = list(traceback.extract_stack() if frames is None else frames)
    for frame in reversed(frames):
        if _is_user_frame(frame.filename):
            return _format_frame(frame)
    return "an unknown line"


def _error_site(error: BaseException) -> str:
    """Where ``error`` was raised in user code (dynamo keeps that in ``real_stack``)."""
    real_stack = getattr(error, "real_stack", None)
    if real_stack:
        return _user_line(real_stack)
    return _user_line(traceback.extract_tb(error.__traceback__))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class _ValueBranchError(CaptureError):
    """The model branches on tensor values; no tracer can make one graph of that."""


# ---------------------------------------------------------------------------
# symbolic capture


class _UnknownValue:
    """Marker for a proxy whose value could not be computed on FakeTensors."""

    def __init__(self, error: BaseException):
        self.error = error


class _ValueProxy(fx.Proxy):
    """A Proxy that knows its example value, so ``len()`` works on it."""

    def __len__(self):
        return len(self.tracer.value_of(self))


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
        # Buffers become get_attr nodes too, so in-place updates such as
        # BatchNorm's num_batches_tracked.add_(1) land in the graph instead of
        # running on the user's model while we trace.
        self.proxy_buffer_attributes = True
        self.record_stack_traces = True
        self._grad_mode_at_start = torch.is_grad_enabled()
        self._graph_grad_mode = self._grad_mode_at_start
        self._saved_grad_mode: fx.Node | None = None

    # While computing values the tracer's patches must stay out of the way.
    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if self._computing:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    # -- which modules stay opaque ------------------------------------------
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self._leaf_names or (bool(self._leaf_types) and isinstance(m, self._leaf_types))

    def innermost_module(self) -> str | None:
        """``'path (Class)'`` of the module being traced (after a failure: the one that failed)."""
        if not self.module_stack:
            return None
        path, module_type = list(self.module_stack.values())[-1]
        name = getattr(module_type, "__name__", str(module_type))
        return f"{path or '<root>'} ({name})"

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
                f"({_first_line(value.error)}), and the model's Python code needs it at {_user_line()}. "
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
        def concrete(a):
            return self.values.get(a.node) if isinstance(a, fx.Proxy) else self._fake(a)

        self._computing = True
        try:
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
        except Exception as error:  # noqa: BLE001 - only fatal if control flow needs the value
            return _UnknownValue(error)
        finally:
            self._computing = False
        return None

    def _run_leaf_on_fakes(self, module: nn.Module, args, kwargs):
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

    def restore_grad_mode_before(self, graph: fx.Graph) -> None:
        if self._saved_grad_mode is None or self._graph_grad_mode == self._grad_mode_at_start:
            return
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            restore = graph.call_function(torch._C._set_grad_enabled, (self._saved_grad_mode,))
        self.values[restore] = None

    # -- control flow ---------------------------------------------------------
    def to_bool(self, obj: fx.Proxy) -> bool:
        value = self.value_of(obj)
        try:
            return bool(value)
        except Exception as error:
            raise _ValueBranchError(
                f"The model branches on tensor values at {_user_line()}. One FX graph cannot hold "
                "both sides of that branch. Rewrite it with torch.where, move it out of forward(), mark "
                "that module as a leaf with capture(..., leaf_modules=[...]), or use "
                "torch.compile(model, backend='compfx'), which splits the graph there."
            ) from error

    def iter(self, obj: fx.Proxy):
        return iter([obj[i] for i in range(len(self.value_of(obj)))])


def get_attribute(root: nn.Module, target: str):
    """The object a ``get_attr`` node's dotted ``target`` names in ``root`` (a parameter, buffer or module)."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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


def _symbolic_capture(model: nn.Module, args: tuple, kwargs: dict, leaf_modules) -> fx.GraphModule:
    provided, concrete_args = _bind_inputs(model, args, kwargs)
    tracer = _SpecializingTracer(leaf_modules, FakeTensorMode(allow_non_fake_inputs=True), provided)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args or None)
    except CaptureError:
        raise
    except Exception as error:  # torch.fx TraceError and friends: say where
        module = tracer.innermost_module()
        raise CaptureError(
            f"symbolic tracing failed with {_first_line(error)} at {_error_site(error)}"
            + (f" inside module {module}" if module else "")
        ) from error
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
        f"{node.format_node()} ({_first_line(tracer.values[node].error)})"
        for node in gm.graph.nodes
        if isinstance(tracer.values.get(node), _UnknownValue)
    ]
    if unknown:
        raise CaptureError(f"symbolic tracing could not compute example values for: {'; '.join(unknown[:3])}")
    return gm


def has_side_effects(node: fx.Node) -> bool:
    """Keep this node even when nothing reads its result: impure calls, leaf modules, and calls that write
    an input (BatchNorm's ``num_batches_tracked.add_(1)``, ``relu(x, inplace=True)``, ``out=``).

    Every dead-code elimination in compfx passes this, since FX's own purity test takes a
    ``call_method`` such as ``h.add_(x)`` for pure and would drop the write.
    """
    if node.op == "call_module" or node.is_impure():
        return True
    return node.op in ("call_function", "call_method") and (writes_input(node) or "out" in node.kwargs)


def writes_input(node: fx.Node) -> bool:
    """True when the call writes its first argument: an in-place name (``add_``, ``operator.iadd``) or ``inplace=True``."""
    return is_in_place(node.target) or _passes_inplace_true(node)


def _passes_inplace_true(node: fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function":
        return False
    signature = _signature(node.target)
    if signature is None:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:  # the call does not fit the signature
        return False
    return bound.arguments.get("inplace") is True


def _signature(target) -> inspect.Signature | None:
    """``inspect.signature(target)``, None for builtins without one; cached, as every rewrite asks again."""
    try:
        hash(target)
    except TypeError:  # an unhashable callable: no cache
        return _signature_uncached(target)
    return _cached_signature(target)


def _signature_uncached(target) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature, non-callables
        return None


_cached_signature = functools.lru_cache(maxsize=1024)(_signature_uncached)


_IN_PLACE_OPERATORS = frozenset(
    (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
     operator.imatmul, operator.ipow, operator.iand, operator.ior, operator.ixor)
)


def is_in_place(target) -> bool:
    """True when a call target writes its first argument by name: ``add_``, ``torch.relu_``, ``operator.iadd``.

    ``target`` is a node's target: a method or module name, or a function.
    Dunder names (``__add__``) are not in-place; ``inplace=True`` is not seen here.

    >>> import operator, torch
    >>> is_in_place("add_"), is_in_place(torch.relu_), is_in_place(operator.iadd), is_in_place("__add__")
    (True, True, True, False)
    """
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or target in _IN_PLACE_OPERATORS


# ---------------------------------------------------------------------------
# dynamo capture


@contextlib.contextmanager
def buffers_restored(model: nn.Module):
    """Put every buffer of ``model`` back afterwards (dynamo export, and any measuring forward, run it for real)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _dynamo_capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    # allow_rnn: keep nn.GRU/LSTM in the graph as one op, as the symbolic tracer does.
    # Static shapes: compfx specialises to the example inputs (TC rules need concrete dims).
    with torch._dynamo.config.patch(allow_rnn=True), buffers_restored(model):
        exported = torch._dynamo.export(model, aten_graph=False, assume_static_by_default=True)(*args, **kwargs)
    gm = exported.graph_module
    fqn_of = {id(t): name for name, t in named_tensors(model)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = get_attribute(gm, node.target)
            if id(attr) in fqn_of:
                node.target = fqn_of[id(attr)]
    _restore_callers_grad_mode(gm.graph, torch.is_grad_enabled())
    return fx.GraphModule(model, gm.graph, class_name=type(model).__name__ + "Captured")


def _restore_callers_grad_mode(graph: fx.Graph, mode_at_capture: bool) -> None:
    """Make dynamo's ``_set_grad_enabled(True)`` after a no_grad block restore the caller's mode.

    Dynamo writes the mode it saw at capture time as a literal; a caller that
    runs the graph under ``torch.no_grad()`` would get autograd switched back on.
    """
    switches = [n for n in graph.nodes if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    if not switches:
        return
    with graph.inserting_before(switches[0]):
        saved = graph.call_function(torch.is_grad_enabled)
    saved.meta["val"] = mode_at_capture
    for switch in switches:
        if switch.args[0] == mode_at_capture:
            switch.args = (saved,)


def named_tensors(model: nn.Module):
    """Every parameter and buffer of ``model`` by name, shared ones under each of their names."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def key_dynamo_graph(gm: fx.GraphModule, counts: dict[tuple[str, str], int] | None = None) -> list[OpKey]:
    """Key the graph that dynamo hands a ``torch.compile`` backend, like :func:`capture` would.

    Dynamo graphs keep values in ``meta["example_value"]`` and lift parameters
    to placeholders; this copies the values to ``meta["val"]`` (and adds
    ``tensor_meta``), then writes an OpKey on every numerical op. For a model
    split into several graphs, pass one ``counts`` dict to every call, in
    execution order, so call indices continue across the graphs.

    >>> import torch
    >>> from compfx.capture import key_dynamo_graph
    >>> keys = []
    >>> def backend(gm, example_inputs):
    ...     keys.extend(key_dynamo_graph(gm))
    ...     return gm.forward
    >>> _ = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), backend=backend)(torch.randn(2, 4))
    >>> [str(k) for k in keys]
    ['0:linear#0', '1:relu#0']
    """
    _complete_metadata(gm)
    return list(assign_op_keys(gm, include=is_numerical_op, counts=counts))


# ---------------------------------------------------------------------------
# metadata


def _tensor_meta(value):
    if isinstance(value, torch.Tensor):
        return _extract_tensor_metadata(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in value)
    return None


def _complete_metadata(gm: fx.GraphModule) -> list[fx.Node]:
    """Give every node ``val`` (and tensors ``tensor_meta``); returns nodes still without ``val``."""
    missing = []
    for node in gm.graph.nodes:
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
        if node.op == "output":
            node.meta["val"] = pytree.tree_map(
                lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, node.args[0]
            )
        if "val" not in node.meta and node.op != "output" and not node.users:
            node.meta["val"] = None  # a call kept only for its side effect, e.g. _set_grad_enabled
        if "val" not in node.meta:
            missing.append(node)
            continue
        meta = _tensor_meta(node.meta["val"])
        if meta is not None:
            node.meta["tensor_meta"] = meta
    return missing


# ---------------------------------------------------------------------------
# public entry point


def capture(
    model: nn.Module,
    example_inputs,
    *,
    leaf_modules: Iterable[type | str] = (),
    method: str = "auto",
) -> fx.GraphModule:
    """Trace ``model`` to a functional FX graph; every numerical op gets an OpKey.

    ``method`` is ``"auto"`` (symbolic, then dynamo), ``"symbolic"`` or
    ``"dynamo"``. ``leaf_modules`` names module types or qualified names that
    stay as one ``call_module`` op (symbolic capture only; dynamo inlines
    everything). The graph is specialised to the model's current train/eval
    mode and to the branches the example inputs take.

    >>> import torch, compfx
    >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
    >>> [str(n.meta["compfx_key"]) for n in compfx.op_nodes(gm)]
    ['0:linear#0', '1:relu#0']
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"capture() takes an nn.Module; got {type(model).__name__}.")
    if method not in ("auto", "symbolic", "dynamo"):
        raise BadInputError(f"method={method!r}; expected 'auto', 'symbolic' or 'dynamo'.")
    args, kwargs = normalize_example_inputs(example_inputs)
    with _modes_restored(model), _fake_tensor_failures_quiet():
        gm = _capture_with(model, args, kwargs, leaf_modules, method)
    missing = _complete_metadata(gm)
    if missing:
        raise CaptureError(
            f"{gm.meta['compfx_capture_method']} capture left no example value on "
            f"{', '.join(n.name for n in missing[:5])}; compfx needs shapes and dtypes on every node. "
            "Try the other method= or report this model."
        )
    assign_op_keys(gm, include=is_numerical_op)
    return gm


@contextlib.contextmanager
def _modes_restored(model: nn.Module):
    """Whatever a tracer does, the user's modules keep their train/eval mode."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _capture_with(model, args, kwargs, leaf_modules, method) -> fx.GraphModule:
    failures: list[str] = []
    if method in ("auto", "symbolic"):
        try:
            gm = _symbolic_capture(model, args, kwargs, leaf_modules)
            gm.meta["compfx_capture_method"] = "symbolic"
            return gm
        except BadInputError:
            raise
        except _ValueBranchError as error:
            # Dynamo cannot make one graph of it either; our message names the line.
            raise CaptureError(str(error)) from error.__cause__
        except CaptureError as error:
            _check_runs_eagerly(model, args, kwargs, error)  # wrong example inputs: say so, skip dynamo
            if method == "symbolic":
                raise CaptureError(_capture_advice(model, [str(error)])) from error
            failures.append(str(error))
    if tuple(leaf_modules):
        warnings.warn(
            f"compfx captures {type(model).__name__} with dynamo, which inlines every module: "
            "leaf_modules is ignored and those modules' ops get keys of their own.",
            stacklevel=3,
        )
    try:
        gm = _dynamo_capture(model, args, kwargs)
    except Exception as error:
        failures.append(f"dynamo export failed with {_first_line(error)} at {_error_site(error)}")
        raise CaptureError(_capture_advice(model, failures)) from error
    gm.meta["compfx_capture_method"] = "dynamo"
    return gm


class _DropFailedMetaTracebacks(logging.Filter):
    """Drops FakeTensor's "failed while attempting to run meta for ..." records, each a full traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _fake_tensor_failures_quiet():
    """While capturing, an op whose shapes do not fit makes FakeTensor log its traceback to stderr
    (dozens of ``fake_tensor.py`` lines); compfx reports that failure itself, once, in its error."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    dropper = _DropFailedMetaTracebacks()
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


def _check_runs_eagerly(model: nn.Module, args: tuple, kwargs: dict, capture_error: Exception) -> None:
    """After a capture failure: if ``model`` fails on the example inputs in plain eager mode too, the inputs are
    wrong (shape, dtype, device), not the tracing; raise :class:`BadInputError` saying so. Changes nothing."""
    try:
        cuda = sorted({t.device.index or 0 for t in (*model.parameters(), *pytree.tree_leaves((args, kwargs)))
                       if isinstance(t, torch.Tensor) and t.is_cuda})
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), buffers_restored(model), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure here is the inputs' (or the model's own)
        described = ", ".join(f"{type(v).__name__}{tuple(v.shape)}:{v.dtype}:{v.device}" if isinstance(v, torch.Tensor)
                              else type(v).__name__ for v in pytree.tree_leaves((args, kwargs)))[:300]
        raise BadInputError(
            f"{type(model).__name__} fails on the example inputs even without compfx ({_first_line(error)}); they "
            f"were {described}. Give example inputs that forward() accepts (the shapes, dtypes and device of a real "
            "batch).") from capture_error
    return None


def _capture_advice(model: nn.Module, failures: list[str]) -> str:
    return (
        f"compfx could not capture {type(model).__name__} as one FX graph: {'; '.join(failures)}. "
        "Check that forward() runs on the example inputs, replace branches on tensor values with "
        "torch.where, or keep the offending submodule opaque with capture(..., leaf_modules=[...])."
    )
