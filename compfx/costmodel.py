"""Cost model for the search: per-op profiles, a cast-cost fit and a step-time predictor.

CoMP measures every candidate plan. On a device where the low dtype is slow
(bf16 matmul on most CPUs), each low-precision candidate costs tens of FP32
batches before exact pruning can stop it. Following Campo and QSync, compfx
profiles each op once, in isolation, at its real input shapes, and predicts a
plan's step time as

    sum of per-op forward+backward times at the dtype each op runs in
  + the casts the plan's rewritten graph actually contains (alpha*numel + beta,
    forward cast plus the reverse cast of the gradient)
  + a fixed per-step overhead calibrated on the measured FP32 step.

The prediction only decides what is worth measuring (the "should we" side, as
in Inductor's ``pad_mm``); measurement still makes the final decision.

Profiles are cached as one small JSON file per (op signature, dtype, device,
torch version, threads) under ``<cache root>/profiles/``, so a second search
on the same model measures nothing.

>>> import torch, compfx
>>> from compfx.costmodel import Predictor
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
>>> a = compfx.analyze(model, torch.randn(8, 16))
>>> predictor = Predictor.build(a, repeats=2, cache_dir=None, use_cache=False)
>>> predictor.predict(a.graph_module) > 0
True
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from .capture import get_attribute, meta_value
from .vocabulary import default_low_dtype
from .errors import BadInputError, PlanFileError, SearchError
from .files import read_json, write_json_atomic
from .measure import synchronize
from .opkey import KEY_META, OpKey, normalize_kind
from .cast_policy import COMPOSITE_KINDS, NORM_KINDS, AutocastRegion
from .passes import apply_precisions
from .plan import Plan
from .vocabulary import dtype_name
from .search import should_skip, skip_message  # noqa: F401  (re-exported: the skip rule is the search's)
from .cache import cache_folder

__all__ = [
    "OpProfile",
    "OpProfiles",
    "CastCost",
    "Prediction",
    "Predictor",
    "profile_ops",
    "fit_cast_cost",
    "profile_cache_dir",
    "device_name",
    "find_casts",
    "CLOCKS",
    "rewrite_with_insert_casts",
    "rank_by_prediction",
    "should_skip",
    "skip_message",
    "median_abs_percentage_error",
]

_OP_FORMAT = "compfx-op-profile"
_CAST_FORMAT = "compfx-cast-cost"
_CACHE_VERSION = 1

# The low profile of an op runs it the way the cast pass will: norm ops
# (NORM_KINDS) cast only their activation, weight, bias and running stats stay
# FP32; composite ops (COMPOSITE_KINDS) and leaf modules run under
# torch.autocast; every other op gets all its floating inputs cast.

# Spellings of a dtype conversion; a node is a cast only when it also changes
# the floating dtype of its input.
CAST_KINDS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double",
                        "convert_element_type", "to_copy", "_to_copy"})

_DTYPE_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "float64": torch.float64}


# ---------------------------------------------------------------------------
# cache location and device identity


def profile_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder for profile files: ``profiles/`` inside the plan cache folder (``cache_dir`` or its default).

    >>> profile_cache_dir("/tmp/c").as_posix()
    '/tmp/c/profiles'
    """
    return cache_folder(cache_dir) / "profiles"


