"""Regional compilation: each repeated block of a model compiled once per plan, the compiled code shared by its repeats.

``compfx.compile_with_plan(model, plan, regions="auto")`` compiles a model as
PyTorch's regional compilation recipe does: each block of an ``nn.ModuleList``
(or ``nn.Sequential``) of blocks of one class is compiled as a region of its
own, so the blocks that run the same precisions (their plan entries, keyed
relative to the block, are equal) share one compiled graph, one entry of
dynamo's cache and one Inductor kernel set. Compile time then grows with the
number of *different* block plans, not with depth.

What runs where:

* **regions**: the blocks (:func:`repeated_blocks`, or the outermost modules
  of the given types); each group of blocks with equal block plans
  (:func:`region_plan`) is one ``torch.compile`` of its own, under a compfx
  backend holding that block plan. Its graph's op keys are the block's own
  (``attn.qkv:linear#0``), the keys ``compfx.capture`` gives the model's ops
  with the block's path taken off; its records say which blocks ran it.
* **the rest**: the model's own forward, compiled under a compfx backend with
  the whole plan; each call of a region is a graph break there. The modules
  between the model and its blocks (a Hugging Face model's ``transformer``)
  run their own code eagerly: compiled apart, a piece of their code between
  two regions could not be named as the model's ops. Nor can dynamo resume
  after a graph break inside a Python loop: it runs a model's forward that
  calls its blocks in a ``for`` loop eagerly from the loop on. So the other
  children of those modules (embeddings, final norm, head) are regions too,
  each on its own, and only the ops of those forwards' own code run
  uncompiled; the first call says so if any of those has a precision other
  than ``follow`` in the plan.

A region returns its outputs in the model's own dtype, as every graph the
backend compiles does (a graph break does the same): the ops at the start of
the next region read them as the whole-model graph would read them cast back,
so a ``follow`` op there follows FP32.

During a call, each region's module is stood in for, in its parent, by a
module that calls the region's compiled code with it (the model's own block,
with its Parameters and hooks), and each module between the model and its
blocks by one that runs it eagerly; the model's own modules are put back
before the call returns, so the model is unchanged between calls.

Programs of one model compiled one after another (the plans a compiled search
measures) can share their regions (:class:`RegionCache`): a region whose block
plan and settings one program compiled is the next one's too, so a plan that
differs from the last in one block compiles that block's region and the
model's own code only. A plan records ``regions`` in its compile options
(``CompileOptions(regions="auto")``), so that ``compile_with_plan(model,
plan)`` compiles a plan searched by regions by regions again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import inspect
import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Sequence

import torch
import torch.nn as nn

from .compile_options import REGIONS_AUTO, own_recompiles, regions_setting
from .errors import BadInputError
from .opkey import OpKey
from .plan import Plan
from .regions import block_types, in_region, model_key, region_paths
from .vocabulary import Precision

__all__ = ["REGIONS_AUTO", "repeated_blocks", "region_plan", "CompiledRegion", "RegionCache", "RegionallyCompiled",
           "compile_regions", "program_records"]

log = logging.getLogger("compfx")

#: ``make_backend(plan, model=...)``: the compfx backend that compiles a region under its plan.
MakeBackend = Callable[..., Callable]


def repeated_blocks(model: nn.Module) -> list[str]:
    """Paths of ``model``'s repeated blocks: the entries of each outermost ``nn.ModuleList`` or ``nn.Sequential``
    that holds two or more distinct modules, all of one class, each with submodules of its own (a block, not a
    single layer).

    >>> from compfx.examples import gpt
    >>> repeated_blocks(gpt(layers=3))
    ['blocks.0', 'blocks.1', 'blocks.2']
    >>> repeated_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))  # layers, not blocks
    []
    """
    paths: list[str] = []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in paths):
            continue  # inside a block found already
        if _holds_repeated_blocks(module):
            paths.extend(f"{name}.{child}" if name else child for child in module._modules)
    return paths


def _holds_repeated_blocks(module: nn.Module) -> bool:
    children = list(module._modules.values())
    return (isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2
            and all(c is not None and type(c) is type(children[0]) for c in children)
            and len({id(c) for c in children}) == len(children)
            and all(next(c.children(), None) is not None for c in children))


def region_plan(plan: Plan, path: str) -> Plan:
    """``plan``'s entries for the ops inside the module at ``path``, keyed relative to that module.

    >>> import torch, compfx
    >>> from compfx.examples import gpt
    >>> model = gpt(layers=2)
    >>> plan = compfx.Plan.amp(compfx.analyze(model, torch.randint(0, 64, (2, 16))))
    >>> block = region_plan(plan, "blocks.1")
    >>> block[compfx.OpKey("attn.qkv", "linear", 0)] is plan[compfx.OpKey("blocks.1.attn.qkv", "linear", 0)]
    True
    >>> block == region_plan(plan, "blocks.0")  # the same precisions in both blocks: one compiled region
    True
    """
    def relative(key: OpKey) -> OpKey:
        return OpKey(key.module[len(path) + 1:] if key.module != path else "", key.kind, key.index)

    inside = [key for key in plan if in_region(key, [path])]
    return Plan({relative(key): plan[key] for key in inside}, low_dtype=plan.low_dtype,
                fingerprint=plan.fingerprint, fp8_recipe=plan.fp8_recipe,
                padded=[relative(key) for key in plan.padded if in_region(key, [path])],
                device_type=plan.device_type, compile_options=plan.compile_options)


@dataclass(frozen=True)
class CompiledRegion:
    """One compiled region: the modules (``paths``) that share its compiled code, their ``plan`` (keyed relative
    to a module), and the compfx ``backend`` that compiled it (its ``records`` are keyed relative too)."""

    paths: tuple[str, ...]
    plan: Plan
    backend: Callable

    def records(self) -> list:
        """The backend's records once per module that ran them, keyed as the model's ops, ``region`` their path."""
        return [_as_model_record(record, path) for record in getattr(self.backend, "records", ())
                for path in self.paths]


def _as_model_record(record, path: str):
    def keyed(mapping):
        return {model_key(path, key): value for key, value in mapping.items()}

    return dataclasses.replace(
        record, region=path, precisions=keyed(record.precisions), compute_dtypes=keyed(record.compute_dtypes),
        unplanned=tuple(model_key(path, key) for key in record.unplanned),
        padded=tuple(model_key(path, key) for key in record.padded),
        fp8_fallbacks=tuple((model_key(path, key), why) for key, why in record.fp8_fallbacks))


def _run_region(module: nn.Module, *args, **kwargs):
    """What each region compiles: its module's call. One function for every region; each region compiles it
    apart (``isolate_recompiles``), so each region's cache holds its own plan's graphs only."""
    return module(*args, **kwargs)


class _StandIn(nn.Module):
    """Stands in for a module of the model during a call. Dynamo does not trace it (a graph break in the code
    around it). The module is held, not registered (its parent's module tree names it as before), and the
    module's attributes are read through it (``self.wte.weight`` in the parent's code)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        object.__setattr__(self, "module", module)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["module"], name)


