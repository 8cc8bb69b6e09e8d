"""Plans applied per block: ``compfx.plan_blocks(model, plan, blocks=(Block, ...))``.

:func:`compfx.apply` turns the whole model into planned GraphModules whose
parameters are ``get_attr`` nodes: the blocks' own forwards never run, so whatever is attached to a block (FSDP2's per-block all-gather
hooks, activation checkpointing, user hooks) never fires. Here the model stays
the user's object: each submodule of the given types (the outermost ones) is
replaced, in its parent, by a :class:`PlannedBlock` that

* holds the block's own children, Parameters and buffers (the same objects,
  so ``state_dict`` keys, module paths and the optimizer's parameters are
  unchanged), and takes over the block's hooks;
* runs the block's planned GraphModule, one per input signature (shapes,
  dtypes, train/eval mode), captured from the block on its first call with
  that signature and rewritten from the model-wide plan; the graph reads the
  block's state through the block at call time, so it reads whatever
  Parameters FSDP2 has put in place for that call.

The plan is one plan for the whole model (its OpKeys are model paths, e.g.
``blocks.0.fc:linear#0``); a block's own graph is keyed relative to the block
(``fc:linear#0``) and looked up under the block's path. Code outside the
regions runs eagerly, as it was: plan entries for ops outside them are not
applied (a warning says how many); name their modules' types in
``per_module`` too to plan them. Each block captures on its own, so one block
that cannot be traced no longer blocks the rest (the analysis of the blocks
alone is :mod:`compfx.regions`').

The search (``compfx.optimize(..., per_module=...)``) starts from the model
with every block planned in FP32 (:func:`plan_blocks_fp32`) and switches
every plan into the same blocks (:meth:`PlannedBlock.use_plan`,
:mod:`compfx.search.per_module`), so the samples train the user's model as it
is wrapped (FSDP2, activation checkpointing) and their timings include the
all-gathers.
"""

from __future__ import annotations

import logging
from typing import Hashable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from .analysis import Analysis, analyze_graph
from .batches import model_device
from .cast_policy import check_weights_dtype, run_as_planned, weights_dtype
from .errors import BadInputError, CaptureError, PlanMismatchError
from .graph_capture import (capture, describe_inputs, input_signature, keep_checkpoints, modes_of,
                            normalize_example_inputs)
from .graph_capture.held_state import HeldState, check_computable
from .float8 import fp8_fallbacks
from .opkey import OpKey
from .passes import apply_precisions
from .plan import Plan
from .regions import (BLOCK_METHODS, BlockStandIn, captured_regions, in_region, model_key, region_paths,
                      regions_analysis)
from .vocabulary import Category, Precision, dtype_name

__all__ = ["PlannedBlock", "apply_per_module", "plan_blocks_fp32", "restore_blocks", "resharded"]

log = logging.getLogger("compfx")

#: The name under which a block's planned GraphModule reaches the block's state (``self._compfx_block.fc.weight``).
_OWNER = "_compfx_block"

