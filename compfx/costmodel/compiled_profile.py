"""Profiles of a compiled program: extern ops timed compiled per precision, and the cost of a fused kernel.

What the compiled pricing (:mod:`compfx.costmodel.compiled_pricing`) needs of the machine, measured under
``torch.compile`` with the options the plan trains with (a :class:`~compfx.costmodel.compile_spec.CompileSpec`):

* :func:`profile_compiled_ops`: each extern op (:func:`~compfx.costmodel.fusion.runs_as_own_kernel`: GEMMs,
  convolutions, attention) forward+backward at its recorded shapes, at FP32, at the low dtype and, for an op that
  can run FP8, in FP8 per torchao recipe: the op alone under ``torch.compile``, so FP8's scaling (amax and cast of
  each operand) is fused as it is in training. Its inputs arrive in the dtype the plan gives them (the casts that
  bring them there are priced by the fusion rule, not here);
* :func:`fit_kernel_cost`: a :class:`KernelCost`, the seconds of one generated (fused) kernel forward+backward as
  ``alpha[dtype] * bytes + beta``, fitted to a compiled chain of elementwise ops at a few sizes. Elementwise ops are
  priced as the fused kernels they become, from the bytes crossing each kernel's boundary, never per op.

Both are cached through :mod:`compfx.cache` like the eager profiles (one entry per op signature, precision,
recipe, compile options, device, clock and torch version) and trusted under the same conditions rule, so a
second call times nothing.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from ..cache import entry_path, profile_folder, read_entry, write_entry
from ..errors import BadInputError
from ..float8 import DEFAULT_RECIPE, fp8_runs_natively
from ..measure import Conditions, check_clock, device_name, environment_key, measure_conditions, time_fastest
from ..opkey import KEY_META, OpKey
from ..vocabulary import Float8Recipe, check_low_dtype, dtype_name
from .cast_cost import _fit_line, _usable_fit
from .compile_spec import CompileSpec
from .fusion import runs_as_own_kernel
from .profile import OpProfile, OpProfiles, _EntryCache, _op_entry_key, _OpBench

__all__ = ["profile_compiled_ops", "KernelCost", "fit_kernel_cost", "KERNEL_COST_FORMAT", "DEFAULT_KERNEL_SIZES"]

#: ``format`` of a fused-kernel cost cache entry.
KERNEL_COST_FORMAT = "compfx-kernel-cost"
#: Version written into every entry and part of its key.
CACHE_VERSION = 1
#: Tensor sizes (elements) the fused-kernel fit times at.
DEFAULT_KERNEL_SIZES = (1 << 8, 1 << 12, 1 << 16, 1 << 20)


def profile_compiled_ops(
    analysis,
    compiled,
    *,
    low_dtype: torch.dtype | None = None,
    fp8_recipes: Iterable[Float8Recipe | str] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    block_s: float = 5e-4,
    budget_s: float = 5e-3,
    clock: str = "wall",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    refresh: bool = False,
    keys: Iterable[OpKey] | None = None,
    conditions: Conditions | None = None,
) -> OpProfiles:
    """Time every extern op of ``analysis`` compiled (``compiled``: anything :meth:`CompileSpec.of` takes).

    Each op runs alone under ``torch.compile`` (compiled, and its backward, in an untimed first call) on real
    tensors made from its recorded metadata, at FP32 and at the low dtype as the cast pass runs it
    (:mod:`compfx.cast_policy`), and, where the analysis found it FP8-eligible, through the float8 pass's
    :class:`~compfx.passes.Float8Matmul` per recipe of ``fp8_recipes`` (default: the default recipe when any op
    is eligible); emulated where the device has no float8 GEMMs. Ops that are not extern are fused into the
    kernels of their neighbours and have no profile here. The other arguments are
    :func:`~compfx.costmodel.profile_ops`'.

    >>> import torch, compfx
    >>> from compfx.costmodel import profile_compiled_ops
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(4, 8))
    >>> p = profile_compiled_ops(a, "aot_eager", repeats=1, use_cache=False)
    >>> sorted(str(k) for k in p), p.measured, p.compiled["inner"]
    (['0:linear#0'], 2, 'aot_eager')
    """
    spec = CompileSpec.of(compiled)
    if spec is None:
        raise BadInputError("profile_compiled_ops(compiled=None); pass the compile options the plan trains with "
                            "(e.g. 'inductor'), or use profile_ops for eager profiles.")
    if repeats < 1 or warmup < 0:
        raise BadInputError(f"profile_compiled_ops(repeats={repeats}, warmup={warmup}); expected repeats >= 1 and "
                            "warmup >= 0.")
    low_dtype = check_low_dtype(low_dtype or analysis.low_dtype, "profile_compiled_ops: low_dtype")
    device = torch.device(analysis.device)
    check_clock(clock, device=device)
    recipes = _recipes(analysis, fp8_recipes)
    timing = dict(repeats=repeats, warmup=warmup, block_s=block_s, budget_s=budget_s, clock=clock)
    start = time.perf_counter()
    if use_cache and conditions is None:
        conditions = measure_conditions(device=device, clock=clock)
    cache = _EntryCache(profile_folder(cache_dir) if use_cache else None, refresh, conditions)
    wanted = set(keys) if keys is not None else None
    nodes = {n.meta[KEY_META]: n for n in analysis.graph_module.graph.nodes if KEY_META in n.meta}
    profiles = {}
    for op in analysis.ops:
        node = nodes[op.key]
        if (wanted is None or op.key in wanted) and runs_as_own_kernel(node):
            fp8 = recipes if op.fp8_eligible else ()
            profiles[op.key] = _profile_compiled(analysis.graph_module, node, device, low_dtype, spec, fp8, cache,
                                                 timing)
    return OpProfiles(profiles, low_dtype, device, cache.measured, cache.reused, time.perf_counter() - start,
                      cache.stale, conditions, cache.stale_reason, compiled=spec.key())


def _recipes(analysis, fp8_recipes) -> tuple[Float8Recipe, ...]:
    if fp8_recipes is None:
        return (DEFAULT_RECIPE,) if any(op.fp8_eligible for op in analysis.ops) else ()
    return tuple(dict.fromkeys(Float8Recipe.parse(r, "profile_compiled_ops: fp8_recipes") for r in fp8_recipes))


def _profile_compiled(gm, node, device, low_dtype, spec: CompileSpec, recipes, cache: _EntryCache,
                      timing: Mapping) -> OpProfile:
    key: OpKey = node.meta[KEY_META]
    try:
        bench = _OpBench(gm, node, device)
        signature, casts = bench.signature(), bench.cast_positions()
    except Exception as error:  # noqa: BLE001 - an op we cannot describe is simply not predicted
        return OpProfile(key, 0.0, 0.0, f"could not build inputs: {type(error).__name__}: {error}")
    compiled = {"compile": spec.key()}
    seconds, reasons = {}, []
    for dtype in (torch.float32, low_dtype):
        entry_key = {**_op_entry_key(signature, dtype, casts if dtype != torch.float32 else (), device,
                                     timing["clock"]), **compiled}
        call = bench.op_callable(dtype)
        seconds[dtype], reason = cache.seconds(entry_key, lambda d=dtype, c=call: _measure(bench, d, c, spec, timing))
        if reason:
            reasons.append(f"{dtype_name(dtype)}: {reason}")
    if reasons:  # half a profile would mislead the predictor; treat the op as unknown
        return OpProfile(key, 0.0, 0.0, "; ".join(reasons))
    fp8 = []
    emulated = not fp8_runs_natively(device)
    for recipe in recipes:  # FP8 ops take FP32 operands (the cast pass's rule) and scale them themselves
        entry_key = {**_op_entry_key(signature, torch.float32, (), device, timing["clock"]), **compiled,
                     "fp8": recipe.value, "emulated": emulated}
        measured, reason = cache.seconds(entry_key, lambda r=recipe: _measure(
            bench, torch.float32, _float8_call(bench, r, emulated), spec, timing))
        if not reason:  # an FP8 profile that failed is missing: plans running the op in FP8 are then measured
            fp8.append((recipe.value, measured))
    return OpProfile(key, seconds[torch.float32], seconds[low_dtype], fp8_s=tuple(fp8))


def _float8_call(bench: _OpBench, recipe: Float8Recipe, emulated: bool):
    """The op as the float8 pass rewrites it: its operands through a :class:`~compfx.passes.Float8Matmul`."""
    from ..passes.float8 import Float8Matmul, matmul_operands  # torchao is imported only when FP8 is profiled

    matmul = Float8Matmul(recipe, transpose_weight=bench.kind == "linear", emulate=emulated)
    operands = lambda *args, **kwargs: matmul_operands(bench.kind, args, kwargs)  # noqa: E731
    return lambda *args, **kwargs: matmul(*[t for t in operands(*args, **kwargs) if t is not None])


def _measure(bench: _OpBench, dtype: torch.dtype, call, spec: CompileSpec, timing: Mapping) -> float:
    with spec.compiled(call) as compiled:
        step = bench.make_step(dtype, clone_first=bench.writes_a_leaf(), call=compiled)
        step()  # compiles the forward, and the backward at its first use: never inside a timing
        return time_fastest(step, device=bench.device, **timing)


# -- a fused kernel ----------------------------------------------------------------------

@dataclass(frozen=True)
class KernelCost:
    """Seconds of one generated (fused) kernel forward+backward, from the bytes it reads and writes at its
    boundary: ``sum(alpha[dtype] * bytes[dtype]) + max(beta[dtype])`` over the dtypes it touches. A dtype
    without a fit (integer indices, masks) is priced at FP32's.

    >>> cost = KernelCost({torch.float32: (1e-10, 2e-6), torch.bfloat16: (2e-10, 3e-6)})
    >>> round(cost.seconds({torch.float32: 1000, torch.bfloat16: 1000}), 10)
    3.3e-06
    """

    coefficients: Mapping[torch.dtype, tuple[float, float]]
    device: str = ""

    def seconds(self, bytes_by_dtype: Mapping[torch.dtype, int]) -> float:
        if not bytes_by_dtype:
            return 0.0
        fallback = self.coefficients.get(torch.float32) or next(iter(self.coefficients.values()))
        fits = [(self.coefficients.get(dtype, fallback), size) for dtype, size in bytes_by_dtype.items()]
        return sum(alpha * size for (alpha, _), size in fits) + max(beta for (_, beta), _ in fits)

    def non_negative(self) -> bool:
        return all(alpha >= 0 and beta >= 0 for alpha, beta in self.coefficients.values())


def fit_kernel_cost(
    compiled,
    *,
    device: torch.device | str = "cpu",
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    sizes: Sequence[int] = DEFAULT_KERNEL_SIZES,
    repeats: int = 3,
    clock: str = "wall",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    refresh: bool = False,
    conditions: Conditions | None = None,
) -> KernelCost:
    """Fit :class:`KernelCost` per dtype on a compiled elementwise chain (``sigmoid(1.5 x) * x + 1``, one kernel
    forward and one backward), timed at ``sizes`` under ``compiled``'s options with dynamic shapes (one compile
    per dtype). The fit and its caching are :func:`~compfx.costmodel.fit_cast_cost`'s (least squares on relative
    error, clamped at 0; a fit measured under other conditions is fitted again).

    >>> import torch
    >>> cost = fit_kernel_cost("aot_eager", dtypes=(torch.float32,), sizes=(256, 4096), repeats=1, use_cache=False)
    >>> cost.seconds({torch.float32: 4096 * 8}) > 0
    True
    """
    spec = CompileSpec.of(compiled)
    if spec is None:
        raise BadInputError("fit_kernel_cost(compiled=None); pass the compile options the plan trains with.")
    if len(set(sizes)) < 2:
        raise BadInputError(f"fit_kernel_cost(sizes={tuple(sizes)}); fitting alpha*bytes + beta needs at least two "
                            "distinct sizes.")
    device = torch.device(device)
    check_clock(clock, device=device)
    folder = profile_folder(cache_dir) if use_cache else None
    if folder is not None and conditions is None:
        conditions = measure_conditions(device=device, clock=clock)
    sizes = sorted(set(sizes))
    coefficients = {}
    for dtype in dict.fromkeys(dtypes):
        key = {"kernel": "elementwise chain", "dtype": dtype_name(dtype), "sizes": sizes, "compile": spec.key(),
               **environment_key(device=device, clock=clock), "version": CACHE_VERSION}
        path = entry_path(folder, key) if folder is not None else None
        cached = read_entry(path, key, KERNEL_COST_FORMAT) if path is not None and not refresh else None
        fit = _usable_fit(path, cached, conditions) if cached is not None else None
        if fit is None:
            times = _time_chain(spec, dtype, sizes, device, repeats, clock)
            boundary = [2 * n * torch.empty((), dtype=dtype).element_size() for n in sizes]  # x read, y written
            fit = _fit_line(boundary, times)
            if path is not None:
                write_entry(path, key, KERNEL_COST_FORMAT, CACHE_VERSION,
                            {"alpha": fit[0], "beta": fit[1], "times": times,
                             "conditions": conditions.to_dict() if conditions is not None else None})
        coefficients[dtype] = fit
    return KernelCost(coefficients, device_name(device))


def _chain(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 1.5) * x + 1.0


def _time_chain(spec: CompileSpec, dtype: torch.dtype, sizes: Sequence[int], device: torch.device, repeats: int,
                clock: str) -> list[float]:
    times = []
    with spec.compiled(_chain, dynamic=True) as chain:
        for numel in sizes:
            x = torch.randn(numel, device=device).to(dtype).requires_grad_()
            grad = torch.ones_like(x)

            def step(x=x, grad=grad):
                torch.autograd.grad(chain(x), x, grad)

            step()  # compiles (once: dynamic shapes) outside the timing
            times.append(time_fastest(step, device=device, repeats=repeats, warmup=1, block_s=5e-4, budget_s=5e-3,
                                      clock=clock))
    if not all(math.isfinite(t) and t > 0 for t in times):
        raise BadInputError(f"fit_kernel_cost: the compiled chain timed {times}; expected positive seconds.")
    return times
