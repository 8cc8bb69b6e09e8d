"""Pricing a plan as its compiled program runs: extern ops per precision, fused kernels by bytes, fused casts free.

:class:`CompiledPredictor` is the :class:`~compfx.costmodel.pricing.Predictor` of a search that trains
``compfx.compile_with_plan(model, plan, ...)``. It reads the plan's rewritten graph through the fusion rule
(:func:`~compfx.costmodel.fusion.fuse`) and prices, per step:

* each extern op (GEMM, convolution, attention) at its compiled profile for the precision the graph gives it:
  FP32, the low dtype, or FP8 with the recipe of its :class:`~compfx.passes.Float8Matmul` (scaling included);
* each fused kernel by :class:`~compfx.costmodel.compiled_profile.KernelCost` of the bytes at its boundary;
* each cast that fuses with nothing (a parameter's, once per step; one between extern ops) as a kernel of its own.
  Casts fusion removes cost nothing: they are in :attr:`Prediction.fused_casts`, not :attr:`Prediction.casts`.

Calibration on the measured FP32 step, and the rule that predictions only decide what to measure, are the
eager predictor's (:mod:`compfx.costmodel.predictor`). A search switches it on with one argument:
``SearchPredictor.build(analysis, rewrite=..., compiled=<the compile options>)``.

>>> import torch, compfx
>>> from compfx.costmodel import CompiledPredictor
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> a = compfx.analyze(model, torch.randn(8, 16))
>>> predictor = CompiledPredictor.build(a, "aot_eager", repeats=1, use_cache=False)
>>> prediction = predictor.breakdown(compfx.Plan.amp(a))  # ReLU fuses; the input's, weights' and output's casts do not
>>> prediction.seconds > 0, prediction.kernels, len(prediction.casts), len(prediction.fused_casts)
(True, 1, 6, 0)
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.fx as fx

from ..errors import SearchError
from ..opkey import KEY_META
from ..passes import CastInfo
from ..passes.float8 import Float8Matmul
from ..plan import Plan
from .compile_spec import CompileSpec
from .compiled_profile import KernelCost, fit_kernel_cost, profile_compiled_ops
from .fusion import fuse
from .pricing import Prediction, Predictor, _cast_pairs, _computes_in, cast_sizes
from .profile import OpProfiles

__all__ = ["CompiledPredictor"]


class CompiledPredictor(Predictor):
    """Predicts the seconds of one compiled training step of a plan: see the module docstring.

    ``profiles`` are compiled profiles of the extern ops (:func:`~compfx.costmodel.profile_compiled_ops`, or any
    :class:`~compfx.costmodel.OpProfiles` holding them, such as :func:`~compfx.costmodel.roofline_profiles`);
    ``kernel_cost`` prices fused kernels and the casts that run alone. ``rewrite`` and ``analysis`` are
    :class:`~compfx.costmodel.Predictor`'s: ``rewrite(plan)`` must return the planned ``GraphModule`` (the
    graph the compiler is handed), not the compiled wrapper.
    """

    def __init__(self, profiles: OpProfiles, kernel_cost: KernelCost, overhead: float = 0.0, *, analysis=None,
                 rewrite: Callable[[Plan], fx.GraphModule] | None = None):
        super().__init__(profiles, None, overhead, analysis=analysis, rewrite=rewrite)
        self.kernel_cost = kernel_cost

    @classmethod
    def build(cls, analysis, compiled, *, rewrite: Callable[[Plan], fx.GraphModule] | None = None,
              cache_dir: str | os.PathLike | None = None, use_cache: bool = True, refresh: bool = False,
              **profile_kwargs) -> "CompiledPredictor":
        """Profile ``analysis``'s extern ops compiled with ``compiled`` (:meth:`CompileSpec.of`) and fit the
        fused-kernel cost under the same options, both through the cache (``refresh`` measures again).

        ``profile_kwargs`` go to :func:`~compfx.costmodel.profile_compiled_ops` (``fp8_recipes`` among them);
        its ``clock`` and ``repeats`` time the kernel fit too.
        """
        spec = CompileSpec.of(compiled)
        profiles = profile_compiled_ops(analysis, spec, cache_dir=cache_dir, use_cache=use_cache, refresh=refresh,
                                        **profile_kwargs)
        dtypes = sorted({dtype for pair in _cast_pairs(analysis.graph_module, profiles.low_dtype) for dtype in pair},
                        key=str)
        kernel_cost = fit_kernel_cost(spec, device=analysis.device, dtypes=dtypes,
                                      sizes=cast_sizes(analysis.graph_module), repeats=profile_kwargs.get("repeats", 3),
                                      clock=profile_kwargs.get("clock", "wall"), cache_dir=cache_dir,
                                      use_cache=use_cache, refresh=refresh, conditions=profiles.conditions)
        return cls(profiles, kernel_cost, analysis=analysis, rewrite=rewrite)

    def prices_non_negative(self) -> bool:
        return self.kernel_cost.non_negative()

    def _breakdown_graph(self, gm: fx.GraphModule, overhead: float) -> Prediction:
        fusion = fuse(gm)
        externs = set(fusion.extern)
        extern, low_ops, fp8_ops = 0.0, [], []
        for node in gm.graph.nodes:
            key = node.meta.get(KEY_META)
            if key is None or key not in self.profiles or key not in externs:
                continue
            profile = self.profiles[key]
            matmul = gm.get_submodule(node.target) if node.op == "call_module" else None
            if isinstance(matmul, Float8Matmul):
                seconds = profile.fp8_seconds(matmul.recipe)
                if seconds is None and not profile.skipped:
                    raise SearchError(f"op {key} runs FP8 ({matmul.recipe}) in this plan, but its compiled profile "
                                      f"has no FP8 time for that recipe (profiled: {dict(profile.fp8_s) or 'none'}); "
                                      "profile it with fp8_recipes=(...,) or measure the plan.")
                extern += seconds or 0.0
                fp8_ops.append(key)
                continue
            low = _computes_in(gm, node) == self.profiles.low_dtype
            extern += profile.seconds(low)
            if low:
                low_ops.append(key)
        fused = sum(self.kernel_cost.seconds(dict(kernel.bytes)) for kernel in fusion.kernels)
        cast_s = sum(self._cast_seconds(cast) for cast in fusion.charged_casts)
        return Prediction(extern + fused + cast_s + overhead, extern + fused, cast_s, overhead, tuple(low_ops),
                          fusion.charged_casts, fused_s=fused, kernels=len(fusion.kernels), fp8_ops=tuple(fp8_ops),
                          fused_casts=fusion.fused_casts)

    def _cast_seconds(self, cast: CastInfo) -> float:
        """A cast that fuses with nothing: one kernel (and its backward) reading ``src`` and writing ``dst``."""
        size = lambda dtype: cast.numel * torch.empty((), dtype=dtype).element_size()  # noqa: E731
        return self.kernel_cost.seconds({cast.src: size(cast.src), cast.dst: size(cast.dst)}
                                        if cast.src != cast.dst else {cast.src: 2 * size(cast.src)})