def device_name(device: torch.device | str) -> str:
    """Name that identifies the hardware a profile was taken on.

    CPU timings depend on the thread count, so it is part of the name.

    >>> device_name("cpu").startswith("cpu:")
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{_cpu_model()}:{platform.machine()}:threads={torch.get_num_threads()}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---------------------------------------------------------------------------
# one op, in isolation


@dataclass(frozen=True)
class OpProfile:
    """Forward+backward seconds of one op at FP32 and at the low dtype.

    ``skipped`` says why the op could not be run in isolation; its times are
    then 0 and its cost ends up in the calibrated per-step overhead.
    """

    key: OpKey
    fp32_s: float
    low_s: float
    skipped: str = ""

    def seconds(self, low: bool) -> float:
        return self.low_s if low else self.fp32_s


@dataclass(frozen=True, eq=False)
class OpProfiles(Mapping[OpKey, OpProfile]):
    """Profiles of every op of one analysis, plus what taking them cost.

    ``measured`` counts (op, dtype) timings taken by this call, ``reused`` those
    read from the cache, ``seconds`` the wall time the call spent.
    """

    ops: Mapping[OpKey, OpProfile]
    low_dtype: torch.dtype
    device: torch.device
    measured: int = 0
    reused: int = 0
    seconds: float = 0.0

    def __getitem__(self, key: OpKey) -> OpProfile:
        return self.ops[key]

    def __iter__(self) -> Iterator[OpKey]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def skipped(self) -> dict[OpKey, str]:
        return {k: p.skipped for k, p in self.ops.items() if p.skipped}


class _OpBench:
    """Real tensors for one node, built from its recorded metadata, and a fwd+bwd closure."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, device: torch.device):
        self.node = node
        self.kind = node.meta[KEY_META].kind
        self.device = device
        self.module = gm.get_submodule(node.target) if node.op == "call_module" else None
        self.values = pytree.tree_map(lambda a: self._value(gm, a) if isinstance(a, fx.Node) else a,
                                      (node.args, node.kwargs))

    def _value(self, gm: fx.GraphModule, arg: fx.Node):
        if arg.op == "get_attr":  # parameters and buffers: the real thing (BN running stats may have no val)
            return get_attribute(gm, arg.target)
        return arg.meta.get("val")

    @property
    def low_under_autocast(self) -> bool:
        """Composite ops and leaf modules run their low variant under torch.autocast (as the pass does)."""
        return self.kind in COMPOSITE_KINDS or self.module is not None

    def signature(self) -> dict:
        """JSON-able description of the call: kind, target, tensor metadata and the other arguments."""
        def describe(value):
            if isinstance(value, torch.Tensor):
                return {"shape": list(value.shape), "stride": list(value.stride()),
                        "dtype": dtype_name(value.dtype), "grad": bool(value.requires_grad)}
            return repr(value)

        args, kwargs = pytree.tree_map(describe, self.values)
        target = repr(self.module) if self.module is not None else _target_name(self.node.target)
        return {"kind": self.kind, "op": self.node.op, "target": target, "args": args, "kwargs": kwargs,
                "low_mode": "autocast" if self.low_under_autocast else "cast"}

    def cast_positions(self) -> set[int]:
        """Indices (into the flattened arguments) of the floating tensors the low variant casts."""
        if self.low_under_autocast:
            return set()
        leaves = pytree.tree_leaves(self.values)
        floating = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if self.kind in NORM_KINDS:  # the activation is the first argument
            return set(floating[:1]) if floating and floating[0] == 0 else set()
        return set(floating)

    def make_step(self, dtype: torch.dtype, *, clone_first: bool = False) -> Callable[[], None]:
        """A closure running the op forward and backward at ``dtype`` (FP32 = no casts).

        ``clone_first`` feeds the op a copy of its first input made inside the
        step: an in-place op cannot write into a leaf that requires grad.
        """
        leaves, spec = pytree.tree_flatten(self.values)
        casts = self.cast_positions() if dtype != torch.float32 else set()
        real = [self._real(v, dtype if i in casts else None) if isinstance(v, torch.Tensor) else v
                for i, v in enumerate(leaves)]
        grad_inputs = [t for t in real if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.module is not None:
            grad_inputs += [p for p in self.module.parameters() if p.requires_grad]
        call = self._callable(autocast_dtype=dtype if dtype != torch.float32 and self.low_under_autocast else None)
        grads: list[torch.Tensor] = []  # ones into the outputs that carry gradients, made on the first call

        def forward():
            inputs = list(real)
            if clone_first:
                inputs[0] = inputs[0].clone()
            args, kwargs = pytree.tree_unflatten(inputs, spec)
            out = call(*args, **kwargs)
            return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]

        def step():
            outs = forward()
            if outs and grad_inputs:
                if not grads:
                    grads.extend(torch.ones_like(o) for o in outs)
                torch.autograd.grad(outs, grad_inputs, grads, allow_unused=True)

        return step

    def _real(self, value: torch.Tensor, cast_to: torch.dtype | None) -> torch.Tensor:
        requires_grad = bool(value.requires_grad) and value.is_floating_point()
        if isinstance(value, torch._subclasses.FakeTensor):
            real = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device)
            if real.is_floating_point():
                real.normal_()
            else:  # ids, indices, masks: zeros are always in range
                real.zero_()
        else:
            real = value.detach().clone().to(self.device)
        if cast_to is not None:
            real = real.to(cast_to)
        return real.requires_grad_(requires_grad)

    def _callable(self, autocast_dtype: torch.dtype | None) -> Callable:
        node = self.node
        if self.module is not None:
            function = self.module
        elif node.op == "call_function":
            function = node.target
        elif node.op == "call_method":
            function = lambda self_, *a, **k: getattr(self_, node.target)(*a, **k)  # noqa: E731
        else:
            raise SearchError(f"{node.op} nodes are not ops; only keyed call nodes are profiled")
        if autocast_dtype is None:
            return function
        region = AutocastRegion(function, self.device.type, autocast_dtype)
        return region.forward

