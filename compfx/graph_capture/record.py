"""The recording tracer: run ``forward`` on FakeTensors and write every torch call into a graph.

:func:`compfx.graph_capture.capture` tries it when symbolic tracing fails. The
model's own Python runs as in eager (``isinstance`` checks, shape arithmetic,
decorators, Hugging Face's mask helpers), in a fraction of dynamo's time;
shapes are concrete, so the graph is specialised to the example inputs. A
:class:`torch.overrides.TorchFunctionMode` sees each call; global forward hooks
give module paths; parameters and buffers become ``get_attr`` nodes. It gives
way to dynamo when a tensor did not come through ``__torch_function__``, a
value is read into Python (``t.item()``), or a buffer is reassigned.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import threading
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode)
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import CaptureError, ExplainedCaptureError
from ._sites import ValueBranchError, ValueReadError, error_site, first_line, user_line, with_progress
from .autocast_blocks import AutocastBlocks
from .checkpoints import CheckpointRegions, is_reentrant_checkpoint
from .draws import branch_on_draw
from .dtype_reads import DtypeReads
from .functions import NOT_TRACED, FunctionCall, functions_as_calls, unrepresentable_argument
from .model_state import named_tensors, reassignment_error
from .nodes import has_side_effects, is_in_place
from .shape_values import ShapeValues

__all__ = ["record_capture", "is_kv_cache", "with_kv_caches_copied"]


def record_capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """Run ``model(*args, **kwargs)`` on FakeTensors and return the graph of every torch call it made.

    Raises :class:`~compfx.errors.CaptureError` when the run cannot be written
    down (the caller then tries dynamo), and its subclass ``ValueBranchError``
    when forward branches on a tensor's value (no tracer can).
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    graph = fx.Graph()
    in_spec = pytree.tree_structure((args, kwargs))
    names = _argument_names(model, args, kwargs)
    state, state_names = _fake_state(model, fake_mode)
    recorder = _CallRecorder(graph, state_names, {id(m): n for n, m in model.named_modules(remove_duplicate=False)})
    fake_args, fake_kwargs = _placeholders(graph, recorder, fake_mode, (args, kwargs), names)
    output = _run_forward(model, recorder, fake_mode, state, fake_args, fake_kwargs)
    recorder.finish_grad_mode()
    recorder.dtype_reads.finish()
    output = pytree.tree_map(lambda leaf: None if is_kv_cache(leaf) else leaf, output)
    graph.output(_output_nodes(output, recorder))
    return _graph_module(model, graph, recorder.constants, _PyTreeInfo(names, in_spec, pytree.tree_structure(output)))


def _fake_state(model: nn.Module, fake_mode: FakeTensorMode) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """(a fake per parameter and buffer name, the FQN of each fake by id); tied weights share one fake."""
    fakes_by_id: dict[int, torch.Tensor] = {}
    state, state_names = {}, {}
    for name, tensor in named_tensors(model):
        if id(tensor) not in fakes_by_id:  # tied weights share one fake, under the first name
            fakes_by_id[id(tensor)] = fake_mode.from_tensor(tensor, static_shapes=True)
            state_names[id(fakes_by_id[id(tensor)])] = name
        state[name] = fakes_by_id[id(tensor)]
    return state, state_names


def _placeholders(graph: fx.Graph, recorder: _CallRecorder, fake_mode: FakeTensorMode, inputs: tuple,
                  names: list[str]) -> tuple:
    """One placeholder per leaf of ``inputs`` (``(args, kwargs)``); returns the inputs with fakes for tensors."""
    fake_inputs = []
    for path, leaf in pytree.tree_flatten_with_path(inputs)[0]:
        placeholder = graph.placeholder(_placeholder_name(path, names))
        if isinstance(leaf, torch.Tensor):
            leaf = fake_mode.from_tensor(leaf, static_shapes=True)
            recorder.bind(leaf, placeholder)
        placeholder.meta["val"] = leaf
        fake_inputs.append(leaf)
    return pytree.tree_unflatten(fake_inputs, pytree.tree_structure(inputs))