def _uncompiled(call: Callable) -> Callable:
    """``call``, run uncompiled: a graph break in the code dynamo compiles around it. ``torch.compiler.disable``
    is applied here, when a region is built, not to a method at import: it imports dynamo (and dynamo
    ``torch.distributed.tensor``), which ``import compfx`` does not."""
    def run(*args, **kwargs):
        return call(*args, **kwargs)

    return torch.compiler.disable(run)


class _RegionCall(_StandIn):
    """Runs a region's compiled code with the module it stands in for."""

    def __init__(self, module: nn.Module, compiled: Callable):
        super().__init__(module)
        object.__setattr__(self, "compiled", compiled)
        object.__setattr__(self, "_run", _uncompiled(lambda *args, **kwargs: compiled(module, *args, **kwargs)))

    def forward(self, *args, **kwargs):
        return self._run(*args, **kwargs)


class _EagerCall(_StandIn):
    """Runs the module it stands in for eagerly, the regions inside it compiled (a module between the model and its
    blocks: compiled apart, a piece of its code between two regions could not be named as the model's)."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        object.__setattr__(self, "_run", _uncompiled(module))

    def forward(self, *args, **kwargs):
        return self._run(*args, **kwargs)


@dataclass(frozen=True)
class _Swap:
    parent: nn.Module
    name: str
    original: nn.Module
    stand_in: _StandIn

    @classmethod
    def at(cls, model: nn.Module, path: str, stand_in: _StandIn) -> "_Swap":
        parent, _, name = path.rpartition(".")
        return cls(model.get_submodule(parent), name, model.get_submodule(path), stand_in)


class RegionallyCompiled(nn.Module):
    """A model compiled region by region (:func:`compile_regions`); call it as the model.

    ``compfx_backend`` compiled the model's own code around the regions;
    ``compfx_regions`` lists the :class:`CompiledRegion` s; :attr:`records`
    has a record per graph compiled for the model's own code and one per
    module a region's graph ran for, keyed as the model's ops (a record's
    ``region`` is the module's path, ``""`` for the model's own code).
    ``_orig_mod`` is the model, as ``torch.compile`` keeps it.
    """

    def __init__(self, model: nn.Module, outer: Callable, outer_backend: Callable,
                 regions: Sequence[CompiledRegion], swaps: Sequence[_Swap], plan: Plan):
        super().__init__()
        self._orig_mod = model
        object.__setattr__(self, "_outer", outer)
        object.__setattr__(self, "compfx_backend", outer_backend)
        object.__setattr__(self, "compfx_regions", tuple(regions))
        object.__setattr__(self, "_swaps", tuple(swaps))
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_checked", False)

    def __getattr__(self, name: str):
        """The model's attributes, as ``torch.compile``'s wrapper forwards them."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("_orig_mod")
            if model is None:
                raise
            return getattr(model, name)

    @property
    def records(self) -> list:
        """Every graph's record, keyed as the model's ops: the model's own code's first, then each region's."""
        own = [dataclasses.replace(record, region="") for record in getattr(self.compfx_backend, "records", ())]
        return own + [record for region in self.compfx_regions for record in region.records()]

    def forward(self, *args, **kwargs):
        with self._regions_in_place():
            output = self._outer(*args, **kwargs)
        if not self._checked:
            object.__setattr__(self, "_checked", True)
            self._say_what_ran_uncompiled()
        return output

    @contextlib.contextmanager
    def _regions_in_place(self) -> Iterator[None]:
        for swap in self._swaps:
            if swap.parent._modules.get(swap.name) is not swap.original:
                raise BadInputError(
                    f"the submodule {swap.name!r} of {type(swap.parent).__name__} in {type(self._orig_mod).__name__} "
                    "was replaced after compile_with_plan compiled the model by regions; compile it again.")
        try:
            for swap in self._swaps:
                swap.parent._modules[swap.name] = swap.stand_in
            yield
        finally:
            for swap in self._swaps:
                swap.parent._modules[swap.name] = swap.original

    def _say_what_ran_uncompiled(self) -> None:
        """Warn once when ops of the plan with a precision of their own ran in no compiled graph (the own code of
        a forward that loops over its blocks, which dynamo runs eagerly)."""
        records = self.records
        if not records:
            return  # compile_with_plan's own warning: dynamo handed compfx no graph at all
        compiled = {key for record in records for key in record.precisions}
        eager = sorted(str(key) for key, precision in self._plan.items()
                       if key not in compiled and precision is not Precision.FOLLOW)
        if eager:
            warnings.warn(
                f"{len(eager)} op(s) of the plan ran in no compiled graph, as the model wrote them, not at their "
                f"planned precision (e.g. {', '.join(eager[:3])}): they are in the own code of a module between the "
                "model and its blocks, or of a forward that calls its blocks in a Python loop, which run eagerly "
                "around the regions. compile_with_plan(..., regions=False) compiles the whole model as one graph.",
                UserWarning,
                stacklevel=3)


