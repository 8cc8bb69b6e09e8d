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

Either way every node gets ``meta["val"]`` (a FakeTensor or Python value) and
every numerical op gets ``meta[KEY_META]`` (an :class:`~compfx.opkey.OpKey`).
"""

from __future__ import annotations

import inspect
import traceback
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from .errors import BadInputError, CaptureError
from .opkey import KEY_META, OpKey, assign_op_keys

__all__ = ["capture", "normalize_example_inputs", "ExampleInputs", "is_data_movement", "produces_float", "op_nodes"]

#: Positional args and keyword args for one forward call.
ExampleInputs = tuple[tuple, dict]

# Ops that only move or reinterpret data. They get no precision bit of their
# own: their output dtype follows their input (CoMP's "pure data movement").
DATA_MOVEMENT_KINDS = frozenset(
    """view reshape permute transpose t contiguous flatten unflatten squeeze unsqueeze expand
    expand_as repeat getitem cat concat concatenate stack split chunk unbind narrow select slice
    index_select gather clone detach to type_as size dim getattr numel flip roll movedim
    swapaxes split_with_sizes tensor_split masked_fill zeros_like ones_like empty_like
    full_like new_zeros new_ones new_empty new_full pad constant_pad_nd zeros ones arange
    full empty contiguous_format type float half bfloat16 double cpu cuda tril triu""".split()
)


def is_data_movement(kind: str) -> bool:
    return kind in DATA_MOVEMENT_KINDS


def produces_float(node: fx.Node) -> bool:
    """True when the node's recorded value holds a floating-point tensor."""
    value = node.meta.get("val")
    return any(
        isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in pytree.tree_leaves(value)
    )


def _is_numerical_op(node: fx.Node) -> bool:
    from .opkey import normalize_kind

    if node.op == "call_module":
        return produces_float(node)
    return not is_data_movement(normalize_kind(node.op, node.target)) and produces_float(node)


def op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that carry an OpKey, in graph order."""
    return [n for n in gm.graph.nodes if KEY_META in n.meta]


def normalize_example_inputs(example_inputs) -> ExampleInputs:
    """Accept a tensor, a tuple/list of positional args, or a dict of kwargs."""
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
        self._leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self._leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.fake_mode = fake_mode
        self._inputs = inputs
        self._fakes: dict[int, torch.Tensor] = {}
        self.values: dict[fx.Node, Any] = {}
        self._computing = False  # True while running an op on example values

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

    # -- values ---------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def _fake(self, value):
        if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
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
                f"({type(value.error).__name__}: {value.error}), and the model's Python code needs it "
                f"at {_user_line()}. Mark the module that issues it as a leaf (leaf_modules=...)."
            ) from value.error
        return value

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
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
                return self._fake(_get_attr(self.root, target))
            args, kwargs = pytree.tree_map(concrete, (args, kwargs))
            if any(isinstance(v, _UnknownValue) for v in pytree.tree_leaves((args, kwargs))):
                return next(v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, _UnknownValue))
            with self.fake_mode:
                if kind == "call_function":
                    return target(*args, **kwargs)
                if kind == "call_method":
                    return getattr(args[0], target)(*args[1:], **kwargs)
                if kind == "call_module":
                    return self.root.get_submodule(target)(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - only needed if control flow asks
            return _UnknownValue(error)
        finally:
            self._computing = False
        return None

    # -- control flow ---------------------------------------------------------
    def to_bool(self, obj: fx.Proxy) -> bool:
        value = self.value_of(obj)
        try:
            return bool(value)
        except Exception as error:
            raise CaptureError(
                f"The model branches on tensor values at {_user_line()}. One FX graph cannot hold "
                "both sides of that branch. Rewrite it with torch.where, move it out of forward(), mark "
                "that module as a leaf with capture(..., leaf_modules=[...]), or use "
                "torch.compile(model, backend='compfx'), which splits the graph there."
            ) from error

    def iter(self, obj: fx.Proxy):
        return iter([obj[i] for i in range(len(self.value_of(obj)))])


def _get_attr(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _user_line() -> str:
    """File:line and source text of the innermost frame outside torch and compfx."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or "/compfx/" in path:
            continue
        return f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return "an unknown line"


def _symbolic_capture(model: nn.Module, args: tuple, kwargs: dict, leaf_modules) -> fx.GraphModule:
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise BadInputError(f"example inputs do not fit {type(model).__name__}.forward{signature}: {error}") from error
    provided = dict(bound.arguments)
    concrete_args = {
        name: p.default
        for name, p in signature.parameters.items()
        if name not in provided and p.default is not inspect.Parameter.empty
    }
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracer = _SpecializingTracer(leaf_modules, fake_mode, provided)
    graph = tracer.trace(model, concrete_args=concrete_args or None)
    for node in graph.nodes:
        value = tracer.values.get(node)
        if not isinstance(value, _UnknownValue):
            node.meta["val"] = value
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__ + "Captured")
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


# ---------------------------------------------------------------------------
# dynamo capture


def _dynamo_capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    with torch._dynamo.config.patch(allow_rnn=True):
        exported = torch._dynamo.export(model, aten_graph=False)(*args, **kwargs)
    gm = exported.graph_module
    fqn_of = {id(t): name for name, t in _named_tensors(model)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = _get_attr(gm, node.target)
            if id(attr) in fqn_of:
                node.target = fqn_of[id(attr)]
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
    graph = gm.graph
    rebuilt = fx.GraphModule(model, graph, class_name=type(model).__name__ + "Captured")
    return rebuilt


def _named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


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
    stay as one ``call_module`` op. The graph is specialised to the model's
    current train/eval mode and to the branches the example inputs take.

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
    gm = _capture_with(model, args, kwargs, leaf_modules, method)
    assign_op_keys(gm, include=_is_numerical_op)
    gm.meta["compfx_capture_method"] = gm.meta.get("compfx_capture_method", method)
    return gm


def _capture_with(model, args, kwargs, leaf_modules, method) -> fx.GraphModule:
    errors: list[str] = []
    if method in ("auto", "symbolic"):
        try:
            gm = _symbolic_capture(model, args, kwargs, leaf_modules)
            gm.meta["compfx_capture_method"] = "symbolic"
            return gm
        except BadInputError:
            raise
        except CaptureError as error:
            if method == "symbolic" or "branches on tensor values" in str(error):
                raise
            errors.append(f"symbolic: {error}")
        except Exception as error:  # torch.fx TraceError and friends
            if method == "symbolic":
                raise CaptureError(_capture_advice(model, "symbolic", error)) from error
            errors.append(f"symbolic: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    try:
        gm = _dynamo_capture(model, args, kwargs)
        gm.meta["compfx_capture_method"] = "dynamo"
        return gm
    except Exception as error:
        raise CaptureError(_capture_advice(model, "dynamo", error, errors)) from error


def _capture_advice(model: nn.Module, method: str, error: BaseException, earlier: list[str] = ()) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    tried = "; ".join([*earlier, f"{method}: {type(error).__name__}: {first}"])
    return (
        f"compfx could not capture {type(model).__name__} as one FX graph ({tried}). "
        "Check that forward() runs on the example inputs, replace branches on tensor values with "
        "torch.where, or keep the offending submodule opaque with capture(..., leaf_modules=[...])."
    )
