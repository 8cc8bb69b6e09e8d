"""Rewrite pass: give every keyed op the precision its plan asks for, by inserting casts.

Semantics (they make ``Plan.amp`` match ``torch.autocast`` exactly):

* ``"low"`` / ``"fp32"``: every floating input of the op (activations *and*
  parameters) is cast to that dtype. Exceptions:

  - normalisation ops (batch/layer/group/instance norm) cast only their
    activation; weight, bias and running stats stay FP32, which the kernels
    accept. Casting BatchNorm's running stats would lose their in-place update.
  - an input the op mutates (``x.add_(y)``, ``inplace=True``, ``out=``) is
    never cast, for the same reason.
  - float64 tensors are left alone, as autocast leaves them.
  - composite ops that autocast casts *inside* (``multi_head_attention`` and
    leaf ``call_module`` ops) run under ``torch.autocast(device, low_dtype)``
    for ``"low"`` instead of having their inputs cast (see :class:`AutocastRegion`).

* ``"follow"``: on an ``"other"`` op, no casts (what autocast does for unlisted
  ops). Mixed floating inputs stay mixed only for ops that type-promote them
  (:data:`PROMOTING_KINDS`: add, mul, where, ...); any other op (e.g. a GRU fed
  bf16 activations and FP32 weights, which its kernel rejects) gets its inputs
  cast to the widest of them. On a whitelist/blacklist op, all floating inputs
  are cast to the widest floating input dtype.

Data movement ops (no OpKey) never get casts; their output dtype follows.
Dtypes are tracked by re-running each node whose inputs changed dtype on
FakeTensors, so no cast is inserted where a tensor already has the needed
dtype. One cast node per (tensor, dtype) is shared by all consumers; a
parameter is cast at most once per forward (autocast's weight-cast cache).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from compfx.capture import _get_attr, is_in_place
from compfx.errors import PassError
from compfx.oplists import classify
from compfx.opkey import KEY_META, OpKey
from compfx.plan import PRECISIONS as _PRECISIONS

__all__ = ["insert_casts", "AutocastRegion", "CAST_META", "DTYPES_FRESH", "NORM_KINDS", "COMPOSITE_KINDS",
           "PROMOTING_KINDS", "dtype_short_name", "meta_value"]

PASS_NAME = "insert_casts"
#: ``node.meta`` flag on every cast node this pass inserts.
CAST_META = "compfx_cast"
#: ``gm.meta`` flag the pass sets: every node's value (``meta_value``) has the dtype it runs in after the rewrite
DTYPES_FRESH = "compfx_dtypes_fresh"
#: Ops whose weight/bias/running stats stay FP32 whatever the op's precision.
NORM_KINDS = frozenset({"batch_norm", "layer_norm", "group_norm", "instance_norm"})
#: Ops that autocast casts *inside*; "low" runs them under torch.autocast.
COMPOSITE_KINDS = frozenset({"multi_head_attention", "gru", "lstm", "rnn_tanh", "rnn_relu"})
#: "Other" ops that take mixed floating inputs and type-promote them (TensorIterator ops).
PROMOTING_KINDS = frozenset("""
    add sub rsub mul div where maximum minimum fmax fmin pow float_power atan2 lerp addcmul addcdiv
    clamp clip clamp_min clamp_max hypot copysign remainder fmod floor_divide eq ne lt le gt ge
    logaddexp logaddexp2 xlogy heaviside
""".split())
_SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


class _Unknown:
    """A value the pass could not type (no metadata, fake execution failed)."""

    def __repr__(self):
        return "<unknown>"


UNKNOWN = _Unknown()


def dtype_short_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bf16"``: used in the names of inserted cast nodes."""
    return _SHORT_NAMES.get(dtype, str(dtype).replace("torch.", ""))


class AutocastRegion(torch.nn.Module):
    """Runs one composite op under ``torch.autocast(device_type, dtype)``.

    This is how ``"low"`` runs an op that autocast casts *inside*
    (``F.multi_head_attention_forward``, a leaf module): exactly as in eager AMP.
    It holds no parameters of its own; a wrapped leaf module stays registered
    where it was, so ``state_dict()`` does not change.

    >>> import torch
    >>> region = AutocastRegion(torch.nn.functional.linear, "cpu", torch.bfloat16)
    >>> region(torch.randn(2, 3), torch.randn(4, 3)).dtype
    torch.bfloat16
    """

    def __init__(self, fn: Callable, device_type: str, dtype: torch.dtype):
        super().__init__()
        object.__setattr__(self, "fn", fn)  # not a child module: its weights belong to their own path
        self.device_type, self.dtype = device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"{name}, device_type={self.device_type!r}, dtype={self.dtype}"


