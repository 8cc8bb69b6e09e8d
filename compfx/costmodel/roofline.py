"""A roofline of a GPU: what a plan's compiled training step would cost there, from FLOPs and bytes alone.

For tests and for simulating a GPU on a CPU, where the CPU's own seconds say nothing about the device (its bf16
GEMMs are slow, its FP8 is emulated). :func:`roofline_cost` is a ``SearchConfig(cost_fn=...)``: it prices each
plan as :class:`~compfx.costmodel.CompiledPredictor` prices a compiled program (the fusion rule of
:mod:`compfx.costmodel.fusion`), with every measurement replaced by the device's peaks:

* an extern op (GEMM, convolution, attention) costs, per GEMM it runs (the forward, and the backward GEMM of each
  operand that needs a gradient), the slowest of ``FLOPs / peak``, ``bytes / bandwidth`` and a kernel floor;
* a fused kernel, or a cast that fuses with nothing, costs its boundary bytes over the bandwidth plus the kernel
  floor, forward and backward (:meth:`Roofline.kernel_cost`);
* an FP8 op runs its GEMMs at the FP8 peak on one-byte operands, and also pays its scaling
  (:meth:`Roofline.fp8_scaling`, the kernels of torchao's own float8 roofline): per operand an amax reduction and
  casts (tensorwise), or a fused amax-and-cast per axis and a transposed copy (rowwise), each memory-bound. So FP8
  loses on small GEMMs, where the scaling's kernels and bytes outweigh the faster GEMM, and wins on large ones,
  where FLOPs dominate; rowwise, which moves more bytes, needs larger ones than tensorwise.

The H100 (SXM) numbers are NVIDIA's dense peaks: 989 TFLOP/s bf16/fp16, 1,979 TFLOP/s FP8, 3.35 TB/s HBM3. FP32
is priced at the non-tensor 67 TFLOP/s by default, because PyTorch runs FP32 matmuls in full FP32 unless the user
allows TF32 (``torch.backends.cuda.matmul.allow_tf32`` is off by default); ``tf32=True`` prices FP32 GEMMs at
TF32's 495 TFLOP/s instead. The kernel floor, 2 microseconds, is torchao's (a one-element Triton kernel timed on
an H100). Peaks are not reached in practice; the model only has to rank plans as the device would.

>>> import torch, compfx
>>> from compfx.costmodel import roofline_cost
>>> with torch.device("meta"):
...     model = torch.nn.Sequential(torch.nn.LayerNorm(4096), torch.nn.Linear(4096, 4096), torch.nn.GELU())
>>> a = compfx.analyze(model, torch.empty(4096, 4096, device="meta"), fp8=True, verify=False)
>>> cost = roofline_cost(a)
>>> bf16, fp8 = compfx.Plan.amp(a), compfx.Plan.amp(a).with_precisions({a.ops[1].key: "fp8"})
>>> cost(fp8, 0.0) < cost(bf16, 0.0)  # a 4096^3 linear: FP8 pays on the roofline
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.fx as fx

from ..graph_capture import meta_value
from ..errors import BadInputError
from ..opkey import KEY_META
from ..plan import Plan
from ..tensor_cores import CONV_KINDS
from ..vocabulary import Float8Recipe, Precision
from .compiled_pricing import CompiledPredictor
from .compiled_profile import KernelCost
from .fusion import runs_as_own_kernel
from .pricing import Prediction
from .profile import OpProfile, OpProfiles

__all__ = ["DevicePeaks", "H100", "DEVICES", "Roofline", "roofline_profiles", "RooflineCost", "roofline_cost"]


@dataclass(frozen=True)
class DevicePeaks:
    """A device's peaks: FLOP/s per precision, memory bandwidth (bytes/s), and the least time any kernel takes."""

    name: str
    fp32_flops: float
    tf32_flops: float
    low_flops: float
    fp8_flops: float
    bandwidth: float
    kernel_s: float = 2e-6


#: NVIDIA H100 SXM: dense Tensor Core peaks (no sparsity), HBM3 bandwidth.
H100 = DevicePeaks("h100", fp32_flops=66.9e12, tf32_flops=494.7e12, low_flops=989.4e12, fp8_flops=1978.9e12,
                   bandwidth=3.35e12)
#: The devices :func:`roofline_cost` knows by name.
DEVICES = {"h100": H100}

#: Bytes of an FP8 element, and of the high-precision operands compfx hands an FP8 op (FP32: cast_policy's rule).
_FP8_BYTES, _FP32_BYTES = 1, 4
#: GEMM kinds whose first operand is a bias-like addend (``addmm(bias, a, b)``).
_ADD_FIRST = frozenset({"addmm", "baddbmm", "addbmm", "addmv"})
_ATTENTION = frozenset({"scaled_dot_product_attention", "scaled_dot_product_flash_attention",
                        "scaled_dot_product_efficient_attention"})


