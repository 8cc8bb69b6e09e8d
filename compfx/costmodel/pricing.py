"""Pricing a plan: its step time from op profiles, the cast-cost fit and the plan's rewritten graph.

:class:`Predictor` reads a rewritten graph as the passes left it:

* the dtype every op computes in is :func:`compfx.cast_policy.compute_dtype`
  of its ``node.meta["val"]`` inputs, and an op is priced at its low profile
  when that is the plan's low dtype, at FP32 otherwise;
* its casts are :func:`compfx.passes.casts_in` (the list the cast report
  counts), each priced forward, and backward too when its input needs a gradient.

It does no dtype propagation of its own: graphs made by :func:`compfx.apply`
or :func:`compfx.passes.apply_precisions` carry fresh metadata; any other
graph is the caller's to run through :func:`compfx.passes.propagate_dtypes` first.
How the search calibrates these prices on its measurements is
:mod:`compfx.costmodel.predictor`'s.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..planned_module import planned_graph
from ..graph_capture import meta_value
from ..cast_policy import compute_dtype
from ..errors import BadInputError, SearchError
from ..opkey import KEY_META, OpKey
from ..passes import CastInfo, casts_in
from ..plan import Assignment, Plan
from .cast_cost import DEFAULT_CAST_SIZES, CastCost, fit_cast_cost
from .profile import OpProfiles, profile_ops

__all__ = ["Prediction", "Predictor", "cast_sizes"]


@dataclass(frozen=True)
class Prediction:
    """A predicted step time and where it comes from: ops' compute, casts and the calibrated overhead.

    ``casts`` are the casts priced (``cast_s``). Priced compiled
    (:mod:`compfx.costmodel.compiled_pricing`), ``compute_s`` holds the extern
    ops and ``fused_s``, the ``kernels`` fused kernels; ``fused_casts`` are the
    casts fusion removed (priced at nothing), and ``fp8_ops`` the ops priced in FP8.
    """

    seconds: float
    compute_s: float
    cast_s: float
    overhead_s: float
    low_ops: tuple[OpKey, ...] = ()
    casts: tuple[CastInfo, ...] = field(default=(), repr=False)
    fused_s: float = 0.0
    kernels: int = 0
    fp8_ops: tuple[OpKey, ...] = ()
    fused_casts: tuple[CastInfo, ...] = field(default=(), repr=False)

    @property
    def n_casts(self) -> int:
        return len(self.casts)


class Predictor:
    """Predicts the seconds of one training step of a plan from profiles and the plan's rewritten graph.

    ``predict`` takes a rewritten ``GraphModule`` (with fresh ``meta["val"]``),
    a :class:`~compfx.plan.Plan`, an :class:`~compfx.plan.Assignment` or a CoMP
    bitstring; the last three need ``analysis`` and are turned into a graph by
    ``rewrite(plan) -> GraphModule`` (default: :func:`compfx.planned_module.planned_graph` on
    ``analysis.graph_module``, which leaves it unchanged). :meth:`calibrate`
    sets ``overhead`` from one measured FP32 step, so the FP32 plan is
    predicted exactly.

    >>> import torch, compfx
    >>> from compfx.costmodel import Predictor, profile_ops, CastCost
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8))
    >>> p = Predictor(profile_ops(a, repeats=1, use_cache=False), CastCost({}), analysis=a)
    >>> p.calibrate(1.0).predict(a.graph_module)
    1.0
    """

    def __init__(self, profiles: OpProfiles, cast_cost: CastCost, overhead: float = 0.0, *,
                 analysis=None, rewrite: Callable[[Plan], fx.GraphModule] | None = None):
        self.profiles = profiles
        self.cast_cost = cast_cost
        self.overhead = float(overhead)
        self.analysis = analysis
        self._fp32_compute: float | None = None  # see fp32_compute_seconds
        if rewrite is None and analysis is not None:
            rewrite = functools.partial(_applied, analysis)
        self.rewrite = rewrite

    @classmethod
    def build(cls, analysis, *, rewrite: Callable[[Plan], fx.GraphModule] | None = None,
              cache_dir: str | os.PathLike | None = None, use_cache: bool = True, refresh: bool = False,
              **profile_kwargs) -> "Predictor":
        """Profile ``analysis`` (through the cache; ``refresh`` measures again) and fit its device's cast costs.

        ``profile_kwargs`` go to :func:`~compfx.costmodel.profile_ops`; its
        ``clock`` times the casts too. Casts are fitted between FP32, the low
        dtype and every other floating dtype the model's graph already holds.
        """
        profiles = profile_ops(analysis, cache_dir=cache_dir, use_cache=use_cache, refresh=refresh, **profile_kwargs)
        # the conditions profile_ops measured (or was given) judge the cached cast fits too
        cast_cost = fit_cast_cost(device=analysis.device, pairs=_cast_pairs(analysis.graph_module, profiles.low_dtype),
                                  sizes=cast_sizes(analysis.graph_module),
                                  clock=profile_kwargs.get("clock", "wall"), cache_dir=cache_dir,
                                  use_cache=use_cache, refresh=refresh, conditions=profiles.conditions)
        return cls(profiles, cast_cost, analysis=analysis, rewrite=rewrite)

    def prices_non_negative(self) -> bool:
        """Is no price negative (no fitted cast cost below 0)? The search's lower bounds rely on it."""
        return all(alpha >= 0 and beta >= 0 for alpha, beta in self.cast_cost.coefficients.values())

    def calibrate(self, measured_fp32_step_seconds: float) -> "Predictor":
        """Set the per-step overhead to measured FP32 step minus predicted FP32 compute; returns self.

        The overhead holds what profiles do not see: loss, optimizer step, data
        movement, Python dispatch. It can be negative when isolated ops run slower
        than in the model.
        """
        if not (measured_fp32_step_seconds > 0 and math.isfinite(measured_fp32_step_seconds)):
            raise BadInputError(f"Predictor.calibrate({measured_fp32_step_seconds!r}); expected the positive seconds "
                                "of one measured FP32 training step.")
        self.overhead = measured_fp32_step_seconds - self.fp32_compute_seconds()
        return self

    def fp32_compute_seconds(self) -> float:
        """The profiles' FP32 step: every op at FP32, no casts, no overhead (priced once: profiles are fixed)."""
        if self._fp32_compute is None:
            if self.analysis is None:
                raise SearchError("pricing the FP32 step (calibrate) needs the FP32 graph; build the Predictor "
                                  "with analysis=...")
            self._fp32_compute = self._breakdown_graph(self.analysis.graph_module, overhead=0.0).seconds
        return self._fp32_compute

    def predict(self, plan_or_graph) -> float:
        """Predicted seconds of one training step (forward, backward, optimizer)."""
        return self.breakdown(plan_or_graph).seconds

    def breakdown(self, plan_or_graph) -> Prediction:
        """The prediction split into compute, casts and overhead."""
        return self._breakdown_graph(self._graph_of(plan_or_graph), self.overhead)

    def _graph_of(self, plan_or_graph) -> fx.GraphModule:
        if isinstance(plan_or_graph, fx.GraphModule):
            return plan_or_graph
        if self.rewrite is None or self.analysis is None:
            raise SearchError("Predictor.predict() got a plan but has no analysis or rewrite function; build it with "
                              "analysis=... and rewrite=<plan -> rewritten GraphModule>, or pass the rewritten graph.")
        return self.rewrite(_as_plan(self.analysis, plan_or_graph))

    def _breakdown_graph(self, gm: fx.GraphModule, overhead: float) -> Prediction:
        compute, low_ops = 0.0, []
        for node in gm.graph.nodes:
            key = node.meta.get(KEY_META)
            if key is None or key not in self.profiles:
                continue
            low = _computes_in(gm, node) == self.profiles.low_dtype
            compute += self.profiles[key].seconds(low)
            if low:
                low_ops.append(key)
        casts = tuple(cast for cast in casts_in(gm) if cast.src is not None)  # untyped: nothing to price
        cast_s = sum(self._cast_seconds(cast) for cast in casts)
        return Prediction(compute + cast_s + overhead, compute, cast_s, overhead, tuple(low_ops), casts)

    def _cast_seconds(self, cast: CastInfo) -> float:
        forward = self.cast_cost.seconds(cast.src, cast.dst, cast.numel)
        backward = self.cast_cost.seconds(cast.dst, cast.src, cast.numel) if cast.backward else 0.0
        return forward + backward