# A block's hooks live in these dictionaries; the PlannedBlock shares them, so a handle the user holds still removes.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class PlannedBlock(BlockStandIn):
    """A block of a model running its part of a model-wide :class:`~compfx.plan.Plan`, in the block's place.

    It holds the block's children, Parameters and buffers (the same objects,
    under the same names) and shares the block's hooks. Each input signature
    gets the block's planned GraphModule (:meth:`graph_for`), captured from
    the block on first use; the graph reads the block's state through this
    module at call time, so FSDP2's unsharded Parameters are the ones it reads.
    :meth:`use_plan` switches to another plan of the same model (graphs are
    kept per plan). ``path`` is the block's path in the model: the plan's keys
    are looked up under it.

    >>> import torch, compfx
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    >>> model = torch.nn.Sequential(block, torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> planned = PlannedBlock(block, "0", compfx.Plan.amp(a))
    >>> planned(torch.randn(3, 4)).dtype, planned.get_submodule("0").weight is block[0].weight
    (torch.float32, True)
    >>> [str(op.key) for op in planned.analysis_for(torch.randn(3, 4)).ops]
    ['0:linear#0', '1:relu#0']
    """

    def __init__(self, block: nn.Module, path: str, plan: Plan, *, categories: Mapping[OpKey, Category] | None = None,
                 restore_output_dtypes: bool = True, method: str = "auto"):
        super().__init__()
        if isinstance(block, PlannedBlock):
            raise BadInputError(f"the block at {path!r} is planned already; switch its plan with .use_plan(plan).")
        for name, child in block._modules.items():
            self._modules[name] = child
        for name, param in block._parameters.items():
            self._parameters[name] = param
        for name, buffer in block._buffers.items():
            self._buffers[name] = buffer
        self._non_persistent_buffers_set = set(block._non_persistent_buffers_set)
        for name in _HOOK_DICTS:  # the hooks move here (a handle removes from the same dict); the block's
            if hasattr(block, name):  # own forward, which only the capture runs, gets empty ones
                object.__setattr__(self, name, getattr(block, name))
                object.__setattr__(block, name, type(getattr(block, name))())
        object.__setattr__(self, "_block", block)  # not a submodule: its forward is what gets captured
        object.__setattr__(self, "_weights_dtype", weights_dtype(block))  # checked at each call
        object.__setattr__(self, "_captures", {})  # input signature -> the block's Analysis (block-relative keys)
        object.__setattr__(self, "_graphs", {})  # (plan id, input signature) -> planned GraphModule
        object.__setattr__(self, "_plans", {})  # plan id -> plan, so that an id is never reused while cached
        object.__setattr__(self, "_outdated", [])  # captures a change of the block outdated, until one fits again
        object.__setattr__(self, "_held", HeldState(self))  # what the graphs were captured from (checked each call)
        self.path, self.block_type, self.method = path, type(block), method
        self.restore_output_dtypes = restore_output_dtypes
        self.training = block.training
        self.use_plan(plan, categories)

    def use_plan(self, plan: Plan, categories: Mapping[OpKey, Category] | None = None) -> None:
        """Run ``plan`` from the next call on (its graphs are built on first use, and kept)."""
        if not isinstance(plan, Plan):
            raise BadInputError(f"use_plan() takes a compfx.Plan; got {type(plan).__name__}.")
        self._plans[id(plan)] = plan
        self.plan = plan
        if categories is not None:
            self.categories = dict(categories)
        elif not hasattr(self, "categories"):
            self.categories = {}

    def forward(self, *args, **kwargs):
        check_weights_dtype(self._weights_dtype)
        if not self._held.unchanged():
            self._follow_block()
        graph = self.graph_for(*args, **kwargs)
        # run_as_planned calls graph.forward, not graph(...): no second set of hooks
        return run_as_planned(graph, args, kwargs, graph.meta["compfx_device_type"])

    def __getattr__(self, name: str):
        """Its Parameters, buffers and children; else the block's own attributes and methods, so code that reads
        the block (a Hugging Face base model's ``config``, ``get_input_embeddings()``) keeps working."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("_block")
            if block is None or name.startswith("__"):
                raise
            return getattr(block, name)

    def analysis_for(self, *args, **kwargs) -> Analysis:
        """The block's analysis (block-relative keys) at these inputs in the current mode; captured once each."""
        signature = input_signature(args, kwargs, modes_of(self))
        found = self._captures.get(signature)
        if found is None:
            found = self._capture(args, kwargs)
            self._check_same_ops(found)
            self._captures[signature] = found
        return found

    def _follow_block(self) -> None:
        """The block holds other tensors or submodules than its graphs were captured from, or moved (the graphs read
        its state at call time, so tensors replaced by their likes are read as they are: FSDP2 swaps them each
        call): a replaced submodule, another shape or another device drops the captures and graphs, and the next
        call captures the block again, as it is now; the meta device, or several, is refused."""
        change = self._held.change()
        check_computable(change, f"the planned block {self.path!r}")
        if not change.same_layout:
            log.warning("compfx: block %r changed after it was planned (%s); it is captured again at its next inputs "
                        "and runs the same plan there", self.path, change.describe())
            block = self._block  # what the capture traces: give it this module's children and tensors as they are
            for name in ("_modules", "_parameters", "_buffers"):
                table = getattr(block, name)
                table.clear()
                table.update(getattr(self, name))
            block._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
            self._outdated.extend(self._captures.values() or [None])  # None: compare with the plan's ops here
            self._captures.clear()
            self._graphs.clear()
        object.__setattr__(self, "_held", HeldState(self))
        object.__setattr__(self, "_weights_dtype", weights_dtype(self))

    def _check_same_ops(self, analysis: Analysis) -> None:
        """After the block changed, its first capture must have the ops it had before (those of an outdated capture,
        or the plan's ops in this block when it had none), or the plan no longer says what to run here
        (:class:`~compfx.errors.PlanMismatchError`)."""
        if not self._outdated:
            return
        now = {model_key(self.path, key) for key in analysis.keys}
        before = [{model_key(self.path, key) for key in old.keys} for old in self._outdated if old is not None]
        before = before or [{key for key in self.plan if in_region(key, [self.path])}]
        if now in before:
            self._outdated.clear()
            return
        raise PlanMismatchError(
            f"block {self.path!r} was changed after it was planned, and it now runs other ops than the plan was made "
            f"for (new: {', '.join(map(str, sorted(now - before[0])[:2])) or '-'}; gone: "
            f"{', '.join(map(str, sorted(before[0] - now)[:2])) or '-'}). Plan the model as it is now: search it "
            "again, or apply a plan made for it.")

    def keep_capture(self, signature: Hashable, analysis: Analysis) -> None:
        """Take ``analysis`` (block-relative keys), captured elsewhere at ``signature``, as this block's own capture
        there, unless it has one: the block then does not capture those inputs again."""
        self._captures.setdefault(signature, analysis)

    def graph_for(self, *args, **kwargs) -> fx.GraphModule:
        """The planned graph for these inputs under the current plan and mode, built now if it is new."""
        key = (id(self.plan), input_signature(args, kwargs, modes_of(self)))
        graph = self._graphs.get(key)
        if graph is None:
            # no_grad: capture and rewrite run ops on FakeTensors; they must save nothing for backward, or
            # activation checkpointing (which counts what its region saves) finds the recomputation unlike the forward
            with torch.no_grad():
                graph = self._graphs[key] = self._planned_graph(self.analysis_for(*args, **kwargs))
        return graph

    @property
    def graphs(self) -> dict[Hashable, fx.GraphModule]:
        """Every planned graph built so far, by (plan id, input signature)."""
        return dict(self._graphs)

    def _capture(self, args: tuple, kwargs: dict) -> Analysis:
        modes = {name: module.training for name, module in self.named_modules()}
        try:
            gm = capture(self._block, (args, kwargs), method=self.method, modes=modes)
        except CaptureError as error:
            raise CaptureError(f"the block {self.path!r} ({self.block_type.__name__}) could not be captured at inputs "
                               f"{describe_inputs(args, kwargs)}: {error}") from error
        return analyze_graph(gm, device=model_device(self), low_dtype=self.plan.low_dtype)

    def _planned_graph(self, analysis: Analysis) -> fx.GraphModule:
        """A copy of the block's graph with the plan's casts, reading the block's state through this module."""
        precisions, categories, unplanned = {}, {}, []
        for op in analysis.ops:
            key = model_key(self.path, op.key)
            categories[op.key] = self.categories.get(key, op.category)
            if key in self.plan:
                precisions[op.key] = self.plan[key]
            else:
                unplanned.append(key)
        if unplanned:
            log.warning("compfx: block %r runs %d op(s) the plan does not name (they follow: %s)", self.path,
                        len(unplanned), ", ".join(map(str, unplanned[:3])))
        fallbacks = fp8_fallbacks(analysis.ops, precisions, device=analysis.device, categories=categories)
        if fallbacks:
            precisions.update({key: precision for key, (precision, _) in fallbacks.items()})
            log.warning("compfx: block %r cannot run %d FP8 op(s) in FP8 at these inputs; they run at AMP's precision "
                        "for them (%s)", self.path, len(fallbacks),
                        "; ".join(f"{key}: {why}" for key, (_, why) in list(fallbacks.items())[:3]))
        source = analysis.graph_module
        # as compfx.apply builds a planned graph: on the analysis's own graph, which the cast pass copies and swaps
        # out before it changes anything (one copy, not two), and lazy (its code is generated once, when it runs)
        gm = _LazyGraphModule(source, source.graph, class_name=self.block_type.__name__ + "Mixed")
        source.graph.owning_module = source  # the new module took it over; it stays the analysis's
        apply_precisions(gm, precisions, low_dtype=self.plan.low_dtype, categories=categories,
                         default_precision=Precision.FOLLOW, restore_outputs=self.restore_output_dtypes,
                         fp8_recipe=self.plan.fp8_recipe,
                         padded=[op.key for op in analysis.ops if model_key(self.path, op.key) in self.plan.padded])
        _read_state_through(gm, self)
        gm.train(self.training)
        gm.meta.update(compfx_plan=self.plan, compfx_capture_method=analysis.capture_method,
                       compfx_device_type=analysis.device.type)
        return keep_checkpoints(gm)  # whatever copy of the graph the passes made, its checkpointed regions recompute

    def release(self) -> nn.Module:
        """The block this replaced, given back the children, Parameters, buffers, hooks and train/eval mode this
        module holds now (a Parameter replaced while planned stays replaced); this module keeps no hooks."""
        block = self._block
        for name in ("_modules", "_parameters", "_buffers"):
            table = getattr(block, name)
            table.clear()
            table.update(getattr(self, name))
        block._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        for name in _HOOK_DICTS:
            if hasattr(self, name):
                object.__setattr__(block, name, getattr(self, name))
                object.__setattr__(self, name, type(getattr(self, name))())
        block.training = self.training
        return block

    def extra_repr(self) -> str:
        return (f"block={self.block_type.__name__}, path={self.path!r}, plan={self.plan.fingerprint} "
                f"({dtype_name(self.plan.low_dtype)}), {len(self._graphs)} graph(s)")