def _run_forward(model: nn.Module, recorder: _CallRecorder, fake_mode: FakeTensorMode, state: dict,
                 args: tuple, kwargs: dict):
    """``model``'s forward on the fakes, under the recorder; a forward that reassigns its tensors is refused."""
    reassigned: list[str] = []

    def check_state(module, inputs, output):  # after the root's forward, before functional_call puts things back
        reassigned.extend(name for name, t in named_tensors(model) if t is not state[name])

    hook = model.register_forward_hook(check_state)
    try:
        with (recorder.tracking_modules(model), fake_mode, recorder, functions_as_calls(recorder.record_function),
              AutocastBlocks(recorder.add_call), warnings.catch_warnings()):
            warnings.simplefilter("ignore")  # the eager run says the same
            output = torch.func.functional_call(model, state, args, kwargs, tie_weights=False, strict=False)
    except CaptureError as error:
        raise with_progress(error, len(recorder.graph.nodes))
    except Exception as error:
        raise with_progress(CaptureError(f"the recording run failed with {first_line(error)} at {error_site(error)}"),
                            len(recorder.graph.nodes)) from error
    finally:
        hook.remove()
    if reassigned:
        raise reassignment_error(reassigned)
    return output


def _graph_module(model: nn.Module, graph: fx.Graph, constants: dict[str, torch.Tensor],
                  pytree_info: _PyTreeInfo) -> fx.GraphModule:
    """The recorded graph as a module of ``model``'s, taking and returning what ``forward`` does."""
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__ + "Captured")
    for name, constant in constants.items():
        gm.register_buffer(name, constant, persistent=False)
    gm.graph.set_codegen(_PyTreeCodeGen(pytree_info))
    gm.graph.eliminate_dead_code(is_impure_node=has_side_effects)
    gm.recompile()
    return gm