class Roofline:
    """Seconds of ops on :class:`DevicePeaks` (``device``: a name of :data:`DEVICES`, or the peaks).

    >>> roofline = Roofline("h100")
    >>> seconds = roofline.linear_seconds  # m, n, k
    >>> seconds(4096, 4096, 4096, Precision.FP8) < seconds(4096, 4096, 4096, Precision.LOW)
    True
    >>> seconds(64, 64, 64, Precision.FP8) > seconds(64, 64, 64, Precision.LOW)
    True
    """

    def __init__(self, device: str | DevicePeaks = "h100", *, tf32: bool = False, low_bytes: int = 2):
        if isinstance(device, str):
            if device.lower() not in DEVICES:
                raise BadInputError(f"roofline device {device!r} is not known; expected one of {sorted(DEVICES)}, "
                                    "or a DevicePeaks.")
            device = DEVICES[device.lower()]
        self.peaks, self.tf32, self.low_bytes = device, tf32, low_bytes

    def _peak(self, precision: Precision, recipe: Float8Recipe | None = None) -> float:
        if precision is Precision.FP8:
            return self.peaks.fp8_flops
        if precision is Precision.LOW:
            return self.peaks.low_flops
        return self.peaks.tf32_flops if self.tf32 else self.peaks.fp32_flops

    def kernel(self, flops: float, nbytes: float, peak: float = math.inf) -> float:
        """One kernel: the slowest of its compute, its memory traffic and the kernel floor (torchao's roofline)."""
        return max(flops / peak, nbytes / self.peaks.bandwidth, self.peaks.kernel_s)

    def _element_bytes(self, precision: Precision) -> int:
        return self.low_bytes if precision is Precision.LOW else _FP32_BYTES

    def gemm_seconds(self, a: int, b: int, out: int, flops: float, precision: Precision, *,
                     recipe: Float8Recipe | None = None, a_grad: bool = True, b_grad: bool = True) -> float:
        """A GEMM ``out = a @ b`` (element counts ``a``, ``b``, ``out``; forward ``flops``) forward and backward:
        a GEMM for each operand's gradient, and in FP8 the operands' scaling (:meth:`fp8_scaling`)."""
        if precision is not Precision.FP8:
            gemm = self.kernel(flops, (a + b + out) * self._element_bytes(precision), self._peak(precision))
            return (1 + a_grad + b_grad) * gemm
        recipe = Float8Recipe.parse(recipe or Float8Recipe.TENSORWISE, "roofline: recipe")
        fp8_gemm = self.kernel(flops, (a + b) * _FP8_BYTES + out * _FP32_BYTES, self._peak(precision))
        if recipe is Float8Recipe.ROWWISE_WITH_GW_HP and b_grad:  # torchao keeps grad_weight's GEMM in bf16
            gemms = (1 + a_grad) * fp8_gemm + self.kernel(flops, (a + b + out) * self.low_bytes,
                                                          self._peak(Precision.LOW))
        else:
            gemms = (1 + a_grad + b_grad) * fp8_gemm
        return gemms + self.fp8_scaling(a, b, out, recipe)

    def fp8_scaling(self, a: int, b: int, out: int, recipe: Float8Recipe) -> float:
        """Seconds of scaling a GEMM's operands to FP8 for training: the input (``a`` elements), the weight
        (``b``) and the output's gradient (``out``), each read in high precision (compfx hands an FP8 op FP32
        operands) and written in FP8, one kernel at a time.

        The kernels are torchao's own float8 roofline's (``torchao/testing/training/roofline_utils.py``).
        Tensorwise: an amax reduction (reads the tensor), a tiny second reduction stage, and a cast; the input's
        and the gradient's cast writes both layouts the forward and backward GEMMs read, the weight's two casts
        one each. Rowwise: one fused amax-and-cast per axis, and a transposed high-precision copy to scale along
        the other axis. ``rowwise_with_gw_hp`` scales the input and the gradient along one axis only.
        """
        hp, f8 = _FP32_BYTES, _FP8_BYTES
        kernels: list[float] = []  # bytes each kernel reads and writes
        for numel, weight in ((a, False), (b, True), (out, False)):
            if recipe is Float8Recipe.TENSORWISE:
                kernels += [hp * numel, 0] + ([(hp + f8) * numel] * 2 if weight else [(hp + 2 * f8) * numel])
            elif recipe is Float8Recipe.ROWWISE:
                kernels += ([(hp + f8) * numel, 2 * hp * numel, (hp + f8) * numel] if weight
                            else [(2 * hp + f8) * numel, (hp + f8) * numel])
            else:  # rowwise_with_gw_hp
                kernels += [(hp + f8) * numel, 0, (hp + f8) * numel] if weight else [(hp + f8) * numel]
        return sum(self.kernel(0, nbytes) for nbytes in kernels)

    def linear_seconds(self, m: int, n: int, k: int, precision: Precision | str, *,
                       recipe: Float8Recipe | str | None = None, input_grad: bool = True) -> float:
        """A linear of ``m`` rows, ``k`` in and ``n`` out features, forward and backward (its weight trains)."""
        precision = Precision(precision)
        recipe = Float8Recipe.parse(recipe, "roofline: recipe") if recipe is not None else None
        return self.gemm_seconds(m * k, n * k, m * n, 2.0 * m * n * k, precision, recipe=recipe,
                                 a_grad=input_grad, b_grad=True)

    def op_seconds(self, kind: str, shapes: Sequence[Sequence[int]], out_numel: int, grads: Sequence[bool],
                   precision: Precision, recipe: Float8Recipe | None = None) -> float:
        """An extern op forward and backward at ``precision``, from its input ``shapes``, output size and which
        inputs need a gradient."""
        numel = [math.prod(s) for s in shapes]
        grads = list(grads) + [False] * (len(shapes) - len(grads))
        first = 1 if kind in _ADD_FIRST else 0
        if kind in CONV_KINDS and len(shapes) >= 2:
            flops = 2.0 * out_numel * math.prod(shapes[1][1:])
            return self.gemm_seconds(numel[0], numel[1], out_numel, flops, precision, recipe=recipe,
                                     a_grad=grads[0], b_grad=grads[1])
        if kind in _ATTENTION and len(shapes) >= 3:
            q, k, v = shapes[:3]
            flops = 2.0 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
            size = self._element_bytes(precision)
            traffic = (sum(numel[:3]) + out_numel) * size
            backward = self.kernel(2.5 * flops, 2 * traffic, self._peak(precision)) if any(grads[:3]) else 0.0
            return self.kernel(flops, traffic, self._peak(precision)) + backward
        if len(shapes) >= first + 2 and len(shapes[first]) >= 1:
            a, b = shapes[first], shapes[first + 1]
            n = b[0] if kind == "linear" else (b[-1] if len(b) >= 2 else 1)
            flops = 2.0 * numel[first] * n
            if kind == "addbmm":
                flops = 2.0 * numel[first] * b[-1]
            return self.gemm_seconds(numel[first], numel[first + 1], out_numel, flops, precision, recipe=recipe,
                                     a_grad=grads[first], b_grad=grads[first + 1])
        traffic = (sum(numel) + out_numel) * self._element_bytes(precision)  # no FLOP count: its bytes alone
        return self.kernel(0, traffic) * (2 if any(grads) else 1)

    def kernel_cost(self) -> KernelCost:
        """Fused kernels and lone casts on this device: their bytes over the bandwidth forward and backward, and
        the kernel floor each way (every dtype alike: a byte is a byte)."""
        per_byte, floor = 2.0 / self.peaks.bandwidth, 2.0 * self.peaks.kernel_s
        return KernelCost({dtype: (per_byte, floor) for dtype in (torch.float32, torch.bfloat16, torch.float16,
                                                                   torch.float64)}, self.peaks.name)