def _read_state_through(gm: fx.GraphModule, owner: nn.Module) -> None:
    """Point ``gm``'s reads of the block's parameters, buffers and leaf modules at ``owner`` and drop its copies.

    ``gm`` then holds no reference of its own to the block's state: whatever
    tensor ``owner`` holds when the graph runs (FSDP2 swaps sharded and
    unsharded Parameters around each forward) is the one it reads. Constants
    the capture made stay in ``gm``.
    """
    state = {name for name, _ in owner.named_parameters(remove_duplicate=False)}
    state |= {name for name, _ in owner.named_buffers(remove_duplicate=False)}
    state |= {name for name, _ in owner.named_modules(remove_duplicate=False) if name}
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module") and node.target in state:
            node.target = f"{_OWNER}.{node.target}"
    for table in (gm._modules, gm._parameters, gm._buffers):
        for name in [n for n in table if n in owner._modules or n in owner._parameters or n in owner._buffers]:
            del table[name]
    gm._modules[_OWNER] = owner  # not gm.add_module: the owner is not gm's to train, move or save
    gm.graph.lint()
    gm.recompile()


def apply_per_module(model: nn.Module, plan: Plan, analysis: Analysis, per_module, *,
                     restore_output_dtypes: bool = True) -> nn.Module:
    """Replace each block of the ``per_module`` types in ``model`` by a :class:`PlannedBlock` running ``plan``
    (blocks planned already switch plans); returns ``model`` itself. ``compfx.plan_blocks``
    calls this after it validated the plan against ``analysis``.

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> same = apply_per_module(model, compfx.Plan.amp(a), a, torch.nn.Linear)
    >>> same is model, type(model[0]).__name__, list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    (True, 'PlannedBlock', True)
    """
    paths = region_paths(model, per_module)
    categories = {op.key: op.category for op in analysis.ops}
    for path in paths:
        block = model.get_submodule(path)
        if isinstance(block, PlannedBlock):
            block.use_plan(plan, categories)
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        parent._modules[name] = PlannedBlock(block, path, plan, categories=categories,
                                             restore_output_dtypes=restore_output_dtypes,
                                             method=_method(analysis, path))
    outside = [key for key, precision in plan.items() if precision is not Precision.FOLLOW and not in_region(key, paths)]
    if outside:
        log.warning("compfx: %d plan entries name ops outside the per_module regions (e.g. %s); that code runs "
                    "eagerly, as it was. Name their modules' types in per_module too to plan them.", len(outside),
                    outside[0])
    return model


