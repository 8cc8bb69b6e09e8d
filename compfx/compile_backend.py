"""compfx as a ``torch.compile`` backend: apply a precision plan to dynamo's graphs.

``torch.compile(model, backend="compfx")`` (registered through the
``torch_dynamo_backends`` entry point) or, with explicit settings,
``torch.compile(model, backend=compfx.backend(plan, inner="inductor"))``.
For every graph dynamo hands over, the backend keys its ops as
:func:`compfx.capture` does (:func:`~compfx.graph_capture.key_dynamo_graph`), picks
the plan (given, searched for this model in this process, cached, or
``Plan.amp`` of the graph), inserts the plan's casts before AOT autograd, and
hands the graph to ``inner``, under the ``torch.compile`` settings the plan
records (``plan.compile_options``: a compiled search measured it under them)
unless others are given. ``docs/compile.md`` says which plan runs when,
and how graph breaks, shape padding and Inductor's casts are handled;
:class:`GraphRecord` says what happened to each graph.

>>> import torch, compfx
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
>>> plan = compfx.Plan.fp32(compfx.analyze(model, torch.randn(2, 4)))
>>> compiled = torch.compile(model, backend=compfx.backend(plan, inner="eager"))
>>> compiled(torch.randn(2, 4)).dtype
torch.float32
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from . import cache
from .analysis import analyze_graph, fingerprint_of, parameter_shapes
from .graph_capture import (inline_checkpoint_bodies, is_numerical_op, key_dynamo_graph, named_tensors, op_nodes,
                            outline_checkpoint_regions)
from .graph_capture.dynamo import CallIndexOffsets
from .cast_policy import compute_dtype
from .compile_regions import RegionCache, compile_regions, program_records
from .compile_options import (INNER_BACKENDS, CompileOptions, given_settings, graph_settings, name_of, own_recompiles,
                              program_settings)
from .deprecations import key_backend_graph  # still importable from here, with its warning
from .errors import BadInputError, PlanMismatchError
from .float8 import fp8_fallbacks
from .opkey import KEY_META, OpKey
from .oplists import classify
from .passes import apply_precisions
from .passes.pad_shapes import PADDED_META
from .plan import Plan
from .vocabulary import Category, Precision, check_low_dtype, default_low_dtype

__all__ = ["backend", "compfx_backend", "registered_backend", "compile_with_plan", "key_backend_graph", "CompfxBackend",
           "GraphRecord", "INNER_BACKENDS", "no_graph_message"]

log = logging.getLogger("compfx")

PlanSource = Plan | str | os.PathLike | None


@dataclass(frozen=True)
class GraphRecord:
    """What the backend did to one dynamo graph.

    ``precisions`` is the plan's precision for each op of the graph
    (``"follow"`` for ops the plan does not name, which are also listed in
    ``unplanned``); ``compute_dtypes`` is the dtype of each op's first
    floating-point input in the rewritten graph, i.e. what the casts achieved.
    Which plan it was: ``origin`` (``"given"``, ``"searched"`` for the plan this
    process searched for the graph's model, ``"cache"`` for the cached plan of
    this graph's fingerprint, ``"default"`` for ``Plan.amp`` of the graph; see
    docs/compile.md), ``plan_fingerprint``, ``plan_path`` (the file it was
    read from or saved to, or None), and ``plan_source``, the same in words.
    ``fp8_fallbacks``: the plan's FP8 ops that cannot run FP8 at this graph's
    shapes (not multiples of 16, or dynamic), with why; they run at AMP's
    precision in this graph (:func:`compfx.float8.fp8_fallbacks`).
    ``compiled_with``: the settings the graph was compiled under (``inner``,
    ``mode``, ``inductor_options``, ``emulate_precision_casts``, and
    ``dynamic`` as dynamo ran it): the plan's recorded ones unless given.
    ``region``: by regions (``compile_with_plan(..., regions=...)``), the path of the block the graph ran for
    (blocks of one plan share a graph, and its ``compile_id``), ``""`` for the model's own code; None otherwise.
    """

    compile_id: str | None
    plan_source: str
    precisions: Mapping[OpKey, str]
    compute_dtypes: Mapping[OpKey, torch.dtype | None]
    unplanned: tuple[OpKey, ...]
    origin: str = ""
    plan_fingerprint: str = ""
    plan_path: str | None = None
    padded: tuple[OpKey, ...] = ()
    fp8_fallbacks: tuple[tuple[OpKey, str], ...] = ()
    region: str | None = None
    compiled_with: Mapping[str, object] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# the backend


def _frame_id(gm: fx.GraphModule) -> int | None:
    compile_id = gm.meta.get("dynamo_compile_id")
    return getattr(compile_id, "frame_id", None)


def _graph_device(example_inputs: Sequence) -> torch.device:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _load_plan(plan: PlanSource) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise BadInputError(
        f"plan is a {type(plan).__name__}; compfx.backend expected a Plan, the path of a plan file, or None "
        "(look the plan up in the plan cache)."
    )


class CompfxBackend:
    """A ``torch.compile`` backend that applies one precision plan; build it with :func:`backend`.

    ``records`` lists a :class:`GraphRecord` per graph compiled, in order.
    The compile settings given here (``inner``, ``mode``, ``inductor_options``,
    ``emulate_precision_casts``; None: not given) replace the ones the plan of
    each graph records; a plan that records others is warned about.
    ``by_regions``: it compiles a region of ``compile_with_plan(..., regions=...)`` or the code around them.
    """

    def __init__(self, plan: PlanSource = None, *, inner: str | Callable | None = None,
                 low_dtype: torch.dtype | None = None, model: nn.Module | None = None,
                 cache_dir: str | os.PathLike | None = None, emulate_precision_casts: bool | None = None,
                 inductor_options: Mapping[str, object] | None = None, mode: str | None = None,
                 by_regions: bool = False):
        self.given = given_settings(inner, mode, inductor_options, emulate_precision_casts)
        if low_dtype is not None:
            check_low_dtype(low_dtype)
        self.plan = _load_plan(plan)
        if self.plan is not None and low_dtype is not None and low_dtype != self.plan.low_dtype:
            raise BadInputError(
                f"low_dtype={low_dtype} but the plan was made for {self.plan.low_dtype}; "
                "leave low_dtype=None to use the plan's, or search again for the other dtype."
            )
        self.plan_source = "" if self.plan is None else f"given plan {self.plan.fingerprint}"
        if self.plan is not None and model is not None:
            _check_plan_of(self.plan, model)
        self.inner, self.low_dtype, self.model, self.cache_dir = self.given.get("inner"), low_dtype, model, cache_dir
        self.by_regions = by_regions
        self.records: list[GraphRecord] = []
        self._offsets = CallIndexOffsets()
        self._searched_offsets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its offsets
        self._previous_searched: cache.SearchedPlan | None = None  # the searched model of the graph compiled last
        self._logged: set[str] = set()
        self._matched = False  # has any compiled graph had an op the given plan names?

    def __repr__(self) -> str:
        inner = name_of(self.inner) if self.inner is not None else "the plan's"
        return f"CompfxBackend(plan={self.plan!r}, inner={inner!r}, graphs={len(self.records)})"

    # -- dynamo calls this once per graph -------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence):
        inline_checkpoint_bodies(gm)  # checkpointed regions' ops are keyed and planned as a capture's are
        try:
            choice = self._plan_for(gm, example_inputs, _frame_id(gm))
        except PlanMismatchError as refusal:
            return _refusing(refusal)
        keys, plan, source = choice.keys, choice.plan, choice.source
        precisions = {key: plan.get(key, Precision.FOLLOW) for key in keys}
        fallbacks = fp8_fallbacks(_fp8_ops(gm, precisions, _graph_device(example_inputs)), precisions,
                                  device=_graph_device(example_inputs))
        if fallbacks:  # a new shape (a ragged batch, dynamic sizes) that torch's scaled matmul would refuse
            precisions.update({key: precision for key, (precision, _) in fallbacks.items()})
            self._log_once(f"fp8:{sorted(map(str, fallbacks))}", "compfx backend: graph %s cannot run %d FP8 op(s) "
                           "of the plan in FP8 at its shapes; they run at AMP's precision for them in this graph (%s)",
                           gm.meta.get("dynamo_compile_id", "?"), len(fallbacks),
                           "; ".join(f"{key}: {why}" for key, (_, why) in list(fallbacks.items())[:3]),
                           level=logging.WARNING)
        unplanned = tuple(key for key in keys if key not in plan)
        self._log_once(f"source:{source}", "compfx backend: graph %s runs plan %s from %s",
                       gm.meta.get("dynamo_compile_id", "?"), plan.fingerprint, source)
        if unplanned:
            self._log_once(f"unplanned:{source}", "compfx backend: %d op(s) in a compiled graph have no entry in "
                           "the plan (%s) and run as 'follow' (e.g. %s)", len(unplanned), source,
                           ", ".join(map(str, unplanned[:3])))
        self._say_unplanned_regions(gm)
        # Every op has a precision here (unplanned ones "follow"); the passes raise PassError themselves.
        # insert_casts keeps dynamo's node attributes (_dynamo_source), which AOT autograd needs.
        gm = apply_precisions(gm, precisions, low_dtype=plan.low_dtype, fp8_recipe=plan.fp8_recipe,
                              padded=plan.padded)
        padded = tuple(gm.meta.get(PADDED_META, ()))
        settings = self._settings_for(plan)
        self.records.append(GraphRecord(
            compile_id=str(gm.meta.get("dynamo_compile_id")) if "dynamo_compile_id" in gm.meta else None,
            plan_source=source, precisions=precisions, unplanned=unplanned,
            compute_dtypes={key: compute_dtype(node, gm.get_submodule) for key, node in _keyed_nodes(gm).items()},
            origin=choice.origin, plan_fingerprint=plan.fingerprint,
            plan_path=str(choice.path) if choice.path is not None else None, padded=padded,
            fp8_fallbacks=tuple((key, why) for key, (_, why) in fallbacks.items()),
            compiled_with={**settings, "inner": name_of(settings["inner"])},
        ))
        outline_checkpoint_regions(gm)  # each region, its casts included, recomputed in backward as before
        # The plan padded these ops: Inductor must not pad them (or any other op of this graph) again.
        return self._compile_inner(gm, example_inputs, settings, {"shape_padding": False} if padded else {})

    def _settings_for(self, plan: Plan) -> dict:
        """The compile settings a graph of ``plan`` gets (:func:`~compfx.compile_options.graph_settings`); a plan
        recorded under others is warned about (once), one searched by regions and compiled whole is logged."""
        recorded = plan.compile_options
        settings, differences = graph_settings(recorded, self.given)
        if differences and f"options:{plan.fingerprint}:{differences}" not in self._logged:
            self._logged.add(f"options:{plan.fingerprint}:{differences}")
            warnings.warn(
                f"compfx: plan {plan.fingerprint} was chosen by a search that measured it compiled with "
                f"{recorded.describe()}; this graph compiles it with other settings ({'; '.join(differences)}). "
                "It runs, but its precisions were chosen by measuring the other program: compile it with the "
                "settings it records (compfx.compile_with_plan(model, plan) does, unless you pass others), or "
                "search again with SearchConfig(compile=...) set to these.", UserWarning, stacklevel=2)
        if recorded is not None and recorded.regions is not None and not self.by_regions:
            self._log_once(f"whole:{plan.fingerprint}", "compfx backend: plan %s, searched compiled by regions, "
                           "compiles whole here: the same precisions, a compile time that grows with depth "
                           "(compfx.compile_with_plan(model, plan) compiles it by regions)", plan.fingerprint)
        return settings

    def _say_unplanned_regions(self, gm: fx.GraphModule) -> None:
        """Dynamo hands higher-order ops' bodies over as subgraphs the graph calls. Checkpointed regions are
        written into the graph and planned (:func:`~compfx.graph_capture.inline_checkpoint_bodies`); the bodies of other
        higher-order ops run as the model wrote them: say so."""
        bodies = {name: sum(node.op.startswith("call") and is_numerical_op(node) for node in body.graph.nodes)
                  for name, body in gm.named_children() if isinstance(body, fx.GraphModule)}
        bodies = {name: count for name, count in bodies.items() if count}
        if bodies:
            self._log_once("regions", "compfx backend: graph %s runs %d op(s) inside %d subgraph(s) of higher-order "
                           "ops other than torch.utils.checkpoint's (%s); the backend plans a graph's own ops and its "
                           "checkpointed regions, so these run as the model wrote them (FP32 where it computes in "
                           "FP32).", gm.meta.get("dynamo_compile_id", "?"), sum(bodies.values()), len(bodies),
                           ", ".join(sorted(bodies)[:3]), level=logging.WARNING)

    def _plan_for(self, gm: fx.GraphModule, example_inputs, frame) -> "_Choice":
        device = _graph_device(example_inputs)
        if self.plan is not None:
            keys = _keyed(gm, example_inputs, self.model, self._offsets, frame)
            self._check_plan_matches(keys)
            if self.plan.device_type not in (None, device.type):
                self._log_once(f"device:given:{self.plan.fingerprint}", "the plan given to compfx.backend was made for "
                               "%s and this graph runs on %s: it runs as given, but its precisions were chosen by "
                               "measurements there; search on this device to choose here.", self.plan.device_type,
                               device.type, level=logging.WARNING)
            self._say_other_widths(gm, example_inputs)
            return _Choice(self.plan, "given", self.plan_source, keys)
        low_dtype = self.low_dtype or default_low_dtype(device)
        return (self._searched_here(gm, example_inputs, frame, device, low_dtype)
                or self._cached(gm, example_inputs, device, low_dtype)
                or self._default(gm, example_inputs, frame, device, low_dtype))

    def _say_other_widths(self, gm: fx.GraphModule, example_inputs) -> None:
        """A given plan that records the parameter shapes it was searched on, meeting a graph that reads parameters
        of other shapes (the same layers at other widths): it runs, with a warning. A graph split off at a graph
        break reads some of the model's parameters, so only shapes the plan never saw count."""
        if self.plan.parameter_shapes is None:
            return
        other = sorted(set(map(tuple, parameter_shapes(gm, example_inputs))) - set(self.plan.parameter_shapes))
        if other:
            self._log_once(f"shapes:given:{self.plan.fingerprint}", "the plan given to compfx.backend was searched on "
                           "a model whose parameters have other shapes (this graph reads %s, which it never saw): the "
                           "same layers at other widths. It runs as given, as op keys name layers, not widths, but its "
                           "precisions were measured at the other shapes; search this model to measure them here.",
                           list(other[0]), level=logging.WARNING)

    def _searched_here(self, gm, example_inputs, frame, device, low_dtype) -> "_Choice | None":
        """The plan this process searched for the graph's model: known by ``model=``, by the graph's parameters,
        or, for a graph that reads none (a loss split off at a graph break), as the model whose graph dynamo
        compiled just before, when every op of this one continues that model's plan."""
        chained = False
        if self.model is not None:
            searched = cache.searched_plan_of(self.model.parameters())
        else:
            searched = cache.searched_plan_of(t for t in example_inputs if isinstance(t, torch.Tensor))
            if searched is None and not any(isinstance(t, nn.Parameter) for t in example_inputs):
                searched, chained = self._previous_searched, True
        self._previous_searched = None
        if searched is None or searched.plan.low_dtype != low_dtype:
            return None
        plan, model = searched.plan, searched.model
        where = (f"the plan this process searched for {type(model).__name__} (searched {searched.at} by process "
                 f"{os.getpid()}, on {plan.device_type or '?'}, under torch {torch.__version__})"
                 + (f", saved to {searched.path}" if searched.path else ""))
        if not self._same_device(plan, device, where):
            return None
        offsets = self._searched_offsets.setdefault(model, CallIndexOffsets())
        keys = tuple(key_dynamo_graph(gm, offsets.for_frame(frame), example_inputs=example_inputs, model=model))
        planned = [key in plan for key in keys]
        # known by its parameters (or model=), one op of the plan's will do; known only by following one of the
        # model's graphs, every op must continue the plan
        if keys and not (all(planned) if chained else any(planned)):
            return None  # not a graph of the searched model
        offsets.count(frame, keys)
        self._previous_searched = searched
        if searched.path is not None:
            self._warn_if_replaced(plan, searched.path)
        return _Choice(plan, "searched", where, keys, searched.path)

    def _cached(self, gm, example_inputs, device, low_dtype) -> "_Choice | None":
        """The cached plan of this graph's whole-model fingerprint, when its ops are exactly the graph's and it was
        searched on this device type; a cached plan that is not used is warned about, never skipped silently."""
        whole = tuple(key_dynamo_graph(gm, example_inputs=example_inputs, model=self.model))  # call indices from 0
        if not whole:
            return None
        found = cache.find_cached(fingerprint_of(whole), low_dtype=low_dtype, cache_dir=self.cache_dir)
        if found is None:
            return None
        plan = found.plan
        if set(plan) != set(whole):
            self._log_once(f"ops:{found.path}", "compfx backend: the cached plan %s is filed under this graph's "
                           "fingerprint but names other ops (%d of its %d are not this graph's); it was edited or "
                           "written for another model, and is not used. Delete it, or search again.", found.path,
                           len(set(plan) - set(whole)), len(plan), level=logging.WARNING)
            return None
        if found.parameter_shapes is not None and found.parameter_shapes != parameter_shapes(gm, example_inputs):
            self._log_once(f"shapes:{found.path}", "compfx backend: the cached plan %s names this graph's ops but was "
                           "searched for a model whose parameters have other shapes (the same layers at other widths, "
                           "say); it is not used. Search this model, or pass its plan.", found.path,
                           level=logging.WARNING)
            return None
        if not self._same_device(plan, device, f"the cached plan {found.path}"):
            return None
        if found.replaced:
            self._log_once(f"replaced:{found.path}", "compfx backend: the cached plan %s replaced a different plan of "
                           "this model (%d op(s) differ) searched %s by process %s on %s; torch.compile cannot tell "
                           "which data each search used. Pass the plan you mean: compfx.compile_with_plan(model, "
                           "result.plan).", found.path, found.replaced.get("differing_ops", 0),
                           found.replaced.get("at", "?"), found.replaced.get("pid", "?"),
                           found.replaced.get("host", "?"), level=logging.WARNING)
        return _Choice(plan, "cache", f"the plan cache ({found.describe()})", whole, found.path)

    def _default(self, gm, example_inputs, frame, device, low_dtype) -> "_Choice":
        keys = _keyed(gm, example_inputs, self.model, self._offsets, frame)
        analysis = analyze_graph(gm, device=device, low_dtype=low_dtype)
        return _Choice(Plan.amp(analysis), "default", "default AMP-equivalent plan (no plan given or searched for "
                       "this model)", keys)

    def _same_device(self, plan: Plan, device: torch.device, where: str) -> bool:
        """Whether a searched or cached plan may run on ``device``: never one searched on another device type."""
        if plan.device_type == device.type:
            return True
        if plan.device_type is None:
            self._log_once(f"unrecorded:{where}", "compfx backend: %s does not record the device it was searched on "
                           "(an older compfx wrote it); it runs, on %s. Search again to replace it.", where,
                           device.type, level=logging.WARNING)
            return True
        self._log_once(f"device:{where}", "compfx backend: %s was searched on %s, and this graph runs on %s; it is not "
                       "used (its precisions were chosen by measurements there): the graph runs the default plan. "
                       "Search on this device (compfx.optimize), or pass the plan to compfx.backend to run it anyway.",
                       where, plan.device_type, device.type, level=logging.WARNING)
        return False

    def _warn_if_replaced(self, plan: Plan, path) -> None:
        """Warn (once) when the file this process saved its plan to now holds another search's plan."""
        if f"replaced:{path}" in self._logged:
            return
        found = cache.find_cached(plan.fingerprint, low_dtype=plan.low_dtype, cache_dir=os.path.dirname(path))
        if found is not None and found.plan != plan:
            self._log_once(f"replaced:{path}", "compfx backend: the plan cache file %s now holds another search's plan "
                           "for this model (%s); this process runs the plan it searched itself.", path,
                           found.describe(with_file=False), level=logging.WARNING)

    def _check_plan_matches(self, keys) -> None:
        """Refuse an explicit plan that names none of the ops compiled so far: it was made for another model.

        Once a graph matched, later graphs without a match are graph-break
        pieces keyed differently (a frame inside a submodule, without
        ``model=``): their ops follow (docs/compile.md, "Graph breaks").
        """
        if not keys or self._matched or any(key in self.plan for key in keys):
            self._matched = self._matched or any(key in self.plan for key in keys)
            return
        raise PlanMismatchError(
            f"the plan given to compfx.backend (fingerprint {self.plan.fingerprint}, {len(self.plan)} ops) has no "
            f"entry for any of this graph's {len(keys)} ops (e.g. {', '.join(map(str, list(keys)[:3]))}); it was "
            "made for another model. Pass this model's plan (compfx.optimize(...).plan, or Plan.load of its file), "
            "plan=None to use the plan cache, or, if the graph starts inside a submodule (a graph break), "
            "model=<the model> so the backend can name its ops as the plan does.")

    def report(self) -> str:
        """One line per compiled graph: which plan ran (origin, fingerprint, file) and its precisions.

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        >>> compiled_backend = compfx.backend(compfx.Plan.fp32(compfx.analyze(model, torch.randn(2, 4))), inner="eager")
        >>> _ = torch.compile(model, backend=compiled_backend)(torch.randn(2, 4))
        >>> print(compiled_backend.report())  # doctest: +ELLIPSIS
        graph ...: given plan ... (2 ops: 0 low, 2 fp32, 0 follow; 0 without an entry)
        """
        lines = []
        for record in self.records:
            counts = Counter(str(p) for p in record.precisions.values())
            lines.append(f"graph {record.compile_id or '?'}: {record.origin} plan {record.plan_fingerprint}"
                         + (f" from {record.plan_path}" if record.plan_path else "")
                         + f" ({len(record.precisions)} ops: {counts['low']} low, {counts['fp32']} fp32, "
                         f"{counts['follow']} follow; {len(record.unplanned)} without an entry)"
                         + (f"; {len(record.padded)} padded" if record.padded else ""))
        return "\n".join(lines) if lines else (
            "no graph compiled yet (after a call, that means dynamo ran the model eagerly: an nn.LSTM/GRU/RNN "
            "without torch._dynamo.config.allow_rnn = True, or a graph break at the start of forward)")

    def _compile_inner(self, gm: fx.GraphModule, example_inputs: Sequence, settings: Mapping[str, object],
                       patches: Mapping[str, object] = {}):
        inner = settings["inner"]
        if callable(inner):
            try:
                compiled = inner(gm, example_inputs)
            except Exception as error:  # noqa: BLE001 - the user's backend
                return _failed_inner(inner, f"raised {type(error).__name__}: {' '.join(str(error).split())[:200]}")
            if not callable(compiled):
                return _failed_inner(inner, f"returned {type(compiled).__name__}, not a callable,")
            return compiled
        if inner == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            # the mode's patches, then emulate_precision_casts, then the explicit inductor options (they win)
            inductor = {**(list_mode_options(settings["mode"]) if settings["mode"] else {}),
                        "emulate_precision_casts": settings["emulate_precision_casts"],
                        **settings["inductor_options"]}
            # config_patches (not config.patch here): compile_fx also applies them to the
            # backward graph, which AOT autograd compiles later, at the first .backward().
            return compile_fx(gm, example_inputs, config_patches={**inductor, **patches})
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)

    def _log_once(self, topic: str, message: str, *args, level: int = logging.INFO) -> None:
        if topic not in self._logged:
            self._logged.add(topic)
            log.log(level, message, *args)


