"""Analysis pass: re-derive each node's value (``meta["val"]``) on FakeTensors after its inputs changed dtype.

A cast changes the dtype of everything downstream of it. This is the one place
that works out those dtypes: :func:`propagate_dtypes` refreshes a whole graph,
and :class:`DtypePropagator` does it node by node for a pass that rewrites as
it goes (:mod:`compfx.passes.insert_casts` needs each input's current dtype to
decide its next cast). Either way the values land in ``meta["val"]`` (and
``meta["example_value"]`` on dynamo graphs) and ``meta["tensor_meta"]``, which
is what later passes, the cast report and the cost model read.

Nodes whose inputs kept their dtypes keep their recorded values; a node is run
again on FakeTensors only when an input was retyped. Fake results are pure
functions of an op and its inputs' metadata, so runs on the same fake mode
share them: a search rewrites one graph for many plans, and FakeTensor
dispatch is most of a rewrite's cost.

>>> import torch, compfx
>>> from compfx.passes import propagate_dtypes
>>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
>>> x = next(n for n in gm.graph.nodes if n.op == "placeholder")
>>> x.meta["val"] = x.meta["val"].to(torch.bfloat16)  # as if the model were fed bf16
>>> [str(n.meta["val"].dtype) for n in propagate_dtypes(gm).graph.nodes if n.op == "call_function"]
['torch.float32', 'torch.float32']
"""

from __future__ import annotations

import functools
import logging
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from compfx.graph_capture import get_attribute, meta_value
from compfx.cast_policy import mutated_positions

__all__ = ["propagate_dtypes", "DtypePropagator", "UNKNOWN", "dtypes_of"]


class _Unknown:
    """A value the pass could not type (no metadata, fake execution failed)."""

    def __repr__(self):
        return "<unknown>"


UNKNOWN = _Unknown()

#: Fake results shared by every propagation on one fake mode (the graph's: its values belong to it).
_FAKE_RESULTS: "weakref.WeakKeyDictionary[FakeTensorMode, dict]" = weakref.WeakKeyDictionary()


def propagate_dtypes(gm: fx.GraphModule) -> fx.GraphModule:
    """Refresh every node's recorded value from its inputs' (placeholders and attributes as recorded); returns ``gm``.

    Nodes are run on FakeTensors in graph order; a node that cannot run there
    gets its recorded value with floating outputs in its inputs' promoted dtype.
    """
    propagator = DtypePropagator(gm)
    for node in gm.graph.nodes:
        if node.op != "output":
            propagator.update(node, force=node.op not in ("placeholder", "get_attr"))
    return gm


def dtypes_of(value) -> tuple:
    """The dtype facts of a value: tensor dtypes, and dtype values themselves (``x.dtype`` nodes)."""
    return tuple(leaf.dtype if isinstance(leaf, torch.Tensor) else leaf if isinstance(leaf, torch.dtype) else None
                 for leaf in _leaves(value))


def _leaves(value) -> list:
    """The leaves of a node's value (tuples, lists and dicts opened), in order.

    What ``pytree.tree_leaves`` gives for the values a graph's metadata holds,
    without its per-node type lookups: a rewrite asks this of every node it
    touches, several times, and pytree's walk was a fifth of a rewrite's time.
    """
    out: list = []
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) in (tuple, list):
            stack.extend(reversed(item))
        elif type(item) is dict:
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (tuple, list, dict)) and not isinstance(item, torch.Size):
            stack.extend(reversed(pytree.tree_leaves(item)))  # namedtuples and the like: pytree's own reading
        else:
            out.append(item)
    return out