class RegionCache:
    """Compiled regions kept for other programs of a model: a region whose module class, Parameter shapes, region
    plan and compile settings one program compiled is reused by the next, not compiled again.

    ``compile_with_plan(model, plan, shared_regions=cache)`` uses it; the
    compiled search gives one to every plan it measures, so a candidate that
    changes one block's plan compiles that block's region (and the model's own
    code around the regions) only. :meth:`entries` lists the regions built
    (each compiles at its first call); ``reuses`` counts the times one was
    reused.

    >>> cache = RegionCache()
    >>> cache.entries(), cache.reuses
    ([], 0)
    """

    def __init__(self):
        self._regions: dict[Hashable, tuple[Callable, Callable]] = {}
        self._entries: list[tuple[type, Plan, Callable]] = []
        self.reuses = 0

    def region(self, key: Hashable, module_type: type, plan: Plan,
               build: Callable[[], tuple[Callable, Callable]]) -> tuple[Callable, Callable]:
        """The (compiled code, backend) of ``key``, built by ``build()`` the first time."""
        if key in self._regions:
            self.reuses += 1
        else:
            self._regions[key] = build()
            self._entries.append((module_type, plan, self._regions[key][1]))
        return self._regions[key]

    def entries(self) -> list[tuple[type, Plan, Callable]]:
        """(module class, region plan, compfx backend) of each region built, in order; the backend's ``records``
        say which graphs it compiled."""
        return list(self._entries)