@dataclass(frozen=True)
class _Choice:
    """The plan a graph runs, where it came from, and the keys its ops carry for it."""

    plan: Plan
    origin: str
    source: str
    keys: Sequence[OpKey]
    path: object = None


def _refusing(refusal: Exception) -> Callable:
    """A compiled graph that raises ``refusal`` whenever it is called: raised there, not while dynamo compiles,
    it reaches the caller as itself."""
    def refuse(*args, **kwargs):
        raise refusal.with_traceback(None)

    return refuse


def _keyed(gm: fx.GraphModule, example_inputs, model, offsets: CallIndexOffsets, frame) -> tuple[OpKey, ...]:
    """The graph's ops keyed for ``model`` (None: as dynamo names them), indices continued from ``offsets``."""
    keys = tuple(key_dynamo_graph(gm, offsets.for_frame(frame), example_inputs=example_inputs, model=model))
    offsets.count(frame, keys)
    return keys


@dataclass(frozen=True)
class _GraphOp:
    """An op of a dynamo graph as :func:`compfx.float8.fp8_fallbacks` reads it: its sizes as the graph knows them,
    symbolic where dynamo made them dynamic (the analysis's example sizes would hide that)."""

    key: OpKey
    kind: str
    input_shapes: tuple
    category: Category


