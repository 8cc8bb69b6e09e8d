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
from typing import Any, Hashable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import BadInputError, CaptureError
from ..opkey import KEY_META, OpKey, assign_op_keys, normalize_kind

__all__ = [
    "capture",
    "CAPTURE_METHODS",
    "CAPTURE_DEFAULTS",
    "capture_defaults",
    "is_kv_cache",
    "check_input_shapes",
    "input_signature",
    "describe_inputs",
    "module_modes",
    "reads_its_state_in_python",
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

#: What ``capture(method=...)`` takes; ``"auto"`` tries the other three in this order.
CAPTURE_METHODS = ("auto", "symbolic", "record", "dynamo")

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

_SKIPPED_DIRS = (  # torch's folder and compfx's (this file's grandparent)
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
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
        return (qualname in self._leaf_names or (bool(self._leaf_types) and isinstance(m, self._leaf_types))
                or reads_its_state_in_python(m))

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
     operator.imatmul, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.setitem)
)


def is_in_place(target) -> bool:
    """True when a call target writes its first argument by name: ``add_``, ``torch.relu_``, ``operator.iadd``.

    ``target`` is a node's target: a method or module name, or a function.
    Dunder names (``__add__``) are not in-place; ``inplace=True`` is not seen here.

    >>> import operator, torch
    >>> is_in_place("add_"), is_in_place(torch.relu_), is_in_place(operator.iadd), is_in_place("__add__")
    (True, True, True, False)
    >>> is_in_place(operator.setitem)  # x[i] = v
    True
    """
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or target in _IN_PLACE_OPERATORS


# ---------------------------------------------------------------------------
# recording capture


class _DataDependentValue(CaptureError):
    """The model reads a tensor's value into Python (``float(t)``, ``t.item()``): fakes have no values."""


# Tensor dunders -> the operator function torch.fx (and dynamo) write for them, and whether the
# reflected form swaps its operands (``2 - x`` calls ``x.__rsub__(2)``, i.e. ``sub(2, x)``).
_DUNDER_OPERATORS = {
    "__add__": (operator.add, False), "__radd__": (operator.add, True), "__iadd__": (operator.iadd, False),
    "__sub__": (operator.sub, False), "__rsub__": (operator.sub, True), "__isub__": (operator.isub, False),
    "__mul__": (operator.mul, False), "__rmul__": (operator.mul, True), "__imul__": (operator.imul, False),
    "__truediv__": (operator.truediv, False), "__rtruediv__": (operator.truediv, True),
    "__itruediv__": (operator.itruediv, False),
    "__div__": (operator.truediv, False), "__rdiv__": (operator.truediv, True), "__idiv__": (operator.itruediv, False),
    "__floordiv__": (operator.floordiv, False), "__rfloordiv__": (operator.floordiv, True),
    "__ifloordiv__": (operator.ifloordiv, False),
    "__matmul__": (operator.matmul, False), "__rmatmul__": (operator.matmul, True),
    "__pow__": (operator.pow, False), "__rpow__": (operator.pow, True), "__ipow__": (operator.ipow, False),
    "__mod__": (operator.mod, False), "__rmod__": (operator.mod, True),
    "__neg__": (operator.neg, False), "__pos__": (operator.pos, False), "__abs__": (operator.abs, False),
    "__invert__": (operator.invert, False),
    "__and__": (operator.and_, False), "__rand__": (operator.and_, True), "__iand__": (operator.iand, False),
    "__or__": (operator.or_, False), "__ror__": (operator.or_, True), "__ior__": (operator.ior, False),
    "__xor__": (operator.xor, False), "__rxor__": (operator.xor, True), "__ixor__": (operator.ixor, False),
    "__eq__": (operator.eq, False), "__ne__": (operator.ne, False), "__lt__": (operator.lt, False),
    "__le__": (operator.le, False), "__gt__": (operator.gt, False), "__ge__": (operator.ge, False),
    "__getitem__": (operator.getitem, False), "__setitem__": (operator.setitem, False),
}


