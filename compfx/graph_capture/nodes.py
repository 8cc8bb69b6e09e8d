"""What a captured node holds and what it is.

Its recorded value (:func:`meta_value`, :func:`complete_metadata`), whether it
is a numerical op that gets an OpKey (:func:`is_numerical_op`) or pure data
movement (:data:`DATA_MOVEMENT_KINDS`), and whether it writes an input or must
survive dead-code elimination (:func:`is_in_place`, :func:`writes_input`,
:func:`renorms_weight`, :func:`has_side_effects`). The tracers, the passes and the cost model all ask
these questions here, so they get the same answers.
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from ..opkey import KEY_META, normalize_kind
from .checkpoints import CHECKPOINT_META

__all__ = [
    "DATA_MOVEMENT_KINDS",
    "is_data_movement",
    "meta_value",
    "produces_float",
    "is_numerical_op",
    "op_nodes",
    "complete_metadata",
    "has_side_effects",
    "enters_functorch_transform",
    "draws_random_numbers",
    "RANDOM_KINDS",
    "writes_input",
    "renorms_weight",
    "renormed_weight",
    "is_in_place",
    "copy_graph",
]


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
    """True when the node's recorded value holds a floating-point or complex tensor.

    Complex values are numbers a precision plan must decide about like any other: ``torch.fft.rfft`` is on
    autocast's FP32 list, and its real input is what a plan casts (:func:`compfx.cast_policy.castable`).
    """
    value = meta_value(node)
    return any(
        isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
        for leaf in pytree.tree_leaves(value)
    )


def is_numerical_op(node: fx.Node) -> bool:
    """The filter that decides which call nodes get an OpKey (in every tracer's graph and in dynamo's backend graphs).

    A numerical op computes floating-point (or complex) values: leaf modules that return
    them, and every such call that is not pure data movement.
    """
    if node.op == "call_module":
        return produces_float(node)
    return not is_data_movement(normalize_kind(node.op, node.target)) and produces_float(node)


def op_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that carry an OpKey, in graph order."""
    return [n for n in gm.graph.nodes if KEY_META in n.meta]