def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    return f"{module}.{name}" if module else name


#: Clocks the profiler can time with. "cpu" (process CPU time) ignores time the
#: process spends preempted, which makes profiles on a busy machine usable; it
#: equals wall time only for one CPU thread (torch.set_num_threads(1)).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _clock(name: str, device: torch.device) -> Callable[[], float]:
    if name not in CLOCKS:
        raise BadInputError(f"clock={name!r}; expected one of {sorted(CLOCKS)}.")
    if name == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise BadInputError(f"clock='cpu' measures one CPU thread; this run has device {device} and "
                            f"{torch.get_num_threads()} threads. Use clock='wall', or torch.set_num_threads(1) on CPU.")
    return CLOCKS[name]


def _time_step(step: Callable[[], None], device: torch.device, *, repeats: int, warmup: int,
               block_s: float, budget_s: float, clock: str = "wall") -> float:
    """Seconds of one call: timed warmup calls, then up to ``repeats`` timed blocks; the fastest sample wins.

    A block repeats the call until it lasts about ``block_s``. An op slower than
    ``budget_s`` (low precision on a CPU) gets one more call after its warmup:
    at that length, one-off setup is a small share of the first call, and more
    calls would cost more than the search they save. The
    minimum is the least disturbed sample (other processes only ever add
    time); what isolated ops do not see goes into the predictor's calibrated
    overhead.
    """
    read_clock = _clock(clock, device)
    last = 0.0
    for _ in range(max(warmup, 1)):  # the first call pays one-off setup (kernel selection, allocation)
        last = _timed_calls(step, 1, read_clock, device)
    if last >= budget_s:
        return min(last, _timed_calls(step, 1, read_clock, device))
    number = max(1, int(block_s / max(last, 1e-9)))
    samples, spent = [], 0.0
    while len(samples) < repeats and (spent < budget_s or not samples):
        samples.append(_timed_calls(step, number, read_clock, device))
        spent += samples[-1] * number
    return min(samples)


def _timed_calls(step: Callable[[], None], number: int, read_clock: Callable[[], float], device) -> float:
    """Mean seconds of ``number`` calls, synchronising CUDA on both sides.

    Not ``benchmark.Timer.timeit``: it runs hidden warmup calls first, which
    triples the cost of timing an op that takes tens of milliseconds.
    """
    synchronize(device)
    start = read_clock()
    for _ in range(number):
        step()
    synchronize(device)
    return (read_clock() - start) / number


# ---------------------------------------------------------------------------
# cache files