def insert_casts(
    gm: fx.GraphModule,
    precisions: Mapping[OpKey, str],
    low_dtype: torch.dtype,
    *,
    categories: Mapping[OpKey, str] | None = None,
    default_precision: str | None = None,
    restore_output_dtypes: bool = True,
) -> fx.GraphModule:
    """Insert the casts that run each keyed op at ``precisions[key]``; returns ``gm`` (rewritten).

    Works on graphs from :func:`compfx.capture` (parameters as ``get_attr``)
    and on dynamo graphs handed to a ``torch.compile`` backend (parameters as
    placeholders, values in ``meta["example_value"]``). ``categories`` maps
    keys to ``"whitelist" | "blacklist" | "other"`` (default: autocast's table
    for the graph's device). Keys missing from ``precisions`` raise, unless
    ``default_precision`` is given. The rewrite is built on a copy of the
    graph and swapped in at the end, so a failure leaves ``gm`` unchanged.

    >>> import torch, compfx
    >>> from compfx.passes import insert_casts
    >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
    >>> plan = {node.meta["compfx_key"]: "low" for node in compfx.op_nodes(gm)}
    >>> gm = insert_casts(gm, plan, torch.bfloat16)
    >>> sorted(n.name for n in gm.graph.nodes if n.meta.get("compfx_cast"))
    ['_0_bias_bf16', '_0_weight_bf16', 'input_1_bf16', 'relu_fp32']
    >>> gm(torch.randn(2, 4)).dtype
    torch.float32
    """
    _check_arguments(gm, precisions, low_dtype, default_precision)
    graph = _copy_graph(gm)
    inserter = _CastInserter(gm, graph, precisions, low_dtype, categories, default_precision)
    try:
        inserter.run(restore_output_dtypes)
        for name, region in inserter.regions.items():
            gm.add_submodule(name, region)
        graph.eliminate_dead_code()
        graph.lint()
    except Exception as error:
        for name in inserter.regions:
            gm._modules.pop(name, None)
        if isinstance(error, PassError):
            raise
        raise PassError(f"{PASS_NAME} failed ({type(error).__name__}: {error}); the graph module was left "
                        "unchanged. Please report this with the model that triggers it.") from error
    gm.graph = graph  # recompiles
    gm.meta[DTYPES_FRESH] = True  # values were re-typed downstream of every cast: later passes may trust them
    return gm


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm.graph`` to rewrite; dynamo's plain attributes on nodes (``_dynamo_source``) come along."""
    graph = copy.deepcopy(gm.graph)
    graph.owning_module = gm  # purity checks of call_module nodes look the module up
    for old, new in zip(gm.graph.nodes, graph.nodes):  # deepcopy keeps node order
        for name, value in vars(old).items():
            if name.startswith("_dynamo") and not hasattr(new, name):
                setattr(new, name, value)
    return graph


def _check_arguments(gm, precisions, low_dtype, default_precision) -> None:
    if not isinstance(gm, fx.GraphModule):
        raise PassError(f"{PASS_NAME} takes a torch.fx.GraphModule; got {type(gm).__name__}.")
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise PassError(f"{PASS_NAME}: low_dtype={low_dtype}; expected torch.float16 or torch.bfloat16.")
    bad = {str(k): p for k, p in precisions.items() if p not in _PRECISIONS}
    if default_precision is not None and default_precision not in _PRECISIONS:
        bad["default_precision"] = default_precision
    if bad:
        raise PassError(f"{PASS_NAME}: unknown precision(s) {dict(list(bad.items())[:3])}; expected one of "
                        f"{_PRECISIONS}.")
    if default_precision is None:
        missing = [str(n.meta[KEY_META]) for n in gm.graph.nodes
                   if KEY_META in n.meta and n.meta[KEY_META] not in precisions]
        if missing:
            raise PassError(f"{PASS_NAME}: no precision for {len(missing)} op(s) of the graph (e.g. {missing[:3]}); "
                            "pass a plan made for this model, or default_precision='follow'.")


# ---------------------------------------------------------------------------
# values: what the pass knows about each node's output