def plan_blocks_fp32(model: nn.Module, example_inputs, per_module, *, device=None,
                     low_dtype: torch.dtype | None = None, verify: bool = True) -> Analysis:
    """Analyse ``model``'s blocks alone and make each a :class:`PlannedBlock` running FP32 (computing what it
    computed), in place, so that other plans of the same analysis can be switched into them; returns the
    analysis (:func:`compfx.regions.analyze_regions`).

    The search per block (``compfx.optimize(..., per_module=...)``) starts from
    this: every sample then trains the user's model as it is wrapped (FSDP2,
    activation checkpointing), with its plan switched into the same blocks
    (:meth:`PlannedBlock.use_plan`). Blocks planned already
    (``compfx.plan_blocks`` before ``fully_shard``) are kept as
    they are. The blocks' captures made here are the ones each block would make.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> analysis = plan_blocks_fp32(model, torch.randn(3, 4), torch.nn.Linear)
    >>> type(model[0]).__name__, [str(k) for k in analysis.keys], set(model[0].plan.values())
    ('PlannedBlock', ['0:linear#0', '2:linear#0'], {<Precision.FP32: 'fp32'>})
    """
    captured, signatures, device, low_dtype = captured_regions(model, example_inputs, per_module, device, low_dtype,
                                                               verify)
    analysis = regions_analysis(captured, signatures, device, low_dtype)
    apply_per_module(model, Plan.fp32(analysis), analysis, per_module)
    for path, signature in signatures.items():  # the blocks' captures, made here, are what each block would make
        block = model.get_submodule(path)
        if isinstance(block, PlannedBlock):
            block.keep_capture(signature, captured[path])
    resharded(model)
    return analysis