def _fp8_ops(gm: fx.GraphModule, precisions: Mapping[OpKey, Precision], device: torch.device) -> list[_GraphOp]:
    ops = []
    for key, node in _keyed_nodes(gm).items():
        if precisions.get(key) is Precision.FP8:
            values = [a.meta.get("val", a.meta.get("example_value")) for a in node.all_input_nodes]
            shapes = tuple(tuple(v.shape) for v in values if isinstance(v, torch.Tensor))
            ops.append(_GraphOp(key, key.kind, shapes, classify(key.kind, device.type)))
    return ops


def _keyed_nodes(gm: fx.GraphModule) -> dict[OpKey, fx.Node]:
    return {node.meta[KEY_META]: node for node in op_nodes(gm)}


# ---------------------------------------------------------------------------
# public entry points


def backend(plan: PlanSource = None, *, inner: str | Callable | None = None, low_dtype: torch.dtype | None = None,
            model: nn.Module | None = None, cache_dir: str | os.PathLike | None = None,
            emulate_precision_casts: bool | None = None, inductor_options: Mapping[str, object] | None = None,
            mode: str | None = None) -> CompfxBackend:
    """A ``torch.compile`` backend that runs the compiled model with ``plan``'s precisions, then ``inner``.

    For every graph dynamo hands over, it keys the ops as :func:`compfx.capture`
    does, inserts the plan's casts before AOT autograd (so training works), and
    hands the graph to ``inner``; ``.records`` lists a
    :class:`GraphRecord` per graph compiled. ``docs/compile.md`` says which plan
    runs when, and how graph breaks and padding are handled. A setting left
    None is the one the plan records (``plan.compile_options``: the search
    that chose the plan measured it compiled so), else the default; a setting
    given that differs from the plan's recorded one is warned about.

    Args:
        plan: a :class:`~compfx.plan.Plan`, the path of a plan file, or None: the plan ``compfx.optimize()``
            searched for this model (in this process, else from the plan cache), else AMP's plan of each graph.
        inner: the backend that compiles the planned graphs: ``"inductor"`` (the default), ``"aot_eager"``,
            ``"eager"``, another registered backend name, or a backend callable.
        low_dtype: the precision of "low" ops when no plan is given (a plan names its own).
        model: the model being compiled, so that graphs starting inside a submodule (after a graph break) name
            their ops as the plan does.
        cache_dir: the plan cache folder (None: ``$COMPFX_CACHE_DIR``, else ``~/.cache/compfx/plans``).
        emulate_precision_casts: Inductor keeps a downcast followed by an upcast inside a fused kernel (its
            ``emulate_precision_casts``; default True), so a plan's "low" is not silently run in FP32.
        inductor_options: Inductor config patches, passed to Inductor only (``inner="inductor"``).
        mode: ``torch.compile``'s ``mode``, passed to Inductor only (as its config patches).

    Returns:
        CompfxBackend: a callable to pass as ``torch.compile(model, backend=...)``.

    Raises:
        BadInputError: an unknown ``inner``, options for another inner backend than Inductor, a ``plan`` of
            another type, or a ``low_dtype`` other than the plan's.
        PlanFileError: ``plan`` is a path to a missing or damaged plan file.
        PlanMismatchError: the plan names no op of ``model`` (or, at compile time, of the graph): it was made
            for another model.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Linear(4, 4)
        >>> plan = compfx.Plan.fp32(compfx.analyze(model, torch.randn(2, 4)))
        >>> compiled = torch.compile(model, backend=compfx.backend(plan, inner="aot_eager"))
        >>> compiled(torch.randn(2, 4)).shape
        torch.Size([2, 4])
    """
    return CompfxBackend(plan, inner=inner, low_dtype=low_dtype, model=model, cache_dir=cache_dir,
                         emulate_precision_casts=emulate_precision_casts, inductor_options=inductor_options,
                         mode=mode)