def _argument_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """Names for the generated ``forward``'s parameters: forward's own for positional arguments, then the keywords."""
    try:
        parameters = [p for p in inspect.signature(model.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        parameters = []
    names = [parameters[i].name if i < len(parameters) else f"arg{i}" for i in range(len(args))]
    return names + list(kwargs)


def _placeholder_name(path, names: list[str]) -> str:
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
            nodes.append(recorder.node_for(leaf))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            nodes.append(leaf)
        else:
            raise CaptureError(
                f"the model returns a {type(leaf).__name__} at output{pytree.keystr(path)}, which an FX graph cannot "
                "return; return tensors (or tuples, lists and dicts of them, or a Hugging Face ModelOutput)")
    return nodes


class _DataDependentValue(ValueReadError):
    """The model reads a tensor's value into Python (``float(t)``, ``t.item()``): fakes have no values."""


class _ValueDependentShape(CaptureError):
    """An op whose output shape depends on its inputs' values (``pack_padded_sequence``, ``nonzero``): one graph
    holds fixed shapes. What to do differs from a branch: plan around it."""

    advice = ("Plan the model block by block instead (compfx.optimize(..., per_module=(...))), with blocks that "
              "neither run that call nor take its output: forward's own code and the other modules run eagerly in "
              "FP32. Or move the call out of forward().")


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
        self.regions = CheckpointRegions()  # which ops run inside torch.utils.checkpoint
        self._inside_function = False  # running a custom Function's forward, which is one call of the graph
        self.dtype_reads = DtypeReads()  # x.dtype: followed by the call on its line that takes it, or kept
        self.shape_values = ShapeValues()  # real tensors whose values the example's shapes decide (arange, ...)

    # -- what the graph knows ----------------------------------------------------------
    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self.node_of[id(tensor)] = node
        self._alive.append(tensor)

    def node_for(self, tensor: torch.Tensor) -> fx.Node:
        """The node that holds ``tensor``; a parameter, buffer or constant met for the first time gets a ``get_attr``."""
        node = self.node_of.get(id(tensor))
        if node is not None:
            return node
        name = self._state_names.get(id(tensor))
        if name is not None:  # a parameter or buffer, read for the first time
            node = self.graph.get_attr(name)
        elif isinstance(tensor, FakeTensor):
            raise CaptureError(
                f"a tensor of shape {tuple(tensor.shape)} at {user_line()}{self._inside()} came from a call that "
                "torch's __torch_function__ does not show, so compfx cannot tell which op made it (torch.from_numpy "
                "is one); make such a tensor once, as a buffer registered in __init__, or pass it in as an input")
        else:  # a plain tensor attribute or a global: a constant of the graph
            name = f"_compfx_constant_{len(self.constants)}"
            self.constants[name] = tensor
            node = self.graph.get_attr(name)
        node.meta["val"] = tensor
        self.bind(tensor, node)
        return node

    def _argument(self, value):
        if isinstance(value, torch.Tensor):
            return self.node_for(value)
        if type(value).__module__ == "numpy":  # the graph's code cannot name numpy: a scalar is a Python number
            if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
                return value.item()
            raise ExplainedCaptureError(
                f"the model passes a numpy {type(value).__name__} to torch at {user_line()}{self._inside()}, which a "
                "graph cannot hold; make it a tensor once (a buffer registered in __init__) or pass it in as an input")
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
        if self._inside_function:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        by_shapes = self.shape_values.decides(func, args, kwargs)  # computed for real: eager's Python may read them
        if name == "__iter__":  # iterating a tensor unbinds it (one graph node, not a Python loop over fakes)
            with self.shape_values.computing(by_shapes):
                items = tuple(func(*args, **kwargs))
            if by_shapes:
                self.shape_values.add(items)
            self._record(torch.Tensor.unbind, "unbind", (args[0],), {}, items)
            return iter(items)
        if name == "__bool__" and isinstance(args[0], torch.Tensor):  # a draw its bound decides (layer drop at 0)
            decided = branch_on_draw(self.node_of.get(id(args[0])))
            if decided is not None:
                return decided
        follows = self.dtype_reads.taken_by(name, args, kwargs)
        try:
            with self.shape_values.computing(by_shapes):
                result = func(*args, **kwargs)
        except DataDependentOutputException as error:
            raise self._value_read_error(name, error) from error
        except DynamicOutputShapeException as error:
            raise _ValueDependentShape(
                f"the model calls {name} at {user_line()}{self._inside()}, whose output shape depends on its inputs' "
                f"values ({error.args[0] if error.args else error}); one FX graph holds fixed shapes") from error
        if name == "__get__" and isinstance(result, torch.dtype) and args and id(args[0]) in self.node_of:
            self.dtype_reads.read(self.node_of[id(args[0])], result)
        writes = _writes(name, kwargs)
        if not writes:
            with self.shape_values.computing(by_shapes):
                result = _distinct_from_inputs(result, args, kwargs)
        if by_shapes:
            self.shape_values.add(result)
        elif writes:  # a fake call wrote into it: its values are no longer the shapes' alone
            self.shape_values.written([*args[:1], *pytree.tree_leaves(kwargs.get("out"))])
        if writes or _holds_tensor(result):
            self._record(func, name, args, kwargs, result, follows)
        return result

    def record_function(self, call: FunctionCall, args, kwargs):
        """``SomeFunction.apply`` on the forward's fakes: one node that calls it (its own backward kept); a
        reentrant ``checkpoint`` runs its function in a checkpointed region instead."""
        if self._inside_function or not any(isinstance(t, FakeTensor) for t in pytree.tree_leaves((args, kwargs))):
            return NOT_TRACED
        if is_reentrant_checkpoint(call):
            return self.regions.run_reentrant(args)
        unrepresentable = unrepresentable_argument(args, kwargs)
        if unrepresentable is not None:
            raise CaptureError(f"the custom autograd Function {call.function.__qualname__} at {user_line()} takes a "
                               f"{unrepresentable} argument, which a graph cannot hold")
        self._inside_function = True
        try:
            result = call(*args, **kwargs)
        except DataDependentOutputException as error:
            raise self._value_read_error(call.__name__, error) from error
        finally:
            self._inside_function = False
        self._record(call, call.__name__, args, kwargs, result)
        return result

    def _value_read_error(self, name: str, error: Exception) -> CaptureError:
        if name == "__bool__":
            return ValueBranchError(
                f"The model branches on tensor values at {user_line()}. One FX graph cannot hold both sides of "
                "that branch. Rewrite it with torch.where, move it out of forward(), or use "
                "torch.compile(model, backend='compfx'), which splits the graph there.")
        return _DataDependentValue(
            f"the model reads a tensor's value into Python ({name}) at {user_line()}{self._inside()}; the recording "
            f"tracer runs on FakeTensors, which have no values ({first_line(error)})")

    def _inside(self) -> str:
        if not self.module_stack:
            return ""
        path, cls = self.module_stack[-1]
        return f" inside module {path} ({cls.__name__})"

    def _record(self, func, name: str, args, kwargs, result, follows: tuple[fx.Node, torch.dtype] | None = None) -> None:
        self._follow_grad_mode()
        args, kwargs = self._argument(args), self._argument(kwargs)
        if follows is not None:  # the dtype argument the model read from an activation: read it in the graph too
            args, kwargs = self._reading_dtype(args, kwargs, *follows)
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

    def _reading_dtype(self, args, kwargs, node: fx.Node, dtype: torch.dtype):
        """``args, kwargs`` with ``dtype`` replaced by ``getattr(node, "dtype")``, as the symbolic tracer writes it."""
        read = self.graph.call_function(getattr, (node, "dtype"))
        self._annotate(read, dtype)
        return pytree.tree_map(lambda leaf: read if leaf is dtype else leaf, (args, kwargs))

    def _annotate(self, node: fx.Node, value) -> None:
        node.meta["val"] = value
        self.regions.mark(node)
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
        switch = self.graph.call_function(torch._C._set_grad_enabled, (target,))
        switch.meta["val"] = None
        self.regions.mark(switch)
        self._graph_grad_mode = mode

    def add_call(self, target, args: tuple) -> fx.Node:
        """A call kept for its effect, not a tensor (the enter and exit of the model's autocast blocks)."""
        self._follow_grad_mode()
        node = self.graph.call_function(target, args)
        node.meta["val"] = None
        self.regions.mark(node)  # a block inside a checkpointed region is entered again when it recomputes
        return node

    def finish_grad_mode(self) -> None:
        if self._saved_grad_mode is not None and self._graph_grad_mode != self._grad_mode_at_start:
            self.graph.call_function(torch._C._set_grad_enabled, (self._saved_grad_mode,)).meta["val"] = None

    # -- module paths (global hooks: the tracer cannot see module calls otherwise) --------
    @contextlib.contextmanager
    def tracking_modules(self, root: nn.Module):
        thread = threading.get_ident()  # the hooks are global: another thread's module calls are not this run's

        def enter(module, args):
            path = self._module_names.get(id(module))
            if path and threading.get_ident() == thread:  # the root's ops have an empty stack, as in the other tracers
                self.module_stack.append((path, type(module)))

        def leave(module, args, output):
            path = self._module_names.get(id(module))
            if path and self.module_stack and self.module_stack[-1][0] == path and threading.get_ident() == thread:
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


def _distinct_from_inputs(result, args, kwargs):
    """``result``, or an alias of it when a call that writes nothing handed back one of its inputs.

    ``x.float()``, ``x.to(x.dtype)`` and ``x.contiguous()`` return ``x`` itself when there is nothing to
    convert, as they do on the FP32 fakes of a capture; under a plan that makes ``x`` low they return a copy.
    The graph must keep the two apart: uses of ``x`` after the call read ``x``, uses of the result read the
    call (Gemma's norms compute on ``x.float()`` and return ``output.type_as(x)``). Nodes are found by object,
    so the result becomes an alias of its own.
    """
    inputs = {id(leaf) for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
    if isinstance(result, torch.Tensor) and id(result) in inputs:
        return torch.ops.aten.alias(result)
    return result


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def with_kv_caches_copied(inputs):
    """``inputs`` with every Hugging Face KV cache in them replaced by a deep copy (tensors otherwise shared).

    A decoder block receives the model's cache and writes its keys and
    values into it. A tracer that runs the block writes its own values there
    (a recording tracer's are fake tensors), and a check that runs the block
    twice would see the first run's keys in the second: each run gets a copy
    of the cache as the caller passed it, and the caller's cache is not
    touched. (A planned block's graph does not write a cache passed in:
    training never reads it.)

    >>> with_kv_caches_copied(((1, None), {"x": 2}))
    ((1, None), {'x': 2})
    """
    return pytree.tree_map(lambda leaf: copy.deepcopy(leaf) if is_kv_cache(leaf) else leaf, inputs,
                           is_leaf=is_kv_cache)