class DtypePropagator:
    """Each node's current value in a graph being rewritten; :meth:`update` refreshes one node.

    ``graph`` is the graph being rewritten (default ``gm.graph``); ``gm`` owns
    its attributes and submodules. Values start as recorded (parameters and
    buffers as fakes of the real tensors).
    """

    def __init__(self, gm: fx.GraphModule, graph: fx.Graph | None = None):
        self.gm, self.graph = gm, graph if graph is not None else gm.graph
        self.mode = self._fake_mode()
        self.shared_results = _FAKE_RESULTS.setdefault(self.mode, {})
        self.values: dict[fx.Node, Any] = {}
        self._initial: dict[fx.Node, Any] = {}
        self._original_dtypes: dict[fx.Node, tuple] = {}
        for node in self.graph.nodes:  # before anything rewrites a node's metadata
            self.original_dtypes(node)

    def _fake_mode(self) -> FakeTensorMode:
        """The fake mode that made the graph's values (not a TracingContext's: AOT may hold another)."""
        for node in self.graph.nodes:
            for leaf in pytree.tree_leaves(meta_value(node)):
                if isinstance(leaf, FakeTensor):
                    return leaf.fake_mode
        return FakeTensorMode(allow_non_fake_inputs=True)

    # -- what is known -------------------------------------------------------------
    def initial_value(self, node: fx.Node):
        """The node's value before any rewrite (fake for parameters and buffers); worked out once per node."""
        if node not in self._initial:
            if node.op == "get_attr":
                value = get_attribute(self.gm, node.target)
                if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                    value = self.mode.from_tensor(value, static_shapes=True)
            else:
                value = meta_value(node, UNKNOWN)
            self._initial[node] = value
        return self._initial[node]

    def original_dtypes(self, node: fx.Node) -> tuple:
        """The dtypes of the node's value before the rewrite."""
        if node not in self._original_dtypes:
            self._original_dtypes[node] = dtypes_of(self.initial_value(node))
        return self._original_dtypes[node]

    def value(self, node: fx.Node):
        """The node's current value (its initial one until :meth:`update` or :meth:`record` says otherwise)."""
        return self.values.get(node, self.initial_value(node))

    def retyped(self, node: fx.Node) -> bool:
        """Did the node's dtypes change from the original graph's?"""
        return node in self.values and dtypes_of(self.values[node]) != self.original_dtypes(node)

    def device_type(self) -> str:
        """The device type of the graph's first floating tensor (``"cpu"`` when it has none)."""
        for node in self.graph.nodes:
            for leaf in pytree.tree_leaves(self.initial_value(node)):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    return leaf.device.type
        return "cpu"

    # -- refreshing ----------------------------------------------------------------------
    def update(self, node: fx.Node, *, force: bool = False) -> None:
        """Refresh the node's value when an input was retyped (or ``force``), writing its metadata when it changed."""
        changed = force or any(self.retyped(arg) for arg in node.all_input_nodes)
        if node.op in ("placeholder", "get_attr") or not changed:
            self.values[node] = self.initial_value(node)
            return
        value = UNKNOWN if node.is_impure() else self._execute(node)
        if value is UNKNOWN:
            value = self._guessed(node)
        value = self._needing_grad_like(value, self.initial_value(node))
        self.values[node] = value
        if self.retyped(node) or force:
            self._write_meta(node, value, like=node)

    def record(self, node: fx.Node, value, *, like: fx.Node) -> None:
        """Set the value of a node a pass inserted (its metadata entries of the kinds ``like`` has).

        An inserted node counts as retyped: its consumers see a new input and are refreshed.
        """
        self._initial[node] = value
        self._original_dtypes[node] = None  # nothing before the rewrite
        self.values[node] = value
        self._write_meta(node, value, like=like)

    def converted(self, value, dtype: torch.dtype):
        """``value.to(dtype)`` on fakes (shared between runs); :data:`UNKNOWN` when it cannot be computed."""
        return self._needing_grad_like(self._shared(("to", dtype), value, run=lambda: value.to(dtype)), value)

    def _needing_grad_like(self, value, recorded):
        """``value``, needing a gradient wherever ``recorded`` does (a float tensor's ``requires_grad``).

        Retyping changes dtypes, not what needs a gradient; and a rewrite may
        run under ``no_grad`` (a planned block builds its graph inside a
        forward), where every fake result would say it needs none. So the
        metadata, and the cost model's pricing of a cast's backward, read the
        same whatever the grad mode of the rewrite.
        """
        if isinstance(value, torch.Tensor) and isinstance(recorded, torch.Tensor):
            wanted = recorded.requires_grad and value.is_floating_point()
            if value.requires_grad == wanted:
                return value
            return self._shared(("requires_grad", wanted), value,
                                run=lambda: value.detach().requires_grad_(wanted))
        if type(value) in (tuple, list) and pytree.tree_structure(value) == pytree.tree_structure(recorded):
            return pytree.tree_map(self._needing_grad_like, value, recorded)  # leaf by leaf
        return value

    def _execute(self, node: fx.Node):
        """Run the node on FakeTensors; UNKNOWN when it cannot run."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.value)
        if any(leaf is UNKNOWN for leaf in _leaves((args, kwargs))):
            return UNKNOWN
        if node.op == "call_module":  # modules may hold state: never shared
            module = self.gm.get_submodule(node.target)
            return self._run_fake(lambda: module(*args, **kwargs))
        if node.op == "call_function":
            call = lambda: node.target(*args, **kwargs)  # noqa: E731
        elif node.op == "call_method":
            call = lambda: getattr(args[0], node.target)(*args[1:], **kwargs)  # noqa: E731
        else:
            return UNKNOWN
        if mutated_positions(node) - {"out"} or "out" in node.kwargs:  # writes its inputs: run it here
            return self._run_fake(call)
        return self._shared((node.op, node.target), args, kwargs, run=call)

    def _shared(self, what, *inputs, run: Callable[[], Any]):
        """``run()`` on fakes, or the result an earlier run on this fake mode got for the same call."""
        key = _fake_call_key(what, *inputs)
        if key is not None and key in self.shared_results:
            return self.shared_results[key]
        value = self._run_fake(run)
        if key is not None and value is not UNKNOWN:
            self.shared_results[key] = value
        return value

    def _run_fake(self, run: Callable[[], Any]):
        try:
            with _quiet_fake_tensor_errors(), self.mode:
                return run()
        except Exception:  # noqa: BLE001 - an op that cannot run on these dtypes
            return UNKNOWN

    def _guessed(self, node: fx.Node):
        """Conservative typing when fake execution fails: float outputs take the promoted input dtype."""
        original = self.initial_value(node)
        dtypes = [t.dtype for arg in node.all_input_nodes for t in _float_leaves(self.value(arg))]
        if original is UNKNOWN or not dtypes:
            return original
        promoted = functools.reduce(torch.promote_types, dtypes)
        with self.mode:
            return pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(promoted) if t.is_floating_point() else t, original)

    @staticmethod
    def _write_meta(node: fx.Node, value, like: fx.Node) -> None:
        keys = [k for k in ("val", "example_value") if k in like.meta] or ["val"]
        for key in keys:
            node.meta[key] = value
        if isinstance(value, torch.Tensor) and "tensor_meta" in like.meta:
            node.meta["tensor_meta"] = _tensor_metadata(value)


class _NoKey(Exception):
    """A call with no hashable description (symbolic sizes, an unhashable argument)."""


#: Each fake value's ``tensor_meta``: shared fake results hand the same value to many rewrites, and working out
#: its contiguity each time was a tenth of a rewrite.
_TENSOR_METADATA: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _tensor_metadata(value: torch.Tensor):
    found = _TENSOR_METADATA.get(value)
    if found is None:
        found = _TENSOR_METADATA[value] = _extract_tensor_metadata(value)
    return found


def _fake_call_key(*call) -> tuple | None:
    """A hashable description of a call on fake values; None when there is none (symbolic sizes...)."""
    try:
        key = (_described(call), torch.is_grad_enabled())  # grad mode decides the outputs' requires_grad
        hash(key)
    except (_NoKey, TypeError):  # e.g. a slice argument
        return None
    return key


def _described(value):
    """``value`` as nested tuples of hashable parts: containers by type and items, tensors by their metadata.

    Any tuple, list or dict is opened (an FX node's ``immutable_list`` arguments, ``torch.Size``, a namedtuple),
    its type kept in the description: two calls share a key only when their arguments have the same types.
    """
    if isinstance(value, (tuple, list)):
        return (type(value), *map(_described, value))
    if isinstance(value, dict):
        return (type(value), *((name, _described(item)) for name, item in value.items()))
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride(), value.storage_offset())
        if not all(type(size) is int for size in sizes):
            raise _NoKey
        return (torch.Tensor, sizes, value.dtype, value.device, value.requires_grad)
    return (type(value), value)


def _float_leaves(value) -> list[torch.Tensor]:
    return [t for t in _leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


_FAKE_TENSOR_LOGGERS = ("torch._subclasses.fake_tensor", "torch._subclasses.fake_tensor.__not_implemented")


@contextmanager
def _quiet_fake_tensor_errors():
    """Fake kernels log every failure; a failed probe is an answer here, not an error.

    The loggers are disabled rather than given a level: ``setLevel`` clears the
    level cache of every logger in the process (thousands, once transformers is
    imported), which cost about a millisecond per op the rewrite runs on fakes.
    """
    loggers = [logging.getLogger(name) for name in _FAKE_TENSOR_LOGGERS]
    disabled = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, was in zip(loggers, disabled):
            logger.disabled = was