def _check_plan_of(plan: Plan, model: nn.Module) -> None:
    """Refuse, before any compile, a plan none of whose ops lies in a module of ``model``."""
    if not isinstance(model, nn.Module):
        raise BadInputError(f"model={type(model).__name__}; expected the nn.Module being compiled, or None.")
    modules = {name for name, _ in model.named_modules(remove_duplicate=False)}
    if plan and not any(key.module in modules for key in plan):
        raise PlanMismatchError(
            f"the plan (fingerprint {plan.fingerprint}) names ops in modules {sorted({k.module for k in plan})[:3]}, "
            f"none of which {type(model).__name__} has; it was made for another model. Pass this model's plan, or "
            "plan=None to use the plan cache.")


def _failed_inner(inner, problem: str) -> Callable:
    """What a graph compiles to when the inner backend failed on it: raises, when called, a
    :class:`~compfx.errors.BadInputError` saying so (dynamo would wrap an error raised while it compiles)."""
    return _refusing(BadInputError(
        f"the inner backend {name_of(inner)!r} {problem} on a graph compfx had planned; expected a torch.compile "
        "backend that takes (gm, example_inputs) and returns a callable (e.g. gm.forward). Fix it, or pass "
        "inner='inductor', 'aot_eager' or 'eager'."))


