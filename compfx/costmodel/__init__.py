"""The cost model: which plans are worth measuring, predicted from per-op profiles and a cast-cost fit.

CoMP measures every candidate plan. On a device where the low dtype is slow
(bf16 matmul on most CPUs), each low-precision candidate costs tens of FP32
batches before exact pruning can stop it. Following Campo and QSync, compfx
profiles each op once, in isolation, at its real input shapes, and predicts a
plan's step time as

    sum of per-op forward+backward times at the dtype each op computes in
  + the casts the plan's rewritten graph contains (alpha*numel + beta,
    forward cast plus the reverse cast of the gradient)
  + a fixed per-step overhead calibrated on the measured FP32 step.

The prediction only decides what is worth measuring (the "should we" side, as
in Inductor's ``pad_mm``); measurement still makes the final decision.

One module per job:

* :mod:`~compfx.costmodel.profile`: :func:`profile_ops` times each op at FP32
  and at the low dtype, as the cast pass would run it (the rules are
  :mod:`compfx.cast_policy`'s), cached through :mod:`compfx.cache`;
  :func:`profile_padding` times an op unpadded and padded (Campo's input
  padding: does padding pay for this op alone?);
* :mod:`~compfx.costmodel.cast_cost`: :func:`fit_cast_cost` fits the cost of a cast;
* :mod:`~compfx.costmodel.pricing`: :class:`Predictor` prices a rewritten
  graph from its metadata (the dtypes :mod:`compfx.passes` wrote, the casts
  :func:`compfx.passes.casts_in` lists);
* :mod:`~compfx.costmodel.predictor`: :class:`SearchPredictor` calibrates it
  on the search's FP32 baseline (and the evidence of later samples) and
  predicts Stage-1 epochs.

Plans that train compiled (``compfx.compile_with_plan``) are priced as the
compiled program runs, switched on by one argument,
``SearchPredictor.build(..., compiled=<compile options>)``:

* :mod:`~compfx.costmodel.compile_spec`: :class:`CompileSpec`, the compile options, part of every cache key;
* :mod:`~compfx.costmodel.fusion`: :func:`fuse`, the one fusion rule (which ops
  run as kernels of their own, which fuse, which casts fusion removes);
* :mod:`~compfx.costmodel.compiled_profile`: :func:`profile_compiled_ops` times
  each GEMM / convolution / attention compiled per precision and FP8 recipe;
  :func:`fit_kernel_cost` fits what a fused kernel costs per byte;
* :mod:`~compfx.costmodel.compiled_pricing`: :class:`CompiledPredictor` prices a
  plan from those;
* :mod:`~compfx.costmodel.roofline`: :func:`roofline_cost`, the same pricing on
  a GPU's roofline (FLOPs and bytes at its peaks): a ``cost_fn`` that simulates
  a GPU in tests and on a CPU.

All timing goes through :mod:`compfx.measure`.

>>> import torch, compfx
>>> from compfx.costmodel import Predictor
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> a = compfx.analyze(model, torch.randn(8, 16))
>>> predictor = Predictor.build(a, repeats=2, use_cache=False)
>>> predictor.predict(compfx.Plan.amp(a)) > 0
True
"""

from .cast_cost import CastCost, fit_cast_cost
from .compile_spec import CompileSpec
from .compiled_pricing import CompiledPredictor
from .compiled_profile import KernelCost, fit_kernel_cost, profile_compiled_ops
from .fusion import Fusion, FusedKernel, fuse
from .predictor import MEASURED_STEP, PREDICTED_STEP, STALE_PROFILE_RATIO, STALE_PROFILES, SearchPredictor
from .pricing import Prediction, Predictor
from .profile import OpProfile, OpProfiles, PaddingProfile, profile_ops, profile_padding
from .roofline import H100, DevicePeaks, Roofline, RooflineCost, roofline_cost, roofline_profiles

__all__ = [
    "OpProfile", "OpProfiles", "profile_ops", "PaddingProfile", "profile_padding",
    "CastCost", "fit_cast_cost",
    "Prediction", "Predictor", "SearchPredictor",
    "PREDICTED_STEP", "MEASURED_STEP", "STALE_PROFILES", "STALE_PROFILE_RATIO",
    "CompileSpec", "fuse", "Fusion", "FusedKernel", "profile_compiled_ops", "KernelCost", "fit_kernel_cost",
    "CompiledPredictor", "roofline_cost", "RooflineCost", "roofline_profiles", "Roofline", "DevicePeaks", "H100",
]
