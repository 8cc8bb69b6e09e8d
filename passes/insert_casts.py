"""Rewrite pass: give every keyed op the precision its plan asks for, by inserting casts.

Which inputs are cast, and which ops run under autocast instead, is
:mod:`compfx.cast_policy`'s to say; this pass applies it to a graph:

* ``LOW`` / ``FP32``: the op's castable inputs are cast to that dtype; on CUDA,
  FP32 passes ``dtype=torch.float32`` to softmax, sum and the other ops CUDA
  autocast runs so (:func:`~compfx.cast_policy.fp32_by_dtype_argument`).
  Composite ops and leaf modules run ``LOW`` under ``torch.autocast``
  (:class:`~compfx.cast_policy.AutocastRegion`).
* ``FOLLOW``: on an ``OTHER`` op, no casts (what autocast does for unlisted
  ops), unless its kernel rejects the mixed dtypes that reach it
  (:func:`~compfx.cast_policy.runs_as_is`); then its inputs are cast to the
  widest of them. On a whitelist/blacklist op, all castable inputs are cast
  to the widest castable input dtype.

Data movement ops (no OpKey) never get casts; their output dtype follows.
Dtypes are tracked with :class:`~compfx.passes.propagate_dtypes.DtypePropagator`
as the pass goes, so no cast is inserted where a tensor already has the needed
dtype, and every node's ``meta["val"]`` holds the value it has after the
rewrite. Who shares a cast is :func:`~compfx.cast_policy.shares_cast`'s rule:
a parameter or buffer is cast once per dtype and forward, and its uses share
that cast (autocast's weight-cast cache); any other tensor gets one cast per
use, inserted right before the op, so its uses' gradients meet in its own
dtype, as under autocast. The graph's outputs are left in the dtypes they reach; restoring the model's
output dtypes is :mod:`compfx.passes.restore_output_dtypes`'s job.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch
import torch.fx as fx

from compfx.graph_capture import get_attribute, has_side_effects
from compfx.graph_capture.nodes import copy_graph, inherit_location
from compfx.cast_policy import (CAST_META, AutocastRegion, castable_inputs, fp32_by_dtype_argument, precision_dtype,
                                runs_as_is, low_runs_under_autocast, shares_cast)
from compfx.errors import PassError
from compfx.opkey import KEY_META, OpKey
from compfx.oplists import classify
from compfx.vocabulary import Category, Precision, check_low_dtype, short_dtype_name

from .propagate_dtypes import UNKNOWN, DtypePropagator

__all__ = ["insert_casts"]

PASS_NAME = "insert_casts"


def insert_casts(
    gm: fx.GraphModule,
    precisions: Mapping[OpKey, Precision | str],
    *,
    low_dtype: torch.dtype,
    categories: Mapping[OpKey, Category | str] | None = None,
    default_precision: Precision | str | None = None,
) -> fx.GraphModule:
    """Insert the casts that run each keyed op at ``precisions[key]``; returns ``gm`` (rewritten).

    Works on graphs from :func:`compfx.capture` (parameters as ``get_attr``)
    and on dynamo graphs handed to a ``torch.compile`` backend (parameters as
    placeholders, values in ``meta["example_value"]``). ``categories`` maps
    keys to their :class:`~compfx.vocabulary.Category` (default: autocast's
    table for the graph's device). Keys missing from ``precisions`` raise,
    unless ``default_precision`` is given. The rewrite is built on a copy of
    the graph and swapped in at the end, so a failure leaves ``gm`` unchanged.

    >>> import torch, compfx
    >>> from compfx.passes import insert_casts
    >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
    >>> plan = {node.meta["compfx_key"]: "low" for node in compfx.graph_capture.op_nodes(gm)}
    >>> gm = insert_casts(gm, plan, low_dtype=torch.bfloat16)
    >>> sorted(n.name for n in gm.graph.nodes if n.meta.get("compfx_cast"))
    ['_0_bias_bf16', '_0_weight_bf16', 'input_1_bf16']
    >>> gm(torch.randn(2, 4)).dtype
    torch.bfloat16
    """
    precisions, default_precision = _checked_arguments(gm, precisions, low_dtype, default_precision)
    graph = _copy_graph(gm)
    inserter = _CastInserter(gm, graph, precisions, low_dtype, categories, default_precision)
    try:
        inserter.run()
        graph.eliminate_dead_code(is_impure_node=has_side_effects)
        graph.lint()
    except Exception as error:
        for name in inserter.regions:
            gm._modules.pop(name, None)
        if isinstance(error, PassError):
            raise
        raise PassError(f"{PASS_NAME} failed ({type(error).__name__}: {error}); the graph module was left "
                        "unchanged. Please report this with the model that triggers it.") from error
    gm.graph = graph  # recompiles
    return gm


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of ``gm.graph`` to rewrite; dynamo's plain attributes on nodes (``_dynamo_source``) come along."""
    graph = copy_graph(gm.graph)
    graph.owning_module = gm  # purity checks of call_module nodes look the module up
    for old, new in zip(gm.graph.nodes, graph.nodes):  # deepcopy keeps node order
        for name, value in vars(old).items():
            if name.startswith("_dynamo") and not hasattr(new, name):
                setattr(new, name, value)
    return graph


def _precision(value, what: str) -> Precision:
    try:
        return Precision(value)
    except ValueError:
        raise PassError(f"{PASS_NAME}: unknown precision {value!r} for {what}; expected one of "
                        f"{[p.value for p in Precision]}.") from None


def _checked_arguments(gm, precisions, low_dtype, default_precision):
    if not isinstance(gm, fx.GraphModule):
        raise PassError(f"{PASS_NAME} takes a torch.fx.GraphModule; got {type(gm).__name__}.")
    check_low_dtype(low_dtype, f"{PASS_NAME}: low_dtype", error=PassError)
    precisions = {key: _precision(p, str(key)) for key, p in precisions.items()}
    if default_precision is not None:
        default_precision = _precision(default_precision, "default_precision")
    else:
        missing = [str(n.meta[KEY_META]) for n in gm.graph.nodes
                   if KEY_META in n.meta and n.meta[KEY_META] not in precisions]
        if missing:
            raise PassError(f"{PASS_NAME}: no precision for {len(missing)} op(s) of the graph (e.g. {missing[:3]}); "
                            "pass a plan made for this model, or default_precision='follow'.")
    return precisions, default_precision


class _CastInserter:
    """One run of the pass over one graph (state: the dtype propagator and the cast cache)."""

    def __init__(self, gm, graph, precisions, low_dtype, categories, default_precision):
        self.gm, self.graph = gm, graph
        self.precisions, self.low_dtype = precisions, low_dtype
        self.default_precision = default_precision
        self.dtypes = DtypePropagator(gm, graph)
        self.casts: dict[tuple[Any, torch.dtype], fx.Node] = {}  # the shared casts (see cast_policy.shares_cast)
        self.regions: list[str] = []  # submodules added to gm (removed again if the pass fails)
        self.device_type = self.dtypes.device_type()
        if categories is None:  # autocast's table for the graph's device type
            categories = {n.meta[KEY_META]: classify(n.meta[KEY_META].kind, self.device_type)
                          for n in self.graph.nodes if KEY_META in n.meta}
        self.categories = categories

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "output":
                continue
            became_region = KEY_META in node.meta and self._rewrite_op(node)
            self.dtypes.update(node, force=became_region)

    # -- one keyed op ------------------------------------------------------------
    def _precision(self, node: fx.Node) -> Precision:
        return self.precisions.get(node.meta[KEY_META], self.default_precision)

    def _category(self, node: fx.Node) -> Category:
        return Category(self.categories.get(node.meta[KEY_META], Category.OTHER))

    def _rewrite_op(self, node: fx.Node) -> bool:
        """Give ``node`` its precision; True when it now runs under an autocast region (its value must be redone)."""
        kind = node.meta[KEY_META].kind
        precision = self._precision(node)
        if precision is Precision.LOW and low_runs_under_autocast(node):
            return self._run_under_autocast(node)
        castable = castable_inputs(node, self.dtypes.value)
        if precision is Precision.FOLLOW and self._category(node) is Category.OTHER:
            if not runs_as_is(kind, [self.dtypes.value(arg).dtype for _, arg in castable]):
                self._cast_inputs(node, castable, self._widest_input_dtype(castable))
            return False
        dtype = precision_dtype(precision, self.low_dtype)
        if precision is Precision.FP32 and fp32_by_dtype_argument(node, self.device_type) and any(
                self.dtypes.value(arg).dtype != torch.float32 for _, arg in castable):
            node.kwargs = {**node.kwargs, "dtype": torch.float32}
            return True
        self._cast_inputs(node, castable, dtype or self._widest_input_dtype(castable))
        return False

    def _widest_input_dtype(self, castable: list[tuple[Any, fx.Node]]) -> torch.dtype | None:
        dtypes = [self.dtypes.value(arg).dtype for _, arg in castable]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else None

    def _cast_inputs(self, node: fx.Node, castable: list[tuple[Any, fx.Node]], dtype: torch.dtype | None) -> None:
        """Cast the ``castable`` inputs of ``node`` to ``dtype`` (None: no casts), each use in argument order."""
        if dtype is None:
            return
        wanted = {pair for pair in castable if self.dtypes.value(pair[1]).dtype != dtype}
        if not wanted:
            return

        def cast_uses(position, value):  # every occurrence is a use: mm(x, x) casts x twice, as autocast does
            return fx.node.map_arg(value, lambda arg: self._cast(arg, dtype, node) if (position, arg) in wanted else arg)

        node.args = tuple(cast_uses(i, value) for i, value in enumerate(node.args))
        node.kwargs = {name: cast_uses(name, value) for name, value in node.kwargs.items()}

    def _run_under_autocast(self, node: fx.Node) -> bool:
        fn = self.gm.get_submodule(node.target) if node.op == "call_module" else node.target
        name = self._free_name(f"{node.meta[KEY_META].module or node.name}_autocast_{short_dtype_name(self.low_dtype)}")
        self.gm.add_submodule(name, AutocastRegion(fn, self.device_type, self.low_dtype))
        self.regions.append(name)
        node.op, node.target = "call_module", name
        return True

    def _free_name(self, wanted: str) -> str:
        base = wanted.replace(".", "_")
        name, i = base, 1
        while hasattr(self.gm, name):
            name, i = f"{base}_{i}", i + 1
        return name

    # -- casts ---------------------------------------------------------------------
    def _cast(self, source: fx.Node, dtype: torch.dtype, consumer: fx.Node) -> fx.Node:
        """A cast of ``source`` to ``dtype`` for ``consumer``: the shared one if the rule shares it, else a new one."""
        shared = shares_cast(source, self.dtypes.value(source))
        identity = self._identity(source)
        cached = self.casts.get((identity, dtype)) if shared else None
        if cached is not None:
            return cached
        with self.graph.inserting_before(consumer):
            cast = self.graph.create_node("call_method", "to", (source, dtype), {},
                                          name=f"{source.name}_{short_dtype_name(dtype)}")
        _copy_location(cast, consumer)
        value = self.dtypes.converted(self.dtypes.value(source), dtype)
        if value is UNKNOWN:  # the pass must not guess the value of its own cast
            raise PassError(f"{PASS_NAME} could not cast {source.name} to {dtype} on fake values; please report "
                            "this with the model that triggers it.")
        self.dtypes.record(cast, value, like=source)
        if shared:
            self.casts[(identity, dtype)] = cast
        return cast

    def _identity(self, node: fx.Node):
        """Shared casts are per tensor: two get_attr nodes of one parameter share one cast."""
        if node.op == "get_attr":
            return ("attr", id(get_attribute(self.gm, node.target)))
        return node


def _copy_location(cast: fx.Node, consumer: fx.Node) -> None:
    """An inserted cast sits where its consumer does (module stack, source, checkpointed region)."""
    inherit_location(cast, consumer)
    cast.meta[CAST_META] = True