def roofline_profiles(analysis, device: str | DevicePeaks = "h100", *, tf32: bool = False,
                      fp8_recipes: Iterable[Float8Recipe | str] = (Float8Recipe.TENSORWISE, Float8Recipe.ROWWISE,
                                                                   Float8Recipe.ROWWISE_WITH_GW_HP)) -> OpProfiles:
    """Compiled "profiles" of ``analysis``'s extern ops on the roofline of ``device``: what
    :func:`~compfx.costmodel.profile_compiled_ops` would measure there (FP8 for FP8-eligible ops, per recipe).

    >>> import torch, compfx
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(64, 64)), torch.randn(64, 64), fp8=True)
    >>> profile = roofline_profiles(a)[a.ops[0].key]
    >>> profile.fp8_seconds("tensorwise") > profile.low_s  # 64^3: FP8's scaling costs more than it saves
    True
    """
    roofline = Roofline(device, tf32=tf32, low_bytes=torch.empty((), dtype=analysis.low_dtype).element_size())
    recipes = tuple(dict.fromkeys(Float8Recipe.parse(r, "roofline_profiles: fp8_recipes") for r in fp8_recipes))
    nodes = {n.meta[KEY_META]: n for n in analysis.graph_module.graph.nodes if KEY_META in n.meta}
    profiles = {}
    for op in analysis.ops:
        node = nodes[op.key]
        if not runs_as_own_kernel(node):
            continue
        shapes, grads = _tensor_inputs(node)
        out = sum(math.prod(s) for s in op.output_shapes)
        def at(precision, recipe=None):
            return roofline.op_seconds(op.kind, shapes, out, grads, precision, recipe)

        fp8 = tuple((r.value, at(Precision.FP8, r)) for r in recipes) if op.fp8_eligible else ()
        profiles[op.key] = OpProfile(op.key, at(Precision.FP32), at(Precision.LOW), fp8_s=fp8)
    return OpProfiles(profiles, analysis.low_dtype, torch.device(analysis.device),
                      compiled={"roofline": roofline.peaks.name, "tf32": tf32})