def restore_blocks(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_per_module`: each :class:`PlannedBlock` in ``model`` is replaced by the block it replaced
    (the same object, see :meth:`PlannedBlock.release`); returns ``model``.

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> first = model[0]
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> _ = compfx.plan_blocks(model, compfx.Plan.amp(a), analysis=a, blocks=torch.nn.Linear)
    >>> restore_blocks(model)[0] is first, type(model[2]).__name__
    (True, 'Linear')
    """
    planned = [(path, module) for path, module in model.named_modules() if isinstance(module, PlannedBlock)]
    for path, block in planned:  # outer blocks first (named_modules' order), so every inner path still resolves
        parent_path, _, name = path.rpartition(".")
        model.get_submodule(parent_path)._modules[name] = block.release()
    return model


def _method(analysis: Analysis, path: str) -> str:
    """The tracer a block is captured with: the analysis's own when it was a tracer, the one that captured that
    block in a regions analysis (the one verification passed), else each block's first."""
    if analysis.capture_method in ("symbolic", "record", "dynamo"):
        return analysis.capture_method
    return analysis.graph_module.meta.get(BLOCK_METHODS, {}).get(path, "auto")


def resharded(model: nn.Module) -> nn.Module:
    """Reshard every FSDP2 module of ``model`` (a no-op without FSDP2); returns ``model``.

    A forward without backward (the capture run, the first-batch check) leaves
    the root's Parameters unsharded; the search's snapshot must hold the
    sharded ones, which outlive the all-gather buffers.
    """
    for module in model.modules():
        if callable(getattr(module, "reshard", None)) and type(module).__name__.startswith("FSDP"):
            module.reshard()
    return model