def _entry_path(root: Path, key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return root / f"{digest}.json"


def _read_entry(path: Path, key: Mapping[str, Any], fmt: str) -> Mapping | None:
    """The cached entry for ``key``; None when missing, damaged or written for another key."""
    if not path.exists():
        return None
    try:
        data = read_json(path, "profile cache entry")
    except PlanFileError:
        return None  # a damaged entry is measured again and overwritten
    if not isinstance(data, Mapping) or data.get("format") != fmt or data.get("key") != json.loads(json.dumps(key)):
        return None
    return data


def _write_entry(path: Path, key: Mapping[str, Any], fmt: str, result: Mapping[str, Any]) -> None:
    write_json_atomic(path, {"format": fmt, "version": _CACHE_VERSION, "key": key, **result})


def _op_cache_key(signature: Mapping, dtype: torch.dtype, device: torch.device, casts: Iterable[int],
                  clock: str) -> dict:
    return {"signature": signature, "dtype": dtype_name(dtype), "cast_inputs": sorted(casts),
            **_environment_key(device, clock)}


def _environment_key(device: torch.device, clock: str) -> dict:
    """What makes a cached timing stale besides the op itself: the clock, the device, torch, the cache format."""
    return {"clock": clock, "device": device_name(device), "torch": torch.__version__, "version": _CACHE_VERSION}


# ---------------------------------------------------------------------------
# profile_ops


def profile_ops(
    analysis,
    *,
    low_dtype: torch.dtype | None = None,
    repeats: int = 3,
    warmup: int = 1,
    block_s: float = 5e-4,
    budget_s: float = 5e-3,
    clock: str = "wall",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    refresh: bool = False,
    keys: Iterable[OpKey] | None = None,
) -> OpProfiles:
    """Time every op of ``analysis`` forward+backward, in isolation, at FP32 and at the low dtype.

    Each op runs on real tensors made from its recorded input metadata
    (floating inputs random, integer inputs zero, parameters and buffers the
    model's own), with ``requires_grad`` where the model has it, and a ones
    gradient into its floating outputs. At the low dtype every floating input
    is cast, except for norm ops, which cast only the activation. Ops that
    cannot run in isolation get time 0 and a ``skipped`` reason. ``keys``
    limits profiling to some ops (default: all of ``analysis.ops``).
    ``refresh=True`` measures every op again and overwrites its cache entries. ``clock``
    is ``"wall"`` or, on one CPU thread, ``"cpu"`` (immune to other processes).

    >>> import torch, compfx
    >>> from compfx.costmodel import profile_ops
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(4, 8))
    >>> p = profile_ops(a, repeats=2, use_cache=False)
    >>> sorted(str(k) for k in p), p.measured
    (['0:linear#0', '1:relu#0'], 4)
    """
    if repeats < 1 or warmup < 0:
        raise BadInputError(f"repeats={repeats}, warmup={warmup}; expected repeats >= 1 and warmup >= 0.")
    low_dtype = low_dtype or analysis.low_dtype
    device = torch.device(analysis.device)
    _clock(clock, device)  # refuse a clock that cannot time this device before measuring anything
    root = profile_cache_dir(cache_dir) if use_cache else None
    wanted = set(keys) if keys is not None else None
    nodes = {n.meta[KEY_META]: n for n in analysis.graph_module.graph.nodes if KEY_META in n.meta}
    start = time.perf_counter()
    counts = {"measured": 0, "reused": 0}
    profiles = {}
    for op in analysis.ops:
        if wanted is not None and op.key not in wanted:
            continue
        profiles[op.key] = _profile_one(analysis.graph_module, nodes[op.key], device, low_dtype, root, counts,
                                        dict(repeats=repeats, warmup=warmup, block_s=block_s, budget_s=budget_s,
                                             clock=clock), refresh)
    return OpProfiles(profiles, low_dtype, device, counts["measured"], counts["reused"], time.perf_counter() - start)


def _profile_one(gm, node, device, low_dtype, root, counts, timing, refresh: bool = False) -> OpProfile:
    key: OpKey = node.meta[KEY_META]
    try:
        bench = _OpBench(gm, node, device)
        signature = bench.signature()
        casts = bench.cast_positions()
    except Exception as error:  # noqa: BLE001 - an op we cannot describe is simply not predicted
        return OpProfile(key, 0.0, 0.0, f"could not build inputs: {type(error).__name__}: {error}")
    seconds, reasons = {}, []
    for dtype in (torch.float32, low_dtype):
        cache_key = _op_cache_key(signature, dtype, device, casts if dtype != torch.float32 else (), timing["clock"])
        seconds[dtype], reason = _cached_or_measured(bench, dtype, cache_key, root, counts, timing, refresh)
        if reason:
            reasons.append(f"{dtype_name(dtype)}: {reason}")
    if reasons:  # half a profile would mislead the predictor; treat the op as unknown
        return OpProfile(key, 0.0, 0.0, "; ".join(reasons))
    return OpProfile(key, seconds[torch.float32], seconds[low_dtype])


def _cached_or_measured(bench: _OpBench, dtype, cache_key, root, counts, timing,
                        refresh: bool = False) -> tuple[float, str]:
    path = _entry_path(root, cache_key) if root is not None else None
    cached = _read_entry(path, cache_key, _OP_FORMAT) if path is not None and not refresh else None
    if cached is not None:
        counts["reused"] += 1
        return float(cached["seconds"]), str(cached.get("skipped") or "")
    counts["measured"] += 1
    try:
        seconds, reason = _measure(bench, dtype, timing), ""
    except Exception as error:  # noqa: BLE001 - e.g. an op without a kernel for this dtype
        seconds, reason = 0.0, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if path is not None:
        _write_entry(path, cache_key, _OP_FORMAT, {"seconds": seconds, "skipped": reason or None})
    return seconds, reason


def _measure(bench: _OpBench, dtype: torch.dtype, timing: Mapping[str, float]) -> float:
    try:
        return _time_step(bench.make_step(dtype), bench.device, **timing)
    except RuntimeError as error:
        if "in-place" not in str(error):
            raise
        # x.relu_() on a leaf that requires grad: time it on a copy made inside the step
        return _time_step(bench.make_step(dtype, clone_first=True), bench.device, **timing)


# ---------------------------------------------------------------------------
# cast cost


@dataclass(frozen=True)
class CastCost:
    """Seconds of one dtype cast as ``alpha * numel + beta``, per (src, dst) dtype pair.

    >>> cost = CastCost({(torch.float32, torch.bfloat16): (1e-9, 2e-6)})
    >>> round(cost.seconds(torch.float32, torch.bfloat16, 1000), 9)
    3e-06
    """

    coefficients: Mapping[tuple[torch.dtype, torch.dtype], tuple[float, float]]
    device: str = ""

    def seconds(self, src: torch.dtype, dst: torch.dtype, numel: int) -> float:
        if src == dst:
            return 0.0
        if (src, dst) not in self.coefficients:
            known = ", ".join(f"{dtype_name(s)}->{dtype_name(d)}" for s, d in self.coefficients)
            raise SearchError(f"no cast cost fitted for {dtype_name(src)}->{dtype_name(dst)} (fitted: {known}); "
                              "call fit_cast_cost(device, pairs=...) with this pair.")
        alpha, beta = self.coefficients[(src, dst)]
        return alpha * numel + beta

    def to_dict(self) -> dict:
        return {"device": self.device,
                "pairs": [{"src": dtype_name(s), "dst": dtype_name(d), "alpha": a, "beta": b}
                          for (s, d), (a, b) in self.coefficients.items()]}

    @classmethod
    def from_dict(cls, data: Mapping) -> "CastCost":
        return cls({(_DTYPE_BY_NAME[p["src"]], _DTYPE_BY_NAME[p["dst"]]): (float(p["alpha"]), float(p["beta"]))
                    for p in data["pairs"]}, str(data.get("device", "")))


DEFAULT_CAST_SIZES = (1 << 8, 1 << 12, 1 << 16, 1 << 20)


def fit_cast_cost(
    device: torch.device | str = "cpu",
    pairs: Sequence[tuple[torch.dtype, torch.dtype]] | None = None,
    sizes: Sequence[int] = DEFAULT_CAST_SIZES,
    *,
    repeats: int = 3,
    clock: str = "wall",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    refresh: bool = False,
) -> CastCost:
    """Fit ``alpha * numel + beta`` to measured cast times for each (src, dst) pair.

    ``pairs`` defaults to FP32 <-> the device's default low dtype (fp16 on CUDA,
    bf16 elsewhere). The fit is least squares on relative error (rows weighted
    by 1/time), because small tensors, where ``beta`` dominates, are most of the
    casts in a model. Coefficients are clamped at 0. ``refresh=True`` measures
    again and overwrites the cached fit.

    >>> cost = fit_cast_cost("cpu", sizes=(256, 4096, 65536), use_cache=False)
    >>> cost.seconds(torch.float32, torch.bfloat16, 65536) > cost.seconds(torch.float32, torch.bfloat16, 256)
    True
    """
    device = torch.device(device)
    if pairs is None:
        low = default_low_dtype(device)
        pairs = ((torch.float32, low), (low, torch.float32))
    if len(set(sizes)) < 2:
        raise BadInputError(f"sizes={tuple(sizes)}; fitting alpha*numel + beta needs at least two distinct sizes.")
    root = profile_cache_dir(cache_dir) if use_cache else None
    coefficients = {}
    for src, dst in pairs:
        key = {"cast": [dtype_name(src), dtype_name(dst)], "sizes": sorted(sizes), **_environment_key(device, clock)}
        path = _entry_path(root, key) if root is not None else None
        cached = _read_entry(path, key, _CAST_FORMAT) if path is not None and not refresh else None
        if cached is None:
            times = [_time_cast(src, dst, n, device, repeats, clock) for n in sorted(sizes)]
            alpha, beta = _fit_line(sorted(sizes), times)
            if path is not None:
                _write_entry(path, key, _CAST_FORMAT, {"alpha": alpha, "beta": beta, "times": times})
        else:
            alpha, beta = float(cached["alpha"]), float(cached["beta"])
        coefficients[(src, dst)] = (alpha, beta)
    return CastCost(coefficients, device_name(device))


def _time_cast(src: torch.dtype, dst: torch.dtype, numel: int, device: torch.device, repeats: int,
               clock: str) -> float:
    source = torch.randn(numel, device=device).to(src)
    return _time_step(lambda: source.to(dst), device, repeats=repeats, warmup=1, block_s=5e-4, budget_s=5e-3,
                      clock=clock)


def _fit_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    x = torch.tensor(sizes, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    weight = 1.0 / y.clamp_min(1e-12)
    design = torch.stack([x, torch.ones_like(x)], dim=1) * weight[:, None]
    solution = torch.linalg.lstsq(design, (y * weight)[:, None]).solution.squeeze(1)
    return max(float(solution[0]), 0.0), max(float(solution[1]), 0.0)


# ---------------------------------------------------------------------------
# reading a rewritten graph: the dtype every node runs in, and its casts


class _FakeValues(fx.Interpreter):
    """Runs a graph on FakeTensors and keeps every node's value (the graph's own meta is left alone).

    A cast pass may not refresh ``meta["val"]`` downstream of the casts it
    inserts, so the dtypes are recomputed here rather than trusted.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, node: fx.Node):
        with self.fake_mode:
            value = self._placeholder(node) if node.op == "placeholder" else super().run_node(node)
        self.values[node] = value
        return value

    @staticmethod
    def _placeholder(node: fx.Node):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device=value.device).requires_grad_(bool(value.requires_grad))
        return value


def _graph_values(gm: fx.GraphModule) -> dict[fx.Node, Any]:
    if gm.meta.get("compfx_dtypes_fresh"):  # interim, until the cost model reads meta only
        return {node: meta_value(node) for node in gm.graph.nodes}
    interpreter = _FakeValues(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        interpreter.run(*[None] * len(placeholders), enable_io_processing=False)
    except Exception as error:
        raise SearchError(
            f"the cost model could not propagate dtypes through the rewritten graph "
            f"({type(error).__name__}: {error}); check that the plan's graph runs, or predict with "
            "predictor='off'."
        ) from error
    return interpreter.values


@dataclass(frozen=True)
class CastInfo:
    """One dtype-changing node of a rewritten graph."""

    node: str
    src: torch.dtype
    dst: torch.dtype
    numel: int
    backward: bool  # its input needs a gradient, so backward casts the gradient back


def find_casts(gm: fx.GraphModule, values: Mapping[fx.Node, Any] | None = None) -> list[CastInfo]:
    """The casts a graph contains: un-keyed conversion nodes that change the floating dtype.

    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    >>> find_casts(gm)  # a traced graph without FakeTensor metadata has no casts we can see
    []
    """
    values = values if values is not None else {n: n.meta.get("val") for n in gm.graph.nodes}
    casts = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or KEY_META in node.meta:
            continue
        if normalize_kind(node.op, node.target) not in CAST_KINDS:
            continue
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        before, after = values.get(source), values.get(node)
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
            continue
        if before.is_floating_point() and after.is_floating_point() and before.dtype != after.dtype:
            casts.append(CastInfo(node.name, before.dtype, after.dtype, after.numel(), bool(before.requires_grad)))
    return casts


def _runs_low(gm: fx.GraphModule, node: fx.Node, values: Mapping[fx.Node, Any], low_dtype: torch.dtype) -> bool:
    """True when the op runs in the low dtype: under an autocast region, or fed low inputs only.

    An op that gets the low dtype on only some of the inputs its low profile
    casts runs by type promotion in FP32, so it is priced at FP32.
    """
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), AutocastRegion):
        return True
    inputs = pytree.tree_leaves(pytree.tree_map(lambda a: values.get(a) if isinstance(a, fx.Node) else a,
                                                (node.args, node.kwargs)))
    floating = [v for v in inputs if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if node.meta[KEY_META].kind in NORM_KINDS:
        floating = floating[:1]
    return bool(floating) and all(v.dtype == low_dtype for v in floating)


def rewrite_with_insert_casts(analysis, plan: Plan) -> fx.GraphModule:
    """The graph the cast pass makes of ``plan`` (on a copy of the analysis graph; nothing is trained)."""
    source = analysis.graph_module
    gm = fx.GraphModule(source, copy.deepcopy(source.graph))
    categories = {op.key: op.category for op in analysis.ops}
    gm = apply_precisions(gm, plan, low_dtype=plan.low_dtype, categories=categories)
    gm.meta["compfx_dtypes_fresh"] = True
    return gm


# ---------------------------------------------------------------------------
# the predictor


@dataclass(frozen=True)
class Prediction:
    """A predicted step time and where it comes from."""

    seconds: float
    compute_s: float
    cast_s: float
    overhead_s: float
    low_ops: tuple[OpKey, ...] = ()
    casts: tuple[CastInfo, ...] = field(default=(), repr=False)

    @property
    def n_casts(self) -> int:
        return len(self.casts)


class Predictor:
    """Predicts the seconds of one training step of a plan from profiles and the plan's rewritten graph.

    ``predict`` takes a rewritten ``GraphModule``, a :class:`~compfx.plan.Plan`
    or a CoMP bitstring; the last two need ``analysis``, and are turned into a
    graph by ``rewrite(plan) -> GraphModule`` (default: the ``insert_casts``
    pass on a copy of ``analysis.graph_module``).
    :meth:`calibrate` sets ``overhead`` from one measured FP32 step, so the FP32
    plan is predicted exactly.

    >>> import torch, compfx
    >>> from compfx.costmodel import Predictor, profile_ops, CastCost
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8))
    >>> p = Predictor(profile_ops(a, repeats=1, use_cache=False), CastCost({}), analysis=a)
    >>> p.calibrate(1.0).predict(a.graph_module)
    1.0
    """

    def __init__(self, profiles: OpProfiles, cast_cost: CastCost, overhead: float = 0.0, *,
                 analysis=None, rewrite: Callable[[Any], fx.GraphModule] | None = None):
        self.profiles = profiles
        self.cast_cost = cast_cost
        self.overhead = float(overhead)
        self.analysis = analysis
        self._fp32_compute: float | None = None  # see fp32_compute_seconds
        if rewrite is None and analysis is not None:
            rewrite = lambda plan: rewrite_with_insert_casts(analysis, plan)  # noqa: E731
        self.rewrite = rewrite

    @classmethod
    def build(cls, analysis, *, rewrite: Callable[[Any], fx.GraphModule] | None = None,
              cache_dir: str | os.PathLike | None = None, use_cache: bool = True, refresh: bool = False,
              **profile_kwargs) -> "Predictor":
        """Profile ``analysis`` (through the cache; ``refresh`` measures again) and fit its device's cast cost."""
        profiles = profile_ops(analysis, cache_dir=cache_dir, use_cache=use_cache, refresh=refresh, **profile_kwargs)
        pairs = ((torch.float32, profiles.low_dtype), (profiles.low_dtype, torch.float32))
        cast_cost = fit_cast_cost(analysis.device, pairs, clock=profile_kwargs.get("clock", "wall"),
                                  cache_dir=cache_dir, use_cache=use_cache, refresh=refresh)
        return cls(profiles, cast_cost, analysis=analysis, rewrite=rewrite)

    def calibrate(self, measured_fp32_step_seconds: float) -> "Predictor":
        """Set the per-step overhead to measured FP32 step minus predicted FP32 compute; returns self.

        The overhead holds what profiles do not see: loss, optimizer step, data
        movement, Python dispatch. It can be negative when isolated ops run slower
        than in the model.
        """
        if not (measured_fp32_step_seconds > 0 and math.isfinite(measured_fp32_step_seconds)):
            raise BadInputError(f"measured_fp32_step_seconds={measured_fp32_step_seconds}; expected a positive time.")
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
        if isinstance(plan_or_graph, str):
            plan_or_graph = Plan.from_bitstring(self.analysis, plan_or_graph)
        return self.rewrite(plan_or_graph)

    def _breakdown_graph(self, gm: fx.GraphModule, overhead: float) -> Prediction:
        values = _graph_values(gm)
        low_dtype = self.profiles.low_dtype
        compute, low_ops = 0.0, []
        for node in gm.graph.nodes:
            key = node.meta.get(KEY_META)
            if key is None or key not in self.profiles or node not in values:
                continue
            low = _runs_low(gm, node, values, low_dtype)
            compute += self.profiles[key].seconds(low)
            if low:
                low_ops.append(key)
        casts = tuple(find_casts(gm, values))
        cast_s = sum(self._cast_seconds(c) for c in casts)
        return Prediction(compute + cast_s + overhead, compute, cast_s, overhead, tuple(low_ops), casts)

    def _cast_seconds(self, cast: CastInfo) -> float:
        forward = self.cast_cost.seconds(cast.src, cast.dst, cast.numel)
        backward = self.cast_cost.seconds(cast.dst, cast.src, cast.numel) if cast.backward else 0.0
        return forward + backward


# ---------------------------------------------------------------------------
# what the search needs


def rank_by_prediction(predictor: Predictor, candidates: Iterable) -> list[tuple[Any, float]]:
    """Candidates (plans or graphs) with their predicted seconds, cheapest first (stable on ties)."""
    scored = [(candidate, predictor.predict(candidate)) for candidate in candidates]
    return sorted(scored, key=lambda pair: pair[1])


def median_abs_percentage_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median of ``|predicted - measured| / measured`` in percent.

    >>> median_abs_percentage_error([1.1, 0.9, 2.0], [1.0, 1.0, 2.0])
    10.0
    """
    if len(predicted) != len(measured) or not measured:
        raise BadInputError(f"got {len(predicted)} predictions and {len(measured)} measurements; expected equal, non-zero counts.")
    return round(statistics.median(abs(p - m) / m * 100.0 for p, m in zip(predicted, measured)), 6)