def meta_value(node: fx.Node):
    """The node's recorded value: ``meta["val"]`` (compfx, export) or ``meta["example_value"]`` (dynamo)."""
    for name in ("val", "example_value"):
        if node.meta.get(name) is not None:
            return node.meta[name]
    return UNKNOWN


#: Fake results are pure functions of an op and its inputs' metadata. A search rewrites one graph for
#: many plans, and FakeTensor dispatch is most of a rewrite's cost, so runs on the same fake mode (the
#: graph's: its values belong to it) share their results.
_FAKE_RESULTS: "weakref.WeakKeyDictionary[FakeTensorMode, dict]" = weakref.WeakKeyDictionary()


def _fake_call_key(*call) -> tuple | None:
    """A hashable description of a call on fake values; None when there is none (symbolic sizes...)."""
    leaves, spec = pytree.tree_flatten(call)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sizes = (*leaf.shape, *leaf.stride(), leaf.storage_offset())
            if not all(type(size) is int for size in sizes):
                return None
            parts.append((sizes, leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            parts.append((type(leaf), leaf))
    key = (str(spec), tuple(parts), torch.is_grad_enabled())  # grad mode decides the outputs' requires_grad
    try:
        hash(key)
    except TypeError:  # e.g. a slice argument
        return None
    return key


def _float_leaves(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _dtypes(value) -> tuple:
    """The dtype facts of a value: tensor dtypes, and dtype values themselves (``x.dtype`` nodes)."""
    return tuple(leaf.dtype if isinstance(leaf, torch.Tensor) else leaf if isinstance(leaf, torch.dtype) else None
                 for leaf in pytree.tree_leaves(value))


@contextmanager
def _quiet_fake_tensor_errors():
    """Fake kernels log every failure; a failed probe is an answer here, not an error."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _CastInserter:
    """One run of the pass over one graph (state: node values and the cast cache)."""

    def __init__(self, gm, graph, precisions, low_dtype, categories, default_precision):
        self.gm, self.graph = gm, graph
        self.precisions, self.low_dtype = precisions, low_dtype
        self.default_precision = default_precision
        self.mode = self._fake_mode()
        self.shared_results = _FAKE_RESULTS.setdefault(self.mode, {})
        self.values: dict[fx.Node, Any] = {}
        self.initial_values: dict[fx.Node, Any] = {}  # _initial_value's answers: each node is typed once
        self.original_dtypes: dict[fx.Node, tuple] = {}
        self.casts: dict[tuple[Any, torch.dtype], fx.Node] = {}
        self.regions: dict[str, AutocastRegion] = {}
        self.device_type = self._device_type()
        if categories is None:  # autocast's table for the graph's device type
            categories = {n.meta[KEY_META]: classify(n.meta[KEY_META].kind, self.device_type)
                          for n in self.graph.nodes if KEY_META in n.meta}
        self.categories = categories

    def _fake_mode(self) -> FakeTensorMode:
        """The fake mode that made the graph's values (not a TracingContext's: AOT may hold another)."""
        for node in self.graph.nodes:
            for leaf in pytree.tree_leaves(meta_value(node)):
                if isinstance(leaf, FakeTensor):
                    return leaf.fake_mode
        return FakeTensorMode(allow_non_fake_inputs=True)

    def _device_type(self) -> str:
        for node in self.graph.nodes:
            for leaf in pytree.tree_leaves(self._initial_value(node)):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    return leaf.device.type
        return "cpu"

    # -- main loop -------------------------------------------------------------
    def run(self, restore_output_dtypes: bool) -> None:
        nodes = list(self.graph.nodes)
        for node in nodes:
            self.original_dtypes[node] = _dtypes(self._initial_value(node))
        for node in nodes:
            if node.op == "output":
                if restore_output_dtypes:
                    self._restore_outputs(node)
                continue
            if KEY_META in node.meta:
                self._rewrite_op(node)
            self._update_value(node)

    def _initial_value(self, node: fx.Node):
        """The node's value before the rewrite (fake for parameters and buffers); worked out once per node."""
        if node in self.initial_values:
            return self.initial_values[node]
        if node.op == "get_attr":
            value = _get_attr(self.gm, node.target)
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                value = self.mode.from_tensor(value, static_shapes=True)
        else:
            value = meta_value(node)
        self.initial_values[node] = value
        return value

    def _value(self, node: fx.Node):
        return self.values.get(node, UNKNOWN)

    def _retyped(self, node: fx.Node) -> bool:
        return node in self.values and _dtypes(self.values[node]) != self.original_dtypes.get(node)

    # -- one keyed op ------------------------------------------------------------
    def _precision(self, node: fx.Node) -> str:
        return self.precisions.get(node.meta[KEY_META], self.default_precision)

    def _category(self, node: fx.Node) -> str:
        return self.categories.get(node.meta[KEY_META], "other")

    def _rewrite_op(self, node: fx.Node) -> None:
        key: OpKey = node.meta[KEY_META]
        precision = self._precision(node)
        if precision == "low" and (key.kind in COMPOSITE_KINDS or node.op == "call_module"):
            self._run_under_autocast(node)
            return
        castable = self._castable_inputs(node)
        if precision == "follow" and self._category(node) == "other":
            if not self._runs_as_is(node, castable):
                self._cast_inputs(node, castable, self._widest_input_dtype(castable))
            return
        dtype = {"low": self.low_dtype, "fp32": torch.float32}.get(precision) or self._widest_input_dtype(castable)
        self._cast_inputs(node, castable, dtype)

    def _castable_inputs(self, node: fx.Node) -> list[tuple[Any, fx.Node]]:
        """(position, input node) pairs whose value this op's precision applies to."""
        kind = node.meta[KEY_META].kind
        mutated = _mutated_positions(node)
        pairs = []
        for position, value in [*enumerate(node.args), *node.kwargs.items()]:
            if position in mutated or (kind in NORM_KINDS and position not in (0, "input")):
                continue
            for arg in _nodes_in(value):
                leaf = self._value(arg)
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype != torch.float64:
                    pairs.append((position, arg))
        return pairs

    def _widest_input_dtype(self, castable: list[tuple[Any, fx.Node]]) -> torch.dtype | None:
        dtypes = [self._value(arg).dtype for _, arg in castable]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else None

    def _cast_inputs(self, node: fx.Node, castable: list[tuple[Any, fx.Node]], dtype: torch.dtype | None) -> None:
        """Cast the ``castable`` inputs (from :meth:`_castable_inputs`) of ``node`` to ``dtype`` (None: no casts)."""
        if dtype is None:
            return
        args = dict.fromkeys(arg for _, arg in castable)  # ordered, no repeats
        replace = {arg: self._cast(arg, dtype, node) for arg in args if self._value(arg).dtype != dtype}
        if replace:
            _replace_inputs(node, replace)

    def _runs_as_is(self, node: fx.Node, castable: list[tuple[Any, fx.Node]]) -> bool:
        """Can an op with no casts of its own run on the dtypes that reach it?

        Yes when they agree, or when the op type-promotes mixed inputs (add, mul,
        where, ...). Other kernels (GEMMs, RNNs, scatter) reject mixed inputs,
        and fake kernels are too lax to tell (a fake ``linear`` takes bf16 x FP32).
        """
        dtypes = {self._value(arg).dtype for _, arg in castable}
        return len(dtypes) <= 1 or node.meta[KEY_META].kind in PROMOTING_KINDS

    def _run_under_autocast(self, node: fx.Node) -> None:
        if node.op == "call_module":
            fn = self.gm.get_submodule(node.target)
        elif node.op == "call_function":
            fn = node.target
        else:  # call_method: no function to wrap; cast like any other op
            self._cast_inputs(node, self._castable_inputs(node), self.low_dtype)
            return
        name = self._free_name(f"{node.meta[KEY_META].module or node.name}_autocast_{dtype_short_name(self.low_dtype)}")
        self.regions[name] = AutocastRegion(fn, self.device_type, self.low_dtype)
        node.op, node.target = "call_module", name

    def _free_name(self, wanted: str) -> str:
        base = wanted.replace(".", "_")
        name, i = base, 1
        while hasattr(self.gm, name) or name in self.regions:
            name, i = f"{base}_{i}", i + 1
        return name

    # -- casts ---------------------------------------------------------------------
    def _cast(self, source: fx.Node, dtype: torch.dtype, consumer: fx.Node) -> fx.Node:
        identity = self._identity(source)
        cached = self.casts.get((identity, dtype))
        if cached is not None:
            return cached
        with self.graph.inserting_before(consumer):
            cast = self.graph.create_node("call_method", "to", (source, dtype), {},
                                          name=f"{source.name}_{dtype_short_name(dtype)}")
        self._describe_cast(cast, source, dtype, consumer)
        self.casts[(identity, dtype)] = cast
        return cast

    def _identity(self, node: fx.Node):
        """Casts are shared per tensor: two get_attr nodes of one parameter share one cast."""
        if node.op == "get_attr":
            return ("attr", id(_get_attr(self.gm, node.target)))
        return node

    def _describe_cast(self, cast: fx.Node, source: fx.Node, dtype: torch.dtype, consumer: fx.Node) -> None:
        """FX does not propagate metadata: give the cast its module stack, value and tensor_meta."""
        for name in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if name in consumer.meta:
                cast.meta[name] = copy.copy(consumer.meta[name])
        cast.meta[CAST_META] = True
        value = self._shared(("to", dtype), self._value(source), run=lambda: self._value(source).to(dtype))
        if value is UNKNOWN:  # the pass must not guess the value of its own cast
            raise PassError(f"{PASS_NAME} could not cast {source.name} to {dtype} on fake values; please report "
                            "this with the model that triggers it.")
        self.values[cast] = value
        self.original_dtypes[cast] = (dtype,)
        self._write_meta(cast, value, like=source)

    def _restore_outputs(self, output: fx.Node) -> None:
        """Return the outputs in the dtypes the original graph returned."""
        replace = {}
        for arg in _nodes_in(output.args):
            value, original = self._value(arg), self.original_dtypes.get(arg, ())
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and len(original) == 1
                    and original[0] is not None and original[0] != value.dtype):
                replace[arg] = self._cast(arg, original[0], output)
        if replace:
            _replace_inputs(output, replace)

    # -- dtype tracking ------------------------------------------------------------
    def _update_value(self, node: fx.Node) -> None:
        inputs_changed = any(arg.meta.get(CAST_META) or self._retyped(arg) for arg in node.all_input_nodes)
        if node.op in ("placeholder", "get_attr") or not (inputs_changed or node.target in self.regions):
            self.values[node] = self._initial_value(node)
            return
        value = UNKNOWN if self._is_impure(node) else self._execute(node)
        if value is UNKNOWN:
            value = self._guess_value(node)
        self.values[node] = value
        if self._retyped(node):
            self._write_meta(node, value, like=node)

    def _is_impure(self, node: fx.Node) -> bool:
        """Side-effecting nodes (autocast enter/exit, RNG state...) are never re-run on fakes."""
        return node.target not in self.regions and node.is_impure()

    def _execute(self, node: fx.Node):
        """Run the node on FakeTensors; UNKNOWN when it cannot run."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._value)
        if any(leaf is UNKNOWN for leaf in pytree.tree_leaves((args, kwargs))):
            return UNKNOWN
        if node.op == "call_module":  # region names are per run: never shared
            module = self.regions.get(node.target) or self.gm.get_submodule(node.target)
            return self._run_fake(lambda: module(*args, **kwargs))
        if node.op == "call_function":
            call = lambda: node.target(*args, **kwargs)  # noqa: E731
        elif node.op == "call_method":
            call = lambda: getattr(args[0], node.target)(*args[1:], **kwargs)  # noqa: E731
        else:
            return UNKNOWN
        if _mutated_positions(node) - {"out"} or "out" in node.kwargs:  # writes its inputs: run it here
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

    def _guess_value(self, node: fx.Node):
        """Conservative typing when fake execution fails: float outputs take the promoted input dtype."""
        original = meta_value(node)
        dtypes = [t.dtype for arg in node.all_input_nodes for t in _float_leaves(self._value(arg))]
        if original is UNKNOWN or not dtypes:
            return original
        promoted = functools.reduce(torch.promote_types, dtypes)
        with self.mode:
            return pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(promoted) if t.is_floating_point() else t, original)

    def _write_meta(self, node: fx.Node, value, like: fx.Node) -> None:
        keys = [k for k in ("val", "example_value") if k in like.meta] or ["val"]
        for key in keys:
            node.meta[key] = value
        if "tensor_meta" in like.meta and isinstance(value, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(value)


# ---------------------------------------------------------------------------
# graph helpers


def _nodes_in(value) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)
    return found


def _replace_inputs(node: fx.Node, replace: Mapping[fx.Node, fx.Node]) -> None:
    node.args = fx.node.map_arg(node.args, lambda n: replace.get(n, n))
    node.kwargs = fx.node.map_arg(node.kwargs, lambda n: replace.get(n, n))


def _mutated_positions(node: fx.Node) -> set:
    """Argument positions the op writes to: never cast them, or the write is lost."""
    positions = {"out"}
    if is_in_place(node.target) or _passes_inplace_true(node):
        positions |= {0, "input", "self"}
    return positions


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