def compile_regions(model: nn.Module, plan: Plan | None, regions, *, make_backend: MakeBackend,
                    dynamic: bool | None = None, fullgraph: bool = False, shared: RegionCache | None = None,
                    settings: object = None) -> RegionallyCompiled | None:
    """``model`` compiled region by region under ``plan`` (see the module's docstring); None when ``regions`` is
    ``"auto"`` and the model has no repeated blocks, or no plan (compile it whole).

    ``regions``: ``"auto"`` (:func:`repeated_blocks`) or the block classes, or
    their names (the outermost modules of those classes are the regions).
    ``make_backend(plan, model=...)`` builds the compfx backend of a region
    (its block plan, ``model=None``: keys relative to the region's module) and
    of the model's own code (the whole plan, ``model=model``). ``fullgraph``
    applies to the regions; the code around them breaks at every region.
    ``shared``: regions kept for other programs (:class:`RegionCache`), keyed
    with ``settings``, whatever else ``make_backend`` compiles them under.
    """
    if plan is None:
        return _no_plan_to_divide(model, regions)
    blocks = [path for path in _region_paths(model, regions) if region_plan(plan, path)]  # no planned op: no region
    if not blocks:
        return None
    groups: dict[tuple, list[str]] = {}
    for path in blocks:  # blocks of one class, with Parameters of the same shapes, and one plan: one graph
        groups.setdefault(_share_key(model.get_submodule(path), region_plan(plan, path)), []).append(path)
    between = _between(model, blocks)
    for path in _side_regions(model, blocks, between, plan):
        groups.setdefault(_share_key(model.get_submodule(path), region_plan(plan, path), path), []).append(path)
    paths = [path for members in groups.values() for path in members]
    compiled_regions, swaps = [], [_Swap.at(model, path, _EagerCall(model.get_submodule(path)))
                                   for path in _outermost(p for p in between if _runs_code(model.get_submodule(p)))]
    shared = shared if shared is not None else RegionCache()  # within one program, each key compiles once anyway
    limit = max(8, 2 * len(paths))  # a graph per signature (shapes, train/eval) for each module it serves, at most
    for key, members in groups.items():
        block_plan = region_plan(plan, members[0])

        def build(block_plan=block_plan):
            backend = make_backend(block_plan, model=None)
            return torch.compile(_run_region, backend=backend, dynamic=dynamic, fullgraph=fullgraph,
                                 **_recompiles_of_a_region(limit)), backend

        compiled, backend = shared.region((key, dynamic, fullgraph, repr(settings)), key[0], block_plan, build)
        compiled_regions.append(CompiledRegion(tuple(members), block_plan, backend))
        swaps += [_Swap.at(model, path, _RegionCall(model.get_submodule(path), compiled)) for path in members]
    outer_backend = make_backend(plan, model=model)
    outer = torch.compile(model, backend=outer_backend, dynamic=dynamic, **own_recompiles())
    log.info("compfx: %s compiled by regions: %d region(s) for %d module(s) (%s), and its own code around them",
             type(model).__name__, len(compiled_regions), len(paths),
             "; ".join(f"{len(r.paths)} x {type(model.get_submodule(r.paths[0])).__name__}" for r in compiled_regions))
    return RegionallyCompiled(model, outer, outer_backend, compiled_regions, swaps, plan)


def _no_plan_to_divide(model: nn.Module, regions) -> None:
    """No plan given: the one this process searched for ``model`` is divided (compile_with_plan finds it); without
    one, ``"auto"`` compiles the model whole, each graph under the plan the backend finds, and block classes are
    refused (they ask for regions)."""
    if regions == REGIONS_AUTO:
        log.info("compfx: compile_with_plan(regions='auto') without a plan, and none searched for %s in this "
                 "process: compiling it whole, each graph under the plan the backend finds for it",
                 type(model).__name__)
        return None
    raise BadInputError(f"compile_with_plan(regions={regions!r}) needs the plan to divide into regions: pass it "
                        "(a Plan or a plan file), or regions=False to compile the whole model under the plan the "
                        "backend finds.")


