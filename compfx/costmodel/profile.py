"""Op profiles: each op's forward+backward seconds, in isolation, at FP32 and at the low dtype.

Each op runs on real tensors made from its recorded input metadata, the way
the cast pass would run it: which inputs its low variant casts, and whether it
runs under ``torch.autocast`` instead, is :mod:`compfx.cast_policy`'s to say
(:func:`~compfx.cast_policy.castable`, :func:`~compfx.cast_policy.mutated_positions`,
:func:`~compfx.cast_policy.low_runs_under_autocast`), so a profile times the op the
pass builds. Timing goes through :func:`compfx.measure.time_fastest`.

Profiles are cached through :mod:`compfx.cache`, one small JSON entry per
(op signature, dtype, cast inputs, device, clock, torch version), so a second
search on the same model measures nothing -- as long as the machine is as fast
as it was. Each entry records the :class:`~compfx.measure.Conditions` it was
measured under (a reference kernel timed with the batch, the load); a later
call times the reference kernel again, and an entry whose reference differs by
more than :data:`~compfx.measure.REFERENCE_TOLERANCE` (profiles taken on a
loaded machine, or on a quiet one and read under load) is measured again and
overwritten, as is an entry that records no conditions or is damaged.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..cache import discard_entry, entry_path, profile_folder, read_entry, write_entry
from ..graph_capture import LIMIT_META, get_attribute, writes_input
from ..graph_capture.dtype_limits import limit_value
from ..cast_policy import AutocastRegion, castable, low_runs_under_autocast, mutated_positions
from ..errors import BadInputError, SearchError
from ..measure import Conditions, check_clock, environment_key, measure_conditions, time_fastest
from ..opkey import KEY_META, OpKey
from ..vocabulary import check_low_dtype, dtype_name

__all__ = ["OpProfile", "OpProfiles", "profile_ops", "PaddingProfile", "profile_padding", "OP_PROFILE_FORMAT"]

#: ``format`` of an op-profile cache entry.
OP_PROFILE_FORMAT = "compfx-op-profile"
#: Version written into every entry and part of its key. Version 1 entries stay valid: an op whose cast inputs
#: changed with the move to compfx.cast_policy (in-place and float64 inputs) gets a new key through ``cast_inputs``.
CACHE_VERSION = 1


@dataclass(frozen=True)
class OpProfile:
    """Forward+backward seconds of one op at FP32, at the low dtype and, where profiled, in FP8 per recipe.

    ``skipped`` says why the op could not be run in isolation; its times are
    then 0 and its cost ends up in the predictor's calibrated per-step overhead.
    ``fp8_s`` holds ``(recipe, seconds)`` pairs: compiled profiles time FP8 ops
    (:mod:`compfx.costmodel.compiled_profile`), eager ones do not.

    >>> from compfx.opkey import OpKey
    >>> profile = OpProfile(OpKey.parse("0:linear#0"), fp32_s=2e-3, low_s=5e-3, fp8_s=(("tensorwise", 1e-3),))
    >>> profile.seconds(low=True), profile.fp8_seconds("tensorwise"), profile.fp8_seconds("rowwise"), profile.floor
    (0.005, 0.001, None, 0.001)
    """

    key: OpKey
    fp32_s: float
    low_s: float
    skipped: str = ""
    fp8_s: tuple[tuple[str, float], ...] = ()

    def seconds(self, low: bool) -> float:
        return self.low_s if low else self.fp32_s

    def fp8_seconds(self, recipe) -> float | None:
        """Seconds in FP8 scaled by ``recipe`` (a :class:`~compfx.vocabulary.Float8Recipe` or its name); None when
        not profiled."""
        return dict(self.fp8_s).get(str(recipe))

    @property
    def floor(self) -> float:
        """The fewest seconds at any precision profiled: what a lower bound may charge when the precision is open."""
        return min([self.fp32_s, self.low_s, *(seconds for _, seconds in self.fp8_s)])


@dataclass(frozen=True, eq=False)
class OpProfiles(Mapping[OpKey, OpProfile]):
    """Profiles of the ops of one analysis, plus what taking them cost.

    ``measured`` counts (op, dtype) timings taken by this call, ``reused`` those
    read from the cache, ``stale`` those measured again because their cache
    entry was taken under other conditions (or records none), ``seconds`` the
    wall time the call spent; ``conditions`` are the conditions now (None
    without a cache), ``stale_reason`` why the first stale entry was not trusted;
    ``compiled`` what the ops ran compiled with (None: eagerly).
    """

    ops: Mapping[OpKey, OpProfile]
    low_dtype: torch.dtype
    device: torch.device
    measured: int = 0
    reused: int = 0
    seconds: float = 0.0
    stale: int = 0
    conditions: Conditions | None = None
    stale_reason: str = ""
    #: what the ops ran compiled with (:meth:`~compfx.costmodel.compile_spec.CompileSpec.key`), or the device model
    #: they were priced on (:func:`~compfx.costmodel.roofline_profiles`); None: run eagerly
    compiled: Mapping | None = None

    def __getitem__(self, key: OpKey) -> OpProfile:
        return self.ops[key]

    def __iter__(self) -> Iterator[OpKey]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def skipped(self) -> dict[OpKey, str]:
        return {k: p.skipped for k, p in self.ops.items() if p.skipped}


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
    conditions: Conditions | None = None,
) -> OpProfiles:
    """Time every op of ``analysis`` forward+backward, in isolation, at FP32 and at the low dtype.

    Each op runs on real tensors made from its recorded input metadata
    (floating inputs random, integer inputs zero, parameters and buffers the
    model's own), with ``requires_grad`` where the model has it, and a ones
    gradient into its floating outputs. At the low dtype the op runs as the
    cast pass runs it under a "low" plan (:mod:`compfx.cast_policy`): its
    castable inputs cast, or the whole op under ``torch.autocast``. Ops that
    cannot run in isolation get time 0 and a ``skipped`` reason. ``keys``
    limits profiling to some ops (default: all of ``analysis.ops``).
    ``refresh=True`` measures every op again and overwrites its cache entries;
    ``use_cache=False`` neither reads nor writes them. ``conditions`` are the
    machine's conditions now (default: :func:`~compfx.measure.measure_conditions`,
    timed once per call when the cache is used): written into new entries, and
    compared with those a cached entry recorded (see the module docstring).
    ``repeats``, ``warmup``,
    ``block_s``, ``budget_s`` and ``clock`` go to :func:`compfx.measure.time_fastest`
    (``clock="cpu"``, on one CPU thread, is immune to other processes).

    >>> import torch, compfx
    >>> from compfx.costmodel import profile_ops
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(4, 8))
    >>> p = profile_ops(a, repeats=2, use_cache=False)
    >>> sorted(str(k) for k in p), p.measured
    (['0:linear#0', '1:relu#0'], 4)
    """
    if repeats < 1 or warmup < 0:
        raise BadInputError(f"profile_ops(repeats={repeats}, warmup={warmup}); expected repeats >= 1 and "
                            "warmup >= 0.")
    low_dtype = check_low_dtype(low_dtype or analysis.low_dtype, "profile_ops: low_dtype")
    device = torch.device(analysis.device)
    check_clock(clock, device=device)  # refuse a clock that cannot time this device before measuring anything
    timing = dict(repeats=repeats, warmup=warmup, block_s=block_s, budget_s=budget_s, clock=clock)
    start = time.perf_counter()
    if use_cache and conditions is None:
        conditions = measure_conditions(device=device, clock=clock)
    cache = _EntryCache(profile_folder(cache_dir) if use_cache else None, refresh, conditions)
    wanted = set(keys) if keys is not None else None
    nodes = {n.meta[KEY_META]: n for n in analysis.graph_module.graph.nodes if KEY_META in n.meta}
    profiles = {op.key: _profile_one(analysis.graph_module, nodes[op.key], device, low_dtype, cache, timing)
                for op in analysis.ops if wanted is None or op.key in wanted}
    return OpProfiles(profiles, low_dtype, device, cache.measured, cache.reused, time.perf_counter() - start,
                      cache.stale, conditions, cache.stale_reason)


# -- one op, in isolation ------------------------------------------------------------

class _OpBench:
    """Real tensors for one node, built from its recorded metadata, and a forward+backward closure."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, device: torch.device):
        self.node = node
        self.kind = node.meta[KEY_META].kind
        self.device = device
        self.module = gm.get_submodule(node.target) if node.op == "call_module" else None
        self.values = pytree.tree_map(lambda a: self._value(gm, a) if isinstance(a, fx.Node) else a,
                                      (node.args, node.kwargs))
        self.low_under_autocast = low_runs_under_autocast(node)

    @staticmethod
    def _value(gm: fx.GraphModule, arg: fx.Node):
        if arg.op == "get_attr":  # parameters and buffers: the real thing (BN running stats may have no val)
            return get_attribute(gm, arg.target)
        return arg.meta.get("val")

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
        """Indices (into the flattened arguments) of the tensors the low variant casts: the cast pass's choice."""
        if self.low_under_autocast:
            return set()
        args, kwargs = self.values
        # the argument position (index or keyword) of every leaf, in the order pytree flattens self.values
        tagged = (tuple(pytree.tree_map(lambda _, i=i: i, value) for i, value in enumerate(args)),
                  {name: pytree.tree_map(lambda _, n=name: n, value) for name, value in kwargs.items()})
        positions = pytree.tree_leaves(tagged)
        mutated = mutated_positions(self.node)
        return {i for i, (position, value) in enumerate(zip(positions, pytree.tree_leaves(self.values), strict=True))
                if castable(self.kind, position, value, mutated)}

    def writes_a_leaf(self) -> bool:
        """Does the op write its first argument in place, which the step gives it as a leaf that requires grad?
        Autograd refuses that write (in the model the op writes an activation, not a leaf): see ``clone_first``."""
        leaves = pytree.tree_leaves(self.values)
        first = leaves[0] if leaves else None
        writes = writes_input(self.node) or getattr(self.module, "inplace", False) is True  # nn.ReLU(inplace=True)
        return (writes and isinstance(first, torch.Tensor) and bool(first.requires_grad)
                and first.is_floating_point())  # as _real makes it

    def padding(self):
        """How the padding pass would pad this op at its recorded shapes (an ``OpPadding``), or None."""
        from ..passes.pad_shapes import padding_of_call  # the pass's own rule, so the profile times what it builds

        args, kwargs = self.values
        groups = args[6] if self.kind.startswith("conv") and len(args) > 6 else kwargs.get("groups", 1)
        return padding_of_call(self.kind, args, kwargs, groups=groups) if self.module is None else None

    def _values_at(self, dtype: torch.dtype):
        """The call's arguments for a run at ``dtype``: a ``torch.finfo`` limit it takes is ``dtype``'s, as
        :mod:`compfx.passes.follow_dtype_limits` makes it in a planned graph."""
        if LIMIT_META not in self.node.meta or dtype == self.node.meta[LIMIT_META][0]:
            return self.values
        limits = self.node.meta[LIMIT_META][1]
        args, kwargs = self.values
        return (tuple(limit_value(limits[i], dtype) if i in limits else arg for i, arg in enumerate(args)),
                {name: limit_value(limits[name], dtype) if name in limits else arg for name, arg in kwargs.items()})

    def make_step(self, dtype: torch.dtype, *, clone_first: bool = False, padding=None,
                  call: Callable | None = None) -> Callable[[], None]:
        """A closure running the op forward and backward at ``dtype`` (FP32 = no casts).

        ``clone_first`` feeds the op a copy of its first input made inside the
        step: an in-place op cannot write into a leaf that requires grad.
        ``padding`` (an ``OpPadding``) runs the op padded and sliced back, as
        :mod:`compfx.passes.pad_shapes` does, after the casts. ``call`` runs
        instead of the op's own callable (:meth:`op_callable`), on the same
        arguments: the op compiled, or in FP8.
        """
        leaves, spec = pytree.tree_flatten(self._values_at(dtype))
        casts = self.cast_positions() if dtype != torch.float32 else set()
        real = [self._real(v, dtype if i in casts else None) if isinstance(v, torch.Tensor) else v
                for i, v in enumerate(leaves)]
        grad_inputs = [t for t in real if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.module is not None:
            grad_inputs += [p for p in self.module.parameters() if p.requires_grad]
        if call is None:
            call = self.op_callable(dtype)
        grads: list[torch.Tensor] = []  # ones into the outputs that carry gradients, made on the first call

        def forward():
            inputs = list(real)
            if clone_first:
                inputs[0] = inputs[0].clone()
            args, kwargs = pytree.tree_unflatten(inputs, spec)
            out = padding.run(call, args, kwargs) if padding is not None else call(*args, **kwargs)
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

    def op_callable(self, dtype: torch.dtype) -> Callable:
        """The op as the cast pass runs it at ``dtype``: itself, or under ``torch.autocast`` where that is its rule."""
        return self._callable(autocast_dtype=dtype if dtype != torch.float32 and self.low_under_autocast else None)

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
        return AutocastRegion(function, self.device.type, autocast_dtype).forward


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    return f"{module}.{name}" if module else name


def _profile_one(gm, node, device, low_dtype, cache: "_EntryCache", timing: Mapping) -> OpProfile:
    key: OpKey = node.meta[KEY_META]
    try:
        bench = _OpBench(gm, node, device)
        signature = bench.signature()
        casts = bench.cast_positions()
    except Exception as error:  # noqa: BLE001 - an op we cannot describe is simply not predicted
        return OpProfile(key, 0.0, 0.0, f"could not build inputs: {type(error).__name__}: {error}")
    seconds, reasons = {}, []
    for dtype in (torch.float32, low_dtype):
        entry_key = _op_entry_key(signature, dtype, casts if dtype != torch.float32 else (), device, timing["clock"])
        seconds[dtype], reason = cache.seconds(entry_key, lambda dtype=dtype: _measure(bench, dtype, timing))
        if reason:
            reasons.append(f"{dtype_name(dtype)}: {reason}")
    if reasons:  # half a profile would mislead the predictor; treat the op as unknown
        return OpProfile(key, 0.0, 0.0, "; ".join(reasons))
    return OpProfile(key, seconds[torch.float32], seconds[low_dtype])


def _op_entry_key(signature: Mapping, dtype: torch.dtype, casts: Iterable[int], device: torch.device,
                  clock: str, padded: str = "") -> dict:
    return {"signature": signature, "dtype": dtype_name(dtype), "cast_inputs": sorted(casts),
            **environment_key(device=device, clock=clock), "version": CACHE_VERSION,
            **({"padded": padded} if padded else {})}  # unpadded entries keep the keys they always had


def _measure(bench: _OpBench, dtype: torch.dtype, timing: Mapping, padding=None) -> float:
    # x.relu_() on a leaf that requires grad: time it on a copy made inside the step (padded, it writes the padded copy)
    clone_first = padding is None and bench.writes_a_leaf()
    return time_fastest(bench.make_step(dtype, clone_first=clone_first, padding=padding), device=bench.device,
                        **timing)


# -- padding: does the padded op beat the unpadded one? ---------------------------------------------

@dataclass(frozen=True)
class PaddingProfile:
    """Forward+backward seconds of one op at the low dtype, as it is and padded (:mod:`compfx.passes.pad_shapes`).

    ``skipped`` says why it could not be timed (then it is not predicted to pay).

    >>> from compfx.opkey import OpKey
    >>> PaddingProfile(OpKey.parse("head:linear#0"), low_s=4e-3, padded_s=3e-3).pays
    True
    """

    key: OpKey
    low_s: float
    padded_s: float
    skipped: str = ""

    @property
    def pays(self) -> bool:
        """Is the padded op alone faster (the cost model's "can it pay")?"""
        return not self.skipped and self.padded_s < self.low_s


def profile_padding(analysis, keys: Iterable[OpKey], *, repeats: int = 3, warmup: int = 1, block_s: float = 5e-4,
                    budget_s: float = 5e-3, clock: str = "wall", cache_dir: str | os.PathLike | None = None,
                    use_cache: bool = True, conditions: Conditions | None = None) -> dict[OpKey, PaddingProfile]:
    """Time each op of ``keys`` forward+backward in isolation at the analysis's low dtype, unpadded and padded.

    As in Inductor's ``pad_mm`` (``_should_pad``), the padded op includes its
    pads and slices, and the answer is cached by the op's signature (with the
    profiles of :func:`profile_ops`, whose low-dtype entries the unpadded
    timings share). The arguments are :func:`profile_ops`'.

    >>> import torch, compfx
    >>> from compfx.costmodel import profile_padding
    >>> a = compfx.analyze(torch.nn.Sequential(torch.nn.Linear(16, 10)), torch.randn(8, 16))
    >>> p = profile_padding(a, [a.ops[0].key], repeats=2, use_cache=False)[a.ops[0].key]
    >>> p.low_s > 0 and p.padded_s > 0
    True
    """
    device = torch.device(analysis.device)
    check_clock(clock, device=device)
    timing = dict(repeats=repeats, warmup=warmup, block_s=block_s, budget_s=budget_s, clock=clock)
    if use_cache and conditions is None:
        conditions = measure_conditions(device=device, clock=clock)
    cache = _EntryCache(profile_folder(cache_dir) if use_cache else None, False, conditions)
    nodes = {n.meta[KEY_META]: n for n in analysis.graph_module.graph.nodes if KEY_META in n.meta}
    return {key: _profile_padding_one(analysis.graph_module, nodes[key], device, analysis.low_dtype, cache, timing)
            for key in keys}


def _profile_padding_one(gm, node, device, low_dtype, cache: "_EntryCache", timing: Mapping) -> PaddingProfile:
    key: OpKey = node.meta[KEY_META]
    try:
        bench = _OpBench(gm, node, device)
        signature, casts, padding = bench.signature(), bench.cast_positions(), bench.padding()
    except Exception as error:  # noqa: BLE001 - an op we cannot describe is not predicted to pay
        return PaddingProfile(key, 0.0, 0.0, f"could not build inputs: {type(error).__name__}: {error}")
    if padding is None:
        return PaddingProfile(key, 0.0, 0.0, "nothing to pad at the recorded shapes")
    seconds = {}
    for padded in (None, padding):
        entry_key = _op_entry_key(signature, low_dtype, casts, device, timing["clock"],
                                  padded.reason if padded is not None else "")
        seconds[padded is not None], reason = cache.seconds(
            entry_key, lambda padded=padded: _measure(bench, low_dtype, timing, padded))
        if reason:
            return PaddingProfile(key, 0.0, 0.0, reason)
    return PaddingProfile(key, seconds[False], seconds[True])


class _EntryCache:
    """Profile entries read from, or measured into, one cache folder (None: no cache), with the counts.

    An entry is used only when it is well formed and was measured under
    conditions close to ``conditions`` (:meth:`Conditions.differ`); otherwise
    it is measured again and overwritten.
    """

    def __init__(self, folder: os.PathLike | None, refresh: bool, conditions: Conditions | None = None):
        self.folder, self.refresh, self.conditions = folder, refresh, conditions
        self.measured = self.reused = self.stale = 0
        self.stale_reason = ""
        self._this_run: dict[str, tuple[float, str]] = {}  # ops of one signature are timed once per run

    def seconds(self, key: Mapping, measure: Callable[[], float]) -> tuple[float, str]:
        """(seconds, why it could not be timed or ""): the cached entry for ``key``, else ``measure()``."""
        text = json.dumps(key, sort_keys=True)
        if text not in self._this_run:
            self._this_run[text] = self._cached_or_measured(key, measure)
        else:
            self.reused += 1
        return self._this_run[text]

    def _cached_or_measured(self, key: Mapping, measure: Callable[[], float]) -> tuple[float, str]:
        path = entry_path(self.folder, key) if self.folder is not None else None
        cached = read_entry(path, key, OP_PROFILE_FORMAT) if path is not None and not self.refresh else None
        if cached is not None:
            usable = self._usable(path, cached)
            if usable is not None:
                self.reused += 1
                return usable
        self.measured += 1
        try:
            seconds, reason = measure(), ""
        except Exception as error:  # noqa: BLE001 - e.g. an op without a kernel for this dtype
            seconds, reason = 0.0, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if path is not None:
            write_entry(path, key, OP_PROFILE_FORMAT, CACHE_VERSION,
                        {"seconds": seconds, "skipped": reason or None,
                         "conditions": self.conditions.to_dict() if self.conditions is not None else None})
        return seconds, reason

    def _usable(self, path, cached: Mapping) -> tuple[float, str] | None:
        """The entry's (seconds, skipped reason) when it can be trusted now; None to measure it again."""
        seconds, skipped = cached.get("seconds"), cached.get("skipped")
        if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
                and seconds >= 0 and (skipped is None or isinstance(skipped, str))):
            discard_entry(path, f"its seconds {seconds!r} / skipped {skipped!r} are not what compfx writes")
            return None
        if self.conditions is not None:
            recorded = Conditions.from_dict(cached.get("conditions"))
            why = ("it records no measuring conditions (written before compfx checked them)" if recorded is None
                   else recorded.differ(self.conditions))
            if why is not None:
                self.stale += 1
                self.stale_reason = self.stale_reason or why
                return None
        return float(seconds), str(skipped or "")