class _CallRecorder(TorchFunctionMode):
    """Writes every torch call of a forward that runs on FakeTensors into an FX graph.

    The model's own Python runs (``isinstance`` checks, shape arithmetic, Hugging
    Face's mask helpers); shapes are concrete, so the graph is specialised to
    the example inputs, as dynamo's static capture is. A call is recorded when it
    returns a tensor or writes one (``add_``, ``x[i] = v``, ``out=``); its tensor
    arguments become the nodes that made them, parameters and buffers
    ``get_attr`` nodes. Module calls are tracked by global forward hooks
    (``nn_module_stack``, for op keys); ``torch.no_grad()`` blocks become
    ``_set_grad_enabled`` nodes, as in the symbolic tracer.
    """

    def __init__(self, graph: fx.Graph, names_of_state: dict[int, str], module_names: dict[int, str]):
        super().__init__()
        self.graph = graph
        self.node_of: dict[int, fx.Node] = {}  # id(tensor) -> the node that holds it
        self._alive: list = []  # every tensor seen stays alive, so no id() is reused during the trace
        self._state_names = names_of_state  # id(fake parameter or buffer) -> its FQN
        self._module_names = module_names  # id(module) -> its FQN
        self.constants: dict[str, torch.Tensor] = {}  # real tensors met along the way (non-buffer attributes)
        self.module_stack: list[tuple[str, type]] = []
        self._grad_mode_at_start = self._graph_grad_mode = torch.is_grad_enabled()
        self._saved_grad_mode: fx.Node | None = None

    # -- what the graph knows ----------------------------------------------------------
    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self.node_of[id(tensor)] = node
        self._alive.append(tensor)

    def _node_for(self, tensor: torch.Tensor) -> fx.Node:
        node = self.node_of.get(id(tensor))
        if node is not None:
            return node
        name = self._state_names.get(id(tensor))
        if name is not None:  # a parameter or buffer, read for the first time
            node = self.graph.get_attr(name)
        elif isinstance(tensor, FakeTensor):
            raise CaptureError(
                f"a tensor of shape {tuple(tensor.shape)} at {_user_line()}{self._inside()} came from a call that "
                "torch's __torch_function__ does not show, so compfx cannot tell which op made it")
        else:  # a plain tensor attribute or a global: a constant of the graph
            name = f"_compfx_constant_{len(self.constants)}"
            self.constants[name] = tensor
            node = self.graph.get_attr(name)
        node.meta["val"] = tensor
        self.bind(tensor, node)
        return node

    def _argument(self, value):
        if isinstance(value, torch.Tensor):
            return self._node_for(value)
        if isinstance(value, torch.Size):
            return tuple(value)
        if isinstance(value, (tuple, list)):
            items = [self._argument(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return {k: self._argument(v) for k, v in value.items()}
        return value

    # -- the mode ---------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__iter__":  # iterating a tensor unbinds it (one graph node, not a Python loop over fakes)
            items = func(*args, **kwargs)
            items = tuple(items)
            self._record(torch.Tensor.unbind, "unbind", (args[0],), {}, items)
            return iter(items)
        try:
            result = func(*args, **kwargs)
        except DataDependentOutputException as error:
            raise self._value_read_error(name, error) from error
        if _writes(name, kwargs) or _holds_tensor(result):
            self._record(func, name, args, kwargs, result)
        return result

    def _value_read_error(self, name: str, error: Exception) -> CaptureError:
        if name == "__bool__":
            return _ValueBranchError(
                f"The model branches on tensor values at {_user_line()}. One FX graph cannot hold both sides of "
                "that branch. Rewrite it with torch.where, move it out of forward(), or use "
                "torch.compile(model, backend='compfx'), which splits the graph there.")
        return _DataDependentValue(
            f"the model reads a tensor's value into Python ({name}) at {_user_line()}{self._inside()}; the recording "
            f"tracer runs on FakeTensors, which have no values ({_first_line(error)})")

    def _inside(self) -> str:
        if not self.module_stack:
            return ""
        path, cls = self.module_stack[-1]
        return f" inside module {path} ({cls.__name__})"

    def _record(self, func, name: str, args, kwargs, result) -> None:
        self._follow_grad_mode()
        args, kwargs = self._argument(args), self._argument(kwargs)
        if name in _DUNDER_OPERATORS:
            function, reflected = _DUNDER_OPERATORS[name]
            node = self.graph.call_function(function, tuple(reversed(args)) if reflected else args, kwargs)
        elif name == "__get__":  # a property that gives a tensor: x.T, x.mT, x.data
            node = self.graph.call_function(getattr, (args[0], func.__self__.__name__))
        elif args and isinstance(args[0], fx.Node) and getattr(torch.Tensor, name, None) is func:
            node = self.graph.call_method(name, args, kwargs)
        else:
            node = self.graph.call_function(func, args, kwargs)
        self._annotate(node, result)
        if isinstance(result, torch.Tensor):
            self.bind(result, node)
        elif isinstance(result, (tuple, list)):
            for i, item in enumerate(result):
                if isinstance(item, torch.Tensor):
                    item_node = self.graph.call_function(operator.getitem, (node, i))
                    self._annotate(item_node, item)
                    self.bind(item, item_node)
        self._alive.append(result)

    def _annotate(self, node: fx.Node, value) -> None:
        node.meta["val"] = value
        if self.module_stack:
            node.meta["nn_module_stack"] = {path: (path, cls) for path, cls in self.module_stack}

    def _follow_grad_mode(self) -> None:
        """``with torch.no_grad():`` as graph nodes; the first switch saves the caller's mode to restore it."""
        mode = torch.is_grad_enabled()
        if mode == self._graph_grad_mode:
            return
        if self._saved_grad_mode is None:
            self._saved_grad_mode = self.graph.call_function(torch.is_grad_enabled)
            self._saved_grad_mode.meta["val"] = self._grad_mode_at_start
        target = self._saved_grad_mode if mode == self._grad_mode_at_start else mode
        self.graph.call_function(torch._C._set_grad_enabled, (target,)).meta["val"] = None
        self._graph_grad_mode = mode

    def finish_grad_mode(self) -> None:
        if self._saved_grad_mode is not None and self._graph_grad_mode != self._grad_mode_at_start:
            self.graph.call_function(torch._C._set_grad_enabled, (self._saved_grad_mode,)).meta["val"] = None

    # -- module paths (global hooks: the tracer cannot see module calls otherwise) --------
    @contextlib.contextmanager
    def tracking_modules(self, root: nn.Module):
        def enter(module, args):
            path = self._module_names.get(id(module))
            if path:  # the root's ops have an empty stack, as in the other tracers
                self.module_stack.append((path, type(module)))

        def leave(module, args, output):
            path = self._module_names.get(id(module))
            if path and self.module_stack and self.module_stack[-1][0] == path:
                self.module_stack.pop()

        handles = [nn.modules.module.register_module_forward_pre_hook(enter),
                   nn.modules.module.register_module_forward_hook(leave, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _writes(name: str, kwargs: dict) -> bool:
    """Does a call with this name write a tensor argument (``add_``, ``x[i] = v``, ``x += y``, ``out=``, ``inplace=True``)?"""
    return (is_in_place(name) or name == "__setitem__" or (name.startswith("__i") and name in _DUNDER_OPERATORS)
            or "out" in kwargs or kwargs.get("inplace") is True)


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


#: Keyword arguments the dynamo fallback passes to ``forward`` when it takes them and the caller did not say:
#: ``torch._dynamo.export`` cannot return Hugging Face's cache object, and training never reads it. (The
#: recording tracer runs forward as called and returns None in the cache's place: :func:`is_kv_cache`.)
CAPTURE_DEFAULTS = {"use_cache": False}


def capture_defaults(model: nn.Module, kwargs: dict) -> dict:
    """The entries of :data:`CAPTURE_DEFAULTS` that ``model.forward`` accepts and ``kwargs`` does not set.

    >>> import torch
    >>> class LM(torch.nn.Module):
    ...     def forward(self, input_ids, use_cache=None): ...
    >>> capture_defaults(LM(), {}), capture_defaults(LM(), {"use_cache": True}), capture_defaults(torch.nn.Linear(2, 2), {})
    ({'use_cache': False}, {}, {})
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {name: value for name, value in CAPTURE_DEFAULTS.items() if name in parameters and name not in kwargs}


def _argument_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """Names for the generated ``forward``'s parameters: forward's own for positional arguments, then the keywords."""
    try:
        parameters = [p for p in inspect.signature(model.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        parameters = []
    names = [parameters[i].name if i < len(parameters) else f"arg{i}" for i in range(len(args))]
    return names + list(kwargs)


def _record_capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    graph = fx.Graph()
    in_spec = pytree.tree_structure((args, kwargs))
    names = _argument_names(model, args, kwargs)
    fakes_by_id: dict[int, torch.Tensor] = {}
    state, state_names = {}, {}
    for name, tensor in named_tensors(model):
        if id(tensor) not in fakes_by_id:  # tied weights share one fake, under the first name
            fakes_by_id[id(tensor)] = fake_mode.from_tensor(tensor, static_shapes=True)
            state_names[id(fakes_by_id[id(tensor)])] = name
        state[name] = fakes_by_id[id(tensor)]
    recorder = _CallRecorder(graph, state_names, {id(m): n for n, m in model.named_modules(remove_duplicate=False)})
    fake_inputs = []
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        placeholder = graph.placeholder(_placeholder_name(path, names, len(args)))
        if isinstance(leaf, torch.Tensor):
            leaf = fake_mode.from_tensor(leaf, static_shapes=True)
            recorder.bind(leaf, placeholder)
        placeholder.meta["val"] = leaf
        fake_inputs.append(leaf)
    fake_args, fake_kwargs = pytree.tree_unflatten(fake_inputs, in_spec)
    reassigned: list[str] = []

    def check_state(module, args, output):  # after the root's forward, before functional_call puts things back
        reassigned.extend(name for name, t in named_tensors(model) if t is not state[name])

    hook = model.register_forward_hook(check_state)
    try:
        with recorder.tracking_modules(model), fake_mode, recorder, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager run says the same
            output = torch.func.functional_call(model, state, fake_args, fake_kwargs, tie_weights=False, strict=False)
    except CaptureError:
        raise
    except Exception as error:
        raise CaptureError(f"the recording run failed with {_first_line(error)} at {_error_site(error)}") from error
    finally:
        hook.remove()
    if reassigned:
        raise CaptureError(
            f"forward() assigns new tensors to {', '.join(sorted(set(reassigned))[:3])}; compfx graphs replay in-place "
            "updates of parameters and buffers (self.x.add_(...), self.x.copy_(...)) but not reassignment. Update "
            "them in place.")
    recorder.finish_grad_mode()
    output = pytree.tree_map(lambda leaf: None if is_kv_cache(leaf) else leaf, output)
    graph.output(_output_nodes(output, recorder))
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__ + "Captured")
    for name, constant in recorder.constants.items():
        gm.register_buffer(name, constant, persistent=False)
    gm.graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(names, in_spec, pytree.tree_structure(output))))
    gm.graph.eliminate_dead_code(is_impure_node=has_side_effects)
    gm.recompile()
    return gm


def _placeholder_name(path, names: list[str], positional: int) -> str:
    """``input_ids`` for a keyword, ``x`` for a positional argument, ``x_0`` for an item inside one."""
    top, index = path[0].idx, path[1]  # (args, kwargs) -> which of the two, then the position or key
    base = names[index.idx] if top == 0 else str(index.key)
    return "_".join([base, *(str(getattr(p, "idx", getattr(p, "key", p))) for p in path[2:])])


def is_kv_cache(value) -> bool:
    """Is ``value`` a Hugging Face KV cache (``DynamicCache``, ``EncoderDecoderCache``, ...)?

    A recorded graph computes everything the model's forward computes, cache
    updates included, exactly as eager; it returns ``None`` in the cache's place:
    an FX graph returns tensors, and training never reads the cache.

    >>> is_kv_cache(None), is_kv_cache(object())
    (False, False)
    """
    cls = type(value)
    return cls.__module__.startswith("transformers.") and any(c.__name__ == "Cache" for c in cls.__mro__)


def _output_nodes(output, recorder: _CallRecorder) -> list:
    nodes = []
    for path, leaf in pytree.tree_flatten_with_path(output)[0]:
        if isinstance(leaf, torch.Tensor):
            nodes.append(recorder._node_for(leaf))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            nodes.append(leaf)
        else:
            raise CaptureError(
                f"the model returns a {type(leaf).__name__} at output{pytree.keystr(path)}, which an FX graph cannot "
                "return; return tensors (or tuples, lists and dicts of them, or a Hugging Face ModelOutput)")
    return nodes


# ---------------------------------------------------------------------------
# input checks of shape-specialised graphs


@fx.node.has_side_effect  # dead-code elimination keeps it: nothing reads its result
def check_input_shapes(expected: tuple, *tensors) -> None:
    """Raise :class:`~compfx.errors.BadInputError` naming the input and dimension that differ from ``expected``.

    ``expected`` holds ``(name, shape, dtype)`` per tensor input, in order. A
    recorded or dynamo-captured graph calls this first: its ops were written
    for those shapes (views, expands and masks hold the sizes as constants), so
    other shapes would fail deep inside, or worse, run.

    >>> import torch
    >>> check_input_shapes((("x", (2, 3), torch.float32),), torch.zeros(2, 3))
    >>> check_input_shapes((("x", (2, 3), torch.float32),), torch.zeros(5, 3))
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: x has size 5 in dimension 0 (the batch), but this graph was captured with ...
    """
    for (name, shape, dtype), tensor in zip(expected, tensors):
        if tuple(tensor.shape) == shape and tensor.dtype == dtype:
            continue
        if len(tensor.shape) != len(shape):
            what = f"{name} has {len(tensor.shape)} dimensions ({tuple(tensor.shape)}), but this graph was captured with {len(shape)} ({shape})"
        elif tuple(tensor.shape) != shape:
            dim = next(i for i, (a, b) in enumerate(zip(tensor.shape, shape)) if a != b)
            role = " (the batch)" if dim == 0 else " (the sequence, for token inputs)" if dim == 1 and not tensor.is_floating_point() else ""
            what = (f"{name} has size {tensor.shape[dim]} in dimension {dim}{role}, but this graph was captured with "
                    f"{shape[dim]} (shape {shape})")
        else:
            what = f"{name} is {tensor.dtype}, but this graph was captured with {dtype}"
        raise BadInputError(
            f"{what}. Recorded and dynamo-captured graphs are specialised to the shapes and dtypes they were captured "
            "with. Run the model through compfx.optimize(...).module or compfx.apply.PlannedModule(model, plan, "
            "analysis=...), which re-capture per input shape with the same plan, or capture with inputs of this shape.")


def _with_input_check(gm: fx.GraphModule) -> fx.GraphModule:
    """Put a :func:`check_input_shapes` call after the placeholders of a shape-specialised graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tensors = [n for n in placeholders if isinstance(n.meta.get("val", n.meta.get("example_value")), torch.Tensor)]
    if not tensors:
        return gm
    names = dict(zip(placeholders, _input_names(gm, len(placeholders))))
    expected = tuple((names[n], tuple(_concrete_shape(meta_value(n))), meta_value(n).dtype) for n in tensors)
    with gm.graph.inserting_after(placeholders[-1]):
        check = gm.graph.call_function(check_input_shapes, (expected, *tensors))
    check.meta["val"] = None
    gm.recompile()
    return gm


def _input_names(gm: fx.GraphModule, count: int) -> list[str]:
    """What the caller calls each placeholder: ``input_ids``, ``x``, ``batch[1]`` (dynamo's own names are not that)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None or info.in_spec.num_leaves != count:
        return [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    names = []
    positional = _child(info.in_spec, 0).num_children if _is_args_kwargs(info.in_spec) else len(info.orig_args)
    for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(count)), info.in_spec))[0]:
        if _is_args_kwargs(info.in_spec):
            first, rest = path[1], path[2:]
            base = info.orig_args[first.idx] if path[0].idx == 0 and first.idx < positional else str(
                getattr(first, "key", getattr(first, "idx", "")))
        else:
            first, rest = path[0], path[1:]
            base = info.orig_args[first.idx] if first.idx < len(info.orig_args) else f"arg{first.idx}"
        names.append(base + pytree.keystr(rest))
    return names


def _is_args_kwargs(spec) -> bool:
    return (spec.type is tuple and spec.num_children == 2 and _child(spec, 0).type is tuple
            and _child(spec, 1).type is dict)


def _child(spec, index: int):
    """``spec.child(index)``; ``children_specs`` before torch had it (deprecated since)."""
    return spec.child(index) if hasattr(spec, "child") else spec.children_specs[index]


def _concrete_shape(value: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in value.shape)


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
    defaults = capture_defaults(model, kwargs)
    with torch._dynamo.config.patch(allow_rnn=True), buffers_restored(model):
        exported = torch._dynamo.export(model, aten_graph=False, assume_static_by_default=True)(
            *args, **kwargs, **defaults)
    gm = exported.graph_module
    if defaults:
        _drop_keywords(gm, args, kwargs, defaults)
    fqn_of = {id(t): name for name, t in named_tensors(model)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = get_attribute(gm, node.target)
            if id(attr) in fqn_of:
                node.target = fqn_of[id(attr)]
    _restore_callers_grad_mode(gm.graph, torch.is_grad_enabled())
    return fx.GraphModule(model, gm.graph, class_name=type(model).__name__ + "Captured")


def _drop_keywords(gm: fx.GraphModule, args: tuple, kwargs: dict, defaults: dict) -> None:
    """Make an exported graph take the caller's ``(args, kwargs)``, without the capture ``defaults`` it ran with.

    The defaults were passed last, each a single leaf, so they are the last
    placeholders; the graph is specialised to their values and never reads them.
    """
    info = gm.graph._codegen.pytree_info
    dropped = [n for n in gm.graph.nodes if n.op == "placeholder"][-len(defaults):]
    for node in dropped:
        if node.users:
            raise CaptureError(f"dynamo's graph reads {node.name!r}, which compfx passed as a constant "
                               f"({', '.join(f'{k}={v!r}' for k, v in defaults.items())}) and expected to be specialised away")
        gm.graph.erase_node(node)
    in_spec = pytree.tree_structure((args, kwargs))
    gm.graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(info.orig_args[: -len(defaults)], in_spec, info.out_spec)))
    gm.recompile()


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
    modes: Mapping[str, bool] | None = None,
) -> fx.GraphModule:
    """Trace ``model`` to a functional FX graph; every numerical op gets an OpKey.

    ``method`` is ``"auto"`` (symbolic, then record, then dynamo),
    ``"symbolic"``, ``"record"`` or ``"dynamo"``. *Symbolic* tracing follows
    the code with proxies; its graphs compute shapes at run time. *Record* runs
    forward on FakeTensors and writes down every torch call (Hugging Face models
    land here: their Python runs as is, in a fraction of dynamo's time);
    *dynamo* is ``torch._dynamo.export``. Recorded and dynamo graphs are
    specialised to the example inputs' shapes and check them when called
    (:func:`check_input_shapes`); :class:`compfx.apply.PlannedModule` re-captures
    per input signature. ``leaf_modules`` names module types or qualified names
    that stay as one ``call_module`` op (symbolic capture only). The graph is
    specialised to the model's current train/eval mode and to the branches the
    example inputs take. A Hugging Face KV cache in the output comes back as
    ``None`` (:func:`is_kv_cache`); the dynamo fallback passes ``use_cache=False``
    where ``forward`` takes it and the inputs do not set it (:data:`CAPTURE_DEFAULTS`).
    ``modes`` (module path -> training) captures with those train/eval modes
    instead of the current ones (:func:`module_modes`); the model's own modes
    are put back afterwards, whatever happens.

    >>> import torch, compfx
    >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
    >>> [str(n.meta["compfx_key"]) for n in compfx.op_nodes(gm)]
    ['0:linear#0', '1:relu#0']
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"capture() takes an nn.Module; got {type(model).__name__}.")
    if method not in CAPTURE_METHODS:
        raise BadInputError(f"method={method!r}; expected one of {', '.join(map(repr, CAPTURE_METHODS))}.")
    args, kwargs = normalize_example_inputs(example_inputs)
    with _modes_restored(model), _fake_tensor_failures_quiet():
        if modes is not None:
            for name, module in model.named_modules():
                module.training = modes.get(name, module.training)
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


def module_modes(model: nn.Module, training: bool | None = None) -> dict[str, bool]:
    """Each module's train/eval mode by path; all ``training`` when it is given (what ``model.train(training)`` sets).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    >>> model[1].eval()  # doctest: +ELLIPSIS
    Dropout(...)
    >>> module_modes(model), module_modes(model, False)
    ({'': True, '0': True, '1': False}, {'': False, '0': False, '1': False})
    """
    return {name: module.training if training is None else training for name, module in model.named_modules()}


def input_signature(args: tuple, kwargs: Mapping, training: bool) -> Hashable:
    """What a shape-specialised graph is specialised to: the mode, the arguments' structure, and per tensor its
    shape, dtype and device (per other leaf, its value). Equal signatures can share one graph.

    >>> import torch
    >>> a = input_signature((torch.zeros(4, 8),), {}, True)
    >>> a == input_signature((torch.ones(4, 8),), {}, True), a == input_signature((torch.zeros(3, 8),), {}, True)
    (True, False)
    """
    if all(isinstance(a, torch.Tensor) for a in args) and all(isinstance(v, torch.Tensor) for v in kwargs.values()):
        # the common case (a tuple or a dict of tensors), without pytree: a training step pays this every call
        return (training, tuple(_leaf_signature(a) for a in args),
                tuple(sorted((name, _leaf_signature(v)) for name, v in kwargs.items())))
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    return (training, spec, tuple(_leaf_signature(leaf) for leaf in leaves))


def _leaf_signature(leaf) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device)
    try:
        hash(leaf)
    except TypeError:  # an unhashable object: only this very object is known to fit
        return ("object", id(leaf))
    return (type(leaf), leaf)


def describe_inputs(args: tuple, kwargs: Mapping) -> str:
    """The inputs' tensor shapes in a few words, for logs and reports.

    >>> import torch
    >>> describe_inputs((torch.zeros(4, 8),), {"mask": torch.zeros(4, 8), "scale": 2.0})
    '4x8, mask 4x8, scale=2.0'
    """
    def one(value) -> str:
        if isinstance(value, torch.Tensor):
            return "x".join(map(str, value.shape)) or "scalar"
        if isinstance(value, (tuple, list, dict)):
            return "(" + ", ".join(one(v) for v in (value.values() if isinstance(value, dict) else value)) + ")"
        return repr(value)

    return ", ".join([one(a) for a in args] + [f"{k} {one(v)}" if isinstance(v, (torch.Tensor, tuple, list, dict))
                                               else f"{k}={v!r}" for k, v in kwargs.items()])


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
            # No tracer can make one graph of it; our message names the line.
            raise CaptureError(str(error)) from error.__cause__
        except CaptureError as error:
            if method == "symbolic":
                _check_runs_eagerly(model, args, kwargs, error)  # wrong example inputs: say so
                raise CaptureError(_capture_advice(model, [str(error)])) from error
            failures.append(str(error))
    if tuple(leaf_modules):
        warnings.warn(
            f"compfx captures {type(model).__name__} by running it (recording, or dynamo), which inlines every "
            "module: leaf_modules is ignored and those modules' ops get keys of their own.",
            stacklevel=3,
        )
    if method in ("auto", "record"):
        try:
            gm = _record_capture(model, args, kwargs)
            gm.meta["compfx_capture_method"] = "record"
            return _with_input_check(gm)
        except _ValueBranchError as error:
            raise CaptureError(str(error)) from error.__cause__
        except CaptureError as error:
            _check_runs_eagerly(model, args, kwargs, error)  # wrong example inputs: say so, skip dynamo
            if method == "record":
                raise CaptureError(_capture_advice(model, [str(error)])) from error
            failures.append(str(error))
    try:
        gm = _dynamo_capture(model, args, kwargs)
    except Exception as error:
        failures.append(f"dynamo export failed with {_first_line(error)} at {_error_site(error)}")
        raise CaptureError(_capture_advice(model, failures)) from error
    gm.meta["compfx_capture_method"] = "dynamo"
    return _with_input_check(gm)


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