def _tensor_meta(value):
    if isinstance(value, torch.Tensor):
        return _extract_tensor_metadata(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        items = [_tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in value]
        if hasattr(value, "_fields"):  # a namedtuple takes its fields as arguments, not one iterable
            return type(value)(*items)
        try:
            return type(value)(items)
        except TypeError:  # another tuple subclass with its own constructor: a plain tuple holds the same facts
            return tuple(items)
    return None


def complete_metadata(gm: fx.GraphModule) -> list[fx.Node]:
    """Give every node ``val`` (and tensors ``tensor_meta``); returns nodes still without ``val``.

    Dynamo keeps values in ``meta["example_value"]``; they are copied to
    ``meta["val"]``, where every later stage reads them. The output node's
    value is its arguments' values.
    """
    missing = []
    for node in gm.graph.nodes:
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
        if node.op == "output":
            node.meta["val"] = pytree.tree_map(
                lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, node.args[0]
            )
        if "val" not in node.meta and node.op != "output" and (not node.users or _opens_autocast_block(node)):
            node.meta["val"] = None  # a call kept only for its side effect, e.g. _set_grad_enabled
        if "val" not in node.meta:
            missing.append(node)
            continue
        meta = _tensor_meta(node.meta["val"])
        if meta is not None:
            node.meta["tensor_meta"] = meta
    return missing


def _opens_autocast_block(node: fx.Node) -> bool:
    """``_enter_autocast``: its result is the block, which only ``_exit_autocast`` reads."""
    return node.op == "call_function" and node.target is torch.amp.autocast_mode._enter_autocast


def has_side_effects(node: fx.Node) -> bool:
    """Keep this node even when nothing reads its result: impure calls, leaf modules, functorch's transform
    levels, and calls that write an input (BatchNorm's ``num_batches_tracked.add_(1)``, ``relu(x, inplace=True)``,
    ``out=``).

    Every dead-code elimination in compfx passes this. FX's own purity test already keeps ``torch.rand*``
    draws, grad-mode and autocast switches, profiler ranges and asserts, but takes a ``call_method`` such
    as ``h.add_(x)`` for pure and would drop the write; and it knows neither functorch's bookkeeping
    (:func:`enters_functorch_transform`) nor a draw written as a method or a dropout
    (:func:`draws_random_numbers`).

    >>> import torch, torch.fx as fx
    >>> g = fx.Graph()
    >>> level = g.call_function(torch._functorch.predispatch._vmap_increment_nesting, (2, "error"))
    >>> has_side_effects(level), has_side_effects(g.call_function(torch.sin, (1.0,)))
    (True, False)
    """
    if node.op == "call_module" or node.is_impure():
        return True
    if node.op == "call_function" and enters_functorch_transform(node.target):
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    return writes_input(node) or renorms_weight(node) or "out" in node.kwargs or draws_random_numbers(node)


#: Op kinds that advance the RNG. FX knows the ``torch.rand*`` family as functions, not as ``x.bernoulli()``
#: or the dropouts: an unused draw still moves the generator, and every later dropout mask depends on it.
RANDOM_KINDS = frozenset("""
    dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d native_dropout fused_dropout rrelu
    gumbel_softmax bernoulli multinomial normal poisson rand rand_like randn randn_like randint randint_like
    randperm
""".split())


def draws_random_numbers(node: fx.Node) -> bool:
    """Does the call draw from the RNG (:data:`RANDOM_KINDS`)?"""
    return node.op in ("call_function", "call_method") and normalize_kind(node.op, node.target) in RANDOM_KINDS


def enters_functorch_transform(target) -> bool:
    """Is ``target`` part of functorch's transform machinery (``vmap``/``grad``/``jvp`` levels, batch dims)?

    ``torch.compile`` writes ``torch.vmap`` as ``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting``
    around the batched ops. Nothing reads the result of the decrement, yet without it the next op
    runs inside a level that no longer exists ("your tensor may have escaped from inside a function
    being vmapped").
    """
    module = getattr(target, "__module__", None) or ""
    return module.startswith(("torch._functorch", "torch._C._functorch"))


def writes_input(node: fx.Node) -> bool:
    """True when the call writes its first argument: an in-place name (``add_``, ``operator.iadd``) or ``inplace=True``.

    A ``call_module`` target is a module's path, not an op's name: ``self.proj_`` writes nothing by its name.
    """
    if node.op not in ("call_function", "call_method"):
        return node.kwargs.get("inplace") is True
    return is_in_place(node.target) or _passes_inplace_true(node)


def _passes_inplace_true(node: fx.Node) -> bool:
    return node.kwargs.get("inplace") is True or _argument(node, "inplace") is True


#: Lookups that take ``max_norm``: with it they renormalise, in place, the rows of their weight (argument 1) that
#: they look up (``torch.embedding_renorm_``), though nothing in their name says they write anything.
_RENORMING_LOOKUPS = (torch.nn.functional.embedding, torch.nn.functional.embedding_bag)


def renorms_weight(node: fx.Node) -> bool:
    """True for ``F.embedding`` / ``F.embedding_bag`` with ``max_norm``: the call writes its weight (argument 1).

    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Embedding(4, 2, max_norm=1.0))
    >>> [renorms_weight(n) for n in gm.graph.nodes if n.op == "call_function"]
    [True]
    """
    return node.target in _RENORMING_LOOKUPS and _argument(node, "max_norm") is not None


def renormed_weight(node: fx.Node):
    """The weight argument a :func:`renorms_weight` call writes (a ``get_attr`` node, usually); None for any other
    call."""
    return _argument(node, "weight") if renorms_weight(node) else None


def _argument(node: fx.Node, name: str):
    """The value a ``call_function`` node passes for parameter ``name`` (positional or keyword), None if none."""
    if node.op != "call_function":
        return None
    signature = _signature(node.target)
    if signature is None:
        return None
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:  # the call does not fit the signature
        return None
    return bound.arguments.get(name)


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


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` to rewrite: new nodes (each with a shallow copy of its ``meta``), as ``copy.deepcopy``
    makes, but sharing the input and output specs of a recorded or exported graph instead of deep-copying them.

    The specs are immutable, and copying one builds ``torch.utils._pytree.LeafSpec`` objects, which say
    ``FutureWarning: isinstance(treespec, LeafSpec) is deprecated`` each time: several times per planned graph.

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    >>> copied = copy_graph(gm.graph)
    >>> [n.op for n in copied.nodes] == [n.op for n in gm.graph.nodes], next(iter(copied.nodes)) is next(iter(gm.graph.nodes))
    (True, False)
    """
    new = fx.Graph(tracer_cls=graph._tracer_cls)
    copied = new.graph_copy(graph, val_map={}, return_output_node=True)
    new._codegen = copy.copy(graph._codegen)  # its pytree_info (names and specs) is a NamedTuple: shared, never changed
    if copied is not None:
        output_value, old_output = copied
        new.output(output_value, type_expr=getattr(old_output, "type", None)).meta = copy.copy(old_output.meta)
    return new


def inherit_location(new: fx.Node, origin: fx.Node) -> None:
    """Give a node a pass inserts for ``origin`` the place ``origin`` has: its module stack, source location and
    checkpointed region (it is recomputed with ``origin``). FX does not propagate metadata."""
    for name in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if name in origin.meta:
            new.meta[name] = copy.copy(origin.meta[name])
    if CHECKPOINT_META in origin.meta:  # the region itself, not a copy: its nodes are those that name it
        new.meta[CHECKPOINT_META] = origin.meta[CHECKPOINT_META]