def _tensor_inputs(node: fx.Node) -> tuple[list[tuple[int, ...]], list[bool]]:
    """The shapes of a node's tensor arguments in order, and which of them need a gradient."""
    shapes, grads = [], []
    for arg in [*node.args, *node.kwargs.values()]:
        value = meta_value(arg) if isinstance(arg, fx.Node) else None
        if isinstance(value, torch.Tensor):
            shapes.append(tuple(value.shape))
            grads.append(bool(value.requires_grad))
    return shapes, grads


class RooflineCost:
    """A ``SearchConfig(cost_fn=...)``: the seconds one compiled training step of a plan would take on a device's
    roofline (:mod:`compfx.costmodel.roofline`); the measured seconds it is given are ignored, so a search ranks
    plans as that device would. Build it with :func:`roofline_cost`. Each plan is priced once.
    """

    def __init__(self, analysis, device: str | DevicePeaks = "h100", *, tf32: bool = False,
                 rewrite: Callable[[Plan], fx.GraphModule] | None = None):
        self.analysis = analysis
        self.roofline = Roofline(device, tf32=tf32, low_bytes=torch.empty((), dtype=analysis.low_dtype).element_size())
        self.predictor = CompiledPredictor(roofline_profiles(analysis, self.roofline.peaks, tf32=tf32),
                                           self.roofline.kernel_cost(), analysis=analysis, rewrite=rewrite)
        self._priced: dict[Plan, Prediction] = {}

    def __call__(self, plan: Plan, seconds: float) -> float:
        return self.breakdown(plan).seconds

    def breakdown(self, plan: Plan) -> Prediction:
        """Where a plan's step time goes on the roofline: extern ops, fused kernels and lone casts."""
        if plan not in self._priced:
            if isinstance(plan, Plan) and plan.fingerprint != self.analysis.fingerprint:
                raise BadInputError(f"roofline_cost was built for the analysis of fingerprint "
                                    f"{self.analysis.fingerprint}, and was asked to price a plan of "
                                    f"{plan.fingerprint}; build it from the analysis the search runs on.")
            self._priced[plan] = self.predictor.breakdown(_anywhere(plan) if isinstance(plan, Plan) else plan)
        return self._priced[plan]

    def __repr__(self) -> str:
        return f"RooflineCost(device={self.roofline.peaks.name!r}, tf32={self.roofline.tf32})"


def _anywhere(plan: Plan) -> Plan:
    """``plan``, made for no device in particular: the roofline prices a plan searched on one device (the CPU
    that trains it) for another (the GPU it simulates), from an analysis of either."""
    return Plan(dict(plan), low_dtype=plan.low_dtype, fingerprint=plan.fingerprint, fp8_recipe=plan.fp8_recipe,
                padded=plan.padded, parameter_shapes=plan.parameter_shapes)


def roofline_cost(analysis, *, device: str | DevicePeaks = "h100", tf32: bool = False,
                  rewrite: Callable[[Plan], fx.GraphModule] | None = None) -> RooflineCost:
    """A cost function for :class:`~compfx.SearchConfig` that prices each plan's compiled training step on the
    roofline of ``device`` (default the H100): see the module docstring for the model and its numbers.

    ``analysis`` is the analysis of the model the search runs on (``compfx.analyze(model, first_batch_inputs,
    fp8=True)`` for an FP8 search), whose op shapes it reads; ``rewrite(plan)`` makes a plan's graph (default:
    :func:`compfx.apply` on the analysis graph). Use it to simulate a GPU where this machine's seconds would
    mislead: tests, and searches on a CPU for a GPU.

    >>> import torch, compfx
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU()), torch.randn(1024, 1024))
    >>> config = compfx.SearchConfig(cost_fn=roofline_cost(a), progress=False)
    >>> config.cost_fn(compfx.Plan.fp32(a), 0.123) > config.cost_fn(compfx.Plan.amp(a), 0.123)  # bf16 beats FP32
    True
    """
    return RooflineCost(analysis, device, tf32=tf32, rewrite=rewrite)