_registered: CompfxBackend | None = None


def registered_backend() -> CompfxBackend:
    """The one backend object behind ``backend="compfx"``; its ``records`` show what it did.

    >>> registered_backend() is registered_backend()
    True
    """
    global _registered
    if _registered is None:
        _registered = CompfxBackend()
    return _registered


def compfx_backend(gm: fx.GraphModule, example_inputs: Sequence):
    """The backend behind ``torch.compile(model, backend="compfx")``: cached plan or default, then Inductor.

    One shared backend object (:func:`registered_backend`) serves every model
    compiled this way; to give each model its own, and a plan, use
    :func:`backend` or :func:`compile_with_plan`.
    """
    return registered_backend()(gm, example_inputs)


def compile_with_plan(model: nn.Module, plan: PlanSource = None, *, inner: str | Callable | None = None,
                      low_dtype: torch.dtype | None = None, dynamic: bool | None = None, fullgraph: bool | None = None,
                      cache_dir: str | os.PathLike | None = None, emulate_precision_casts: bool | None = None,
                      inductor_options: Mapping[str, object] | None = None, mode: str | None = None,
                      options: CompileOptions | None = None, regions=None,
                      shared_regions: RegionCache | None = None) -> nn.Module:
    """``torch.compile(model)`` under a compfx backend made for this model: the plan's casts, then ``inner``.

    One backend per model, built with ``model=`` so that graph breaks inside
    submodules still find their plan entries. The settings default to those
    the plan records, as for :func:`backend`; with ``plan=None``, the plan
    this process searched for ``model`` decides them, else a cached plan's are
    read graph by graph (``dynamic`` and ``fullgraph`` then stay as given).
    Each call compiles a program of its own, whose recompiles count against
    ``torch._dynamo.config.recompile_limit`` alone. When the first call hands
    the backend no graph (dynamo ran the model eagerly: an ``nn.LSTM`` without
    ``torch._dynamo.config.allow_rnn``), a warning says so
    (:func:`no_graph_message`): no plan applied. ``torch.compile(model,
    backend="compfx")`` cannot tell, as dynamo never calls it.

    Args:
        model: the ``nn.Module`` to compile (not changed; the compiled module shares its Parameters).
        plan, inner, low_dtype, cache_dir, emulate_precision_casts, inductor_options, mode: as for :func:`backend`.
        dynamic, fullgraph: passed to ``torch.compile``.
        options: all the compile settings at once, a :class:`~compfx.compile_options.CompileOptions` (then give
            none of them one by one).
        regions: ``"auto"`` (the repeated blocks: the entries of an ``nn.ModuleList`` or ``nn.Sequential`` of
            blocks of one class) or block classes (or their names) compile each block as a region, one graph per
            block plan, so that compile time stays about the same as the model gets deeper (docs/compile.md,
            "Regional compilation"); False compiles the model as one graph; None: as the plan records (else False).
        shared_regions: a :class:`~compfx.compile_regions.RegionCache` shared by programs of the model compiled
            one after another: a region another compiled with the same block plan and settings is reused.

    Returns:
        nn.Module: the compiled model, ``torch.compile``'s (``.compfx_backend.records`` say what happened to each
        graph), or by regions a :class:`~compfx.compile_regions.RegionallyCompiled` (its ``.records`` do).

    Raises:
        BadInputError, PlanFileError, PlanMismatchError: as for :func:`backend`, before anything is compiled.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        >>> plan = compfx.Plan.amp(compfx.analyze(model, torch.randn(2, 4)))
        >>> compiled = compfx.compile_with_plan(model, plan, inner="aot_eager")
        >>> compiled(torch.randn(2, 4)).dtype
        torch.float32
        >>> {str(k): d for k, d in compiled.compfx_backend.records[0].compute_dtypes.items()}
        {'0:linear#0': torch.bfloat16, '1:relu#0': torch.bfloat16}
    """
    given = program_settings(options, inner=inner, mode=mode, dynamic=dynamic, fullgraph=fullgraph,
                             inductor_options=inductor_options, emulate_precision_casts=emulate_precision_casts,
                             regions=regions)
    plan = _load_plan(plan)
    planned = plan if plan is not None else _searched_plan(model)  # the plan whose recorded settings apply
    recorded = planned.compile_options if planned is not None else None
    dynamic = given.pop("dynamic", recorded.dynamic if recorded is not None else None)
    fullgraph = given.pop("fullgraph", recorded.fullgraph if recorded is not None else False)
    regions = given.pop("regions", recorded.regions if recorded is not None else None)
    compiled = None if not regions else compile_regions(
        model, planned, regions, dynamic=dynamic, fullgraph=fullgraph, shared=shared_regions,
        make_backend=functools.partial(CompfxBackend, low_dtype=low_dtype, cache_dir=cache_dir, by_regions=True,
                                       **given), settings=(low_dtype, cache_dir, given))
    if compiled is None:
        compfx = CompfxBackend(plan, low_dtype=low_dtype, model=model, cache_dir=cache_dir, **given)
        compiled = torch.compile(model, backend=compfx, dynamic=dynamic, fullgraph=fullgraph, **own_recompiles())
        # on the wrapper itself: OptimizedModule's __setattr__ would set it on the user's model (shared by programs)
        object.__setattr__(compiled, "compfx_backend", compfx)
    handle = None

    def warn_once_without_graph(module, args, output):
        # Runs after a call of the compiled wrapper (compfx's own object, not the user's model).
        handle.remove()
        if not program_records(compiled):
            warnings.warn(no_graph_message(model), UserWarning, stacklevel=2)

    handle = compiled.register_forward_hook(warn_once_without_graph)
    return compiled


def _searched_plan(model) -> Plan | None:
    """The plan this process searched for ``model`` (None: none)."""
    searched = cache.searched_plan_of(model.parameters()) if isinstance(model, nn.Module) else None
    return searched.plan if searched is not None else None


def no_graph_message(model: nn.Module) -> str:
    """Why ``torch.compile`` may hand compfx no graph for ``model``, and what to do (the backend's warning).

    >>> print(no_graph_message(torch.nn.LSTM(2, 2)))  # doctest: +ELLIPSIS
    torch.compile handed the compfx backend no graph for LSTM: ... torch._dynamo.config.allow_rnn = True ...
    """
    rnns = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    why = (f"dynamo does not trace {', '.join(rnns)} unless torch._dynamo.config.allow_rnn = True, and ran the "
           "forward eagerly" if rnns else "dynamo ran the whole forward eagerly (a graph break at its start, or "
           "nothing to compile)")
    return (f"torch.compile handed the compfx backend no graph for {type(model).__name__}: {why}; no precision "
            "plan was applied, the model ran in its own precision. Set torch._dynamo.config.allow_rnn = True before "
            "the first call (dynamo then keeps each RNN as one op), or use compfx.optimize / compfx.apply, which "
            "capture RNNs as one op themselves.")