def _computes_in(gm: fx.GraphModule, node: fx.Node) -> torch.dtype | None:
    if meta_value(node) is None:
        raise SearchError(f"op {node.meta[KEY_META]} (node {node.name}) has no dtype metadata (meta['val']); the "
                          "cost model reads dtypes from it. Run compfx.passes.propagate_dtypes(gm) on a graph you "
                          "rewrote by hand, or predict the plan instead of the graph.")
    return compute_dtype(node, gm.get_submodule)


def _as_plan(analysis, plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Assignment):
        return Plan.from_assignment(analysis, plan)
    if isinstance(plan, str):
        return Plan.from_bitstring(analysis, plan)
    raise BadInputError(f"the cost model prices a Plan, an Assignment, a plan string or a rewritten GraphModule; "
                        f"got {type(plan).__name__}.")


def _applied(analysis, plan: Plan) -> fx.GraphModule:
    """The graph :func:`compfx.apply` runs for ``plan`` at the analysis's inputs (on a copy of the analysis graph,
    which stays unchanged)."""
    return planned_graph(analysis.graph_module, plan, analysis)


def _cast_pairs(gm: fx.GraphModule, low_dtype: torch.dtype) -> list[tuple[torch.dtype, torch.dtype]]:
    """Both directions between FP32, ``low_dtype`` and every other floating dtype the graph holds.

    A plan's graph keeps the model's own casts (``x.double()``), and the
    cast pass may cast their results; without their pairs no plan of such a
    model could be priced.
    """
    dtypes = [torch.float32, low_dtype]
    for node in gm.graph.nodes:
        for leaf in pytree.tree_leaves(meta_value(node)):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dtype not in dtypes:
                dtypes.append(leaf.dtype)
    return [(src, dst) for src in dtypes for dst in dtypes if src != dst]


def cast_sizes(gm: fx.GraphModule, sizes: Sequence[int] = DEFAULT_CAST_SIZES) -> tuple[int, ...]:
    """The sizes of ``sizes`` (ascending) to fit casts at: up to the first that holds the graph's largest floating
    tensor or parameter (at least two).

    A plan casts no tensor larger than that, and the larger sizes cost the
    most to time (a 2**20-element cast, with its random source, took 15 ms of a
    tiny model's 70 ms of profiling).

    >>> import torch, compfx
    >>> a = compfx.analyze(torch.nn.Linear(8, 8), torch.randn(4, 8))
    >>> cast_sizes(a.graph_module)
    (256, 4096)
    """
    largest = max((leaf.numel() for node in gm.graph.nodes for leaf in pytree.tree_leaves(meta_value(node))
                   if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()), default=0)
    largest = max([largest, *(p.numel() for p in gm.parameters() if p.is_floating_point())])
    sizes = sorted(set(sizes))
    covering = next((i for i, size in enumerate(sizes) if size >= largest), len(sizes) - 1)
    return tuple(sizes[:max(covering + 1, 2)])