def program_records(program: nn.Module) -> list:
    """Every graph record of a program :func:`compfx.compile_with_plan` made: its backend's, or by regions, every
    region's and the model's own code's (:attr:`RegionallyCompiled.records`)."""
    if isinstance(program, RegionallyCompiled):
        return program.records
    return list(program.compfx_backend.records)


def _share_key(module: nn.Module, block_plan: Plan, path: str = "") -> tuple:
    """Blocks that may share one compiled region: of one class, their Parameters and buffers of the same shapes
    and dtypes (dynamo would compile another graph for others), and one block plan (with the options it records).
    A module that is not a block (``path``: an embedding, a head) is a region of its own."""
    state = tuple((name, tuple(t.shape), t.dtype) for name, t in [*module.named_parameters(), *module.named_buffers()])
    return type(module), state, block_plan, block_plan.compile_options, path


def _region_paths(model: nn.Module, regions) -> list[str]:
    if regions == REGIONS_AUTO:
        return repeated_blocks(model)
    names = regions_setting(regions)  # refuses anything but "auto", block classes and their names
    types = tuple(regions) if all(isinstance(r, type) for r in regions) else _classes_named(model, names, regions)
    return region_paths(model, block_types(types))


def _classes_named(model: nn.Module, names: Sequence[str], regions) -> tuple[type, ...]:
    """The classes of ``model``'s modules that ``names`` name (by ``__name__``, ``__qualname__``, or module and
    qualified name); a name that none has is refused."""
    classes = {type(m) for m in model.modules()}
    named = {name: [c for c in classes if name in (c.__name__, c.__qualname__, f"{c.__module__}.{c.__qualname__}")]
             for name in names}
    missing = [name for name, found in named.items() if not found]
    if missing:
        raise BadInputError(f"regions={regions!r} names {missing[0]!r}, which is no class of "
                            f"{type(model).__name__}'s modules; expected {REGIONS_AUTO!r}, None (the whole model as "
                            "one graph) or the block classes, e.g. regions=(Block,).")
    return tuple(c for found in named.values() for c in found)


def _between(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The modules between the model and its blocks (the blocks' ancestors, the model left out), outermost first."""
    paths = {".".join(p.split(".")[:n]) for p in blocks for n in range(1, p.count(".") + 1)}
    return sorted(paths, key=lambda p: (p.count("."), p))


def _runs_code(module: nn.Module) -> bool:
    """Is ``module`` called with code of its own (not a container its parent iterates or indexes)?"""
    return (type(module).forward is not nn.Module.forward
            and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


def _outermost(paths) -> list[str]:
    kept: list[str] = []
    for path in sorted(paths, key=lambda p: (p.count("."), p)):
        if not any(path.startswith(outer + ".") for outer in kept):
            kept.append(path)
    return kept


def _side_regions(model: nn.Module, blocks: Sequence[str], between: Sequence[str], plan: Plan) -> list[str]:
    """The other children of the modules whose code runs eagerly around the regions: those between the model and
    its blocks, and the model itself when its forward loops (dynamo runs such a forward eagerly once a region's call
    breaks its graph inside the loop). Each is a region of its own."""
    eager = [*between, *([""] if _loops(model) else [])]
    side = []
    for path in eager:
        module = model.get_submodule(path)
        for name, child in module._modules.items():
            child_path = f"{path}.{name}" if path else name
            if child is not None and child_path not in between and child_path not in blocks \
                    and region_plan(plan, child_path):
                side.append(child_path)
    return side


def _loops(module: nn.Module) -> bool:
    """Does ``module``'s forward hold a Python loop (a jump back)? Not known: assume it does."""
    forward = inspect.unwrap(getattr(type(module), "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    if code is None:
        return True
    return any(ins.opname.startswith("JUMP_BACKWARD") or ins.opname == "FOR_ITER"
               or (ins.opname == "JUMP_ABSOLUTE" and isinstance(ins.argval, int) and ins.argval < ins.offset)
               for ins in dis.get_instructions(code))


def _recompiles_of_a_region(limit: int) -> dict:
    """:func:`~compfx.compile_options.own_recompiles`, with ``limit`` recompiles where ``torch.compile`` takes one."""
    accepted = inspect.signature(torch.compile).parameters
    return {**own_recompiles(), **({"recompile_limit": limit} if "recompile_limit" in accepted else {})}
