"""Final stage: turn a model and a :class:`~compfx.plan.Plan` into a mixed-precision module.

:func:`apply` returns a :class:`PlannedModule`: the model running the plan at
*any* input signature (batch size, sequence length, dtype, train/eval mode).
The first call with a new signature captures the model again at those inputs
and rewrites that graph from the same OpKey-keyed plan; later calls with that
signature reuse it (a graph that was recorded or exported is specialised to
one signature, and a loader's last batch, or the next batch's sequence length,
is another). It shares the model's ``nn.Parameter`` and buffer objects (they
stay FP32: master weights), so an optimizer built on ``model.parameters()``
keeps working, and its ``state_dict()`` has the same keys and dtypes as the
model's, so checkpoints load into either. Its graph of the example inputs is
``.graph_module``. It is what ``compfx.optimize(...).module`` is.

:func:`plan_blocks` plans a model block by block instead, in place
(:mod:`compfx.per_module`), for FSDP2 and anything else attached to the blocks.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import warnings
from typing import Hashable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from .analysis import Analysis, analyze, parameter_shapes
from .cast_policy import check_weights_dtype, run_as_planned, weights_dtype
from .graph_capture import changed_dtype_reads, describe_inputs, input_signature, keep_checkpoints, module_modes
from .graph_capture.held_state import HeldState, check_computable
from .graph_capture.verify import COMPILED_PATH_BOUND
from .errors import BadInputError, PlanMismatchError
from .float8 import fp8_fallbacks
from .opkey import OpKey
from .passes import apply_precisions
from .plan import Plan
from .per_module import apply_per_module
from .regions import analyze_regions
from .signature_captures import SignatureCaptures, Specialization
from .vocabulary import Category, Precision, dtype_name

__all__ = ["apply", "plan_blocks", "PlannedModule", "FollowsModelModes", "planned_graph", "priced_regions_graph"]

log = logging.getLogger("compfx")


def apply(
    model: nn.Module,
    plan: Plan,
    example_inputs=None,
    *,
    analysis: Analysis | None = None,
    restore_output_dtypes: bool = True,
    leaf_modules: Iterable[type | str] = (),
    verify: bool = True,
    per_module: type | Iterable[type] = (),
) -> PlannedModule:
    """Run ``model`` with each op at the precision ``plan`` gives it, as a :class:`PlannedModule`.

    The model itself is not changed: the planned module shares its Parameters
    and buffers (FP32 master weights), so an optimizer built on
    ``model.parameters()`` trains it, and its ``state_dict()`` keys are the
    model's. Graphs are specialised to the model's train/eval mode, as captures are.

    Args:
        model: the ``nn.Module`` the plan was made for.
        plan: a :class:`~compfx.plan.Plan`: ``Plan.amp(analysis)``, ``Plan.from_bitstring``, ``Plan.load(path)``
            or ``compfx.optimize(...).plan``.
        example_inputs: inputs the model is captured and analysed with when ``analysis`` is not given: a
            tensor, a tuple of positional arguments, or ``(args, kwargs)``.
        analysis: the :class:`~compfx.analysis.Analysis` the plan was made from (its graph is copied, never
            changed); it spares a second capture.
        restore_output_dtypes: return outputs in the dtypes the model returns (else as the plan leaves them).
        leaf_modules: module types or names that symbolic tracing keeps as one op each.
        verify: check a capture made here against the model (see :func:`compfx.analyze`).
        per_module: deprecated; use :func:`plan_blocks` (``blocks=``), which plans the model in place.

    Returns:
        PlannedModule: the plan at the example inputs' signature (built now; ``.graph_module`` is its
        ``torch.fx.GraphModule``) and at any other (captured on first use).

    Raises:
        BadInputError: ``model`` is not an ``nn.Module`` or ``plan`` not a ``Plan``; neither
            ``example_inputs`` nor ``analysis`` is given; or the analysis was made from another model object.
        PlanMismatchError: the plan is for another model (other op keys, another fingerprint) or another low
            dtype than the analysis. It is checked first, so nothing is applied.
        CaptureError: the model cannot be captured at ``example_inputs``, or not faithfully.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> a = compfx.analyze(model, torch.randn(3, 4))
        >>> planned = compfx.apply(model, compfx.Plan.from_bitstring(a, "0f1"), analysis=a)
        >>> planned(torch.randn(3, 4)).dtype, planned.get_parameter("0.weight") is model[0].weight
        (torch.float32, True)
        >>> planned(torch.randn(5, 4)).shape, type(planned.graph_module).__name__
        (torch.Size([5, 2]), 'SequentialMixed')
    """
    if per_module:
        warnings.warn("compfx.apply(..., per_module=...) is deprecated: it plans the model in place, block by block; "
                      "call compfx.plan_blocks(model, plan, example_inputs, blocks=...), which does the same.",
                      DeprecationWarning, stacklevel=2)
        return plan_blocks(model, plan, example_inputs, blocks=per_module, analysis=analysis,
                           restore_output_dtypes=restore_output_dtypes, verify=verify)
    _check_arguments("apply", model, plan)
    if analysis is None:
        if example_inputs is None:
            raise BadInputError("apply() needs example_inputs to capture the model, or analysis=<the Analysis "
                                "the plan was made from>.")
        analysis = analyze(model, example_inputs, low_dtype=plan.low_dtype, leaf_modules=leaf_modules,
                           fp8=plan.fp8_recipe is not None, verify=verify)
    _check_plan(plan, analysis)
    return PlannedModule(model, plan, analysis=analysis, restore_output_dtypes=restore_output_dtypes)


def plan_blocks(
    model: nn.Module,
    plan: Plan,
    example_inputs=None,
    *,
    blocks: type | Iterable[type],
    analysis: Analysis | None = None,
    restore_output_dtypes: bool = True,
    verify: bool = True,
) -> nn.Module:
    """Plan ``model`` block by block, in place: each block becomes a :class:`~compfx.per_module.PlannedBlock`.

    Each (outermost) submodule of the ``blocks`` types is replaced, in its
    parent, by a :class:`~compfx.per_module.PlannedBlock` holding the same
    children, Parameters, buffers and hooks, which runs its part of the plan.
    So FSDP2, activation checkpointing and hooks keep working on the blocks;
    code outside them runs eagerly, as it was. Blocks planned already switch to
    ``plan``. :func:`compfx.per_module.restore_blocks` puts the blocks back.

    Args:
        model: the ``nn.Module`` the plan was made for; changed in place.
        plan: a :class:`~compfx.plan.Plan` of the model (its op keys are model paths, ``blocks.0.fc:linear#0``).
        example_inputs: the model's inputs, to capture each block alone (verified against the block unless
            ``verify`` is False), when ``analysis`` is not given.
        blocks: the block types (a type or several), e.g. ``(GPT2Block,)``.
        analysis: the analysis the plan was made from (of the whole model or of its blocks,
            :func:`compfx.regions.analyze_regions`).
        restore_output_dtypes: blocks return outputs in the dtypes they returned.
        verify: check each block's capture against the block.

    Returns:
        nn.Module: ``model`` itself, its blocks planned (its ``state_dict`` keys unchanged).

    Raises:
        BadInputError: as :func:`apply`; or no submodule of ``model`` is of the ``blocks`` types.
        PlanMismatchError: the plan does not describe the model (or its blocks), or has another low dtype.
        CaptureError: a block cannot be captured at the inputs it receives.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> a = compfx.analyze(model, torch.randn(3, 4))
        >>> same = compfx.plan_blocks(model, compfx.Plan.amp(a), analysis=a, blocks=torch.nn.Linear)
        >>> same is model, type(model[0]).__name__, model(torch.randn(3, 4)).dtype
        (True, 'PlannedBlock', torch.float32)
    """
    _check_arguments("plan_blocks", model, plan)
    if analysis is None:
        if example_inputs is None:
            raise BadInputError("plan_blocks() needs example_inputs to capture the blocks, or analysis=<the Analysis "
                                "the plan was made from>.")
        analysis = analyze_regions(model, example_inputs, blocks, low_dtype=plan.low_dtype, verify=verify)
    _check_plan(plan, analysis)
    return apply_per_module(model, plan, analysis, blocks, restore_output_dtypes=restore_output_dtypes)


def planned_graph(model: nn.Module, plan: Plan, analysis: Analysis, *,
                  restore_output_dtypes: bool = True) -> fx.GraphModule:
    """The planned ``torch.fx.GraphModule`` of ``analysis``'s own example inputs: what a :class:`PlannedModule`
    runs at that signature, without the module around it. For the search and the cost model, which rewrite many
    plans of one analysis; users call :func:`apply`.

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> gm = planned_graph(model, compfx.Plan.amp(a), a)
    >>> gm(torch.randn(3, 4)).dtype, gm.get_parameter("0.weight") is model[0].weight
    (torch.float32, True)
    """
    _check_arguments("planned_graph", model, plan)
    _check_plan(plan, analysis)
    _check_same_parameters(analysis.graph_module, model)
    _warn_if_searched_at_other_widths(plan, analysis)
    gm = _planned_graph(model, analysis, plan, {op.key: op.category for op in analysis.ops},
                        restore_output_dtypes=restore_output_dtypes)
    gm.train(model.training)
    return gm


def _check_arguments(what: str, model, plan) -> None:
    if not isinstance(model, nn.Module):
        raise BadInputError(f"{what}() takes an nn.Module; got {type(model).__name__}.")
    if not isinstance(plan, Plan):
        raise BadInputError(f"{what}() takes a compfx.Plan; got {type(plan).__name__}. Build one with "
                            "Plan.amp(analysis), Plan.from_bitstring(...) or Plan.load(path).")


def _check_plan(plan: Plan, analysis: Analysis) -> None:
    """The plan describes the analysed model (its keys, its fingerprint) in the analysis's low dtype."""
    plan.validate(analysis)
    if plan.low_dtype != analysis.low_dtype:
        raise PlanMismatchError(
            f"the plan runs 'low' ops in {dtype_name(plan.low_dtype)}, but the analysis was made for "
            f"{dtype_name(analysis.low_dtype)} (its Tensor Core eligibility depends on it); expected the same low "
            f"dtype. Analyse the model with low_dtype=torch.{dtype_name(plan.low_dtype)}, or search again for "
            f"{dtype_name(analysis.low_dtype)}.")


def priced_regions_graph(analysis: Analysis, plan: Plan) -> fx.GraphModule:
    """The blocks' graphs side by side (``compfx.regions.regions_graph``) rewritten for ``plan``: what the cost
    model prices for a model planned block by block.

    It is built as each :class:`~compfx.per_module.PlannedBlock` builds the
    graph it runs, under ``no_grad``: the rewrite's FakeTensor results are
    shared between rewrites of one grad mode, so a plan whose blocks have run
    is not worked out on FakeTensors a second time to be priced (on a first
    use, that is most of a rewrite).
    """
    with torch.no_grad():
        return planned_graph(analysis.graph_module, plan, analysis)


def _planned_graph(model: nn.Module, analysis: Analysis, plan: Plan, categories: Mapping[OpKey, Category],
                   *, restore_output_dtypes: bool) -> fx.GraphModule:
    """A copy of the analysis's graph with the plan's casts and padding (ops the plan does not name follow)."""
    source = analysis.graph_module
    # Lazy: its Python code is generated when it first runs (or is printed). The search rewrites
    # plans that it only prices, and each pass below would otherwise regenerate the code again.
    # It starts on the analysis's own graph, not a copy: the cast pass rewrites a copy of its own and swaps it in,
    # so the analysis's graph is never changed, and one copy of it is made instead of two (a copy is most of a
    # rewrite's cost on a large graph).
    gm = _LazyGraphModule(source, source.graph, class_name=type(model).__name__ + "Mixed")
    source.graph.owning_module = source  # the new module took it over; it stays the analysis's
    apply_precisions(gm, plan, low_dtype=plan.low_dtype, categories=categories, default_precision=Precision.FOLLOW,
                     restore_outputs=restore_output_dtypes, fp8_recipe=plan.fp8_recipe, padded=plan.padded)
    _mirror_state(gm, model)
    gm.meta.update(compfx_plan=plan, compfx_capture_method=analysis.capture_method,
                   compfx_fidelity_notes=_say_fidelity_notes(gm, analysis, plan))
    return keep_checkpoints(gm)  # whatever copy of the graph the passes made, its checkpointed regions recompute


_SAID: set[str] = set()  # notes already logged in this process: a search rewrites one graph for many plans


def _say_fidelity_notes(gm: fx.GraphModule, analysis: Analysis, plan: Plan) -> list[str]:
    """Where this planned graph may compute otherwise than the model under ``torch.autocast`` (docs/fidelity.md):
    dtypes the model's Python read from activations the plan changes (:func:`compfx.graph_capture.changed_dtype_reads`),
    a dynamo capture's compile-only code paths, and a recorded graph of the model's FakeTensor code path. Logged once
    per note, and returned."""
    notes = changed_dtype_reads(gm)
    low = any(p in (Precision.LOW, Precision.FP8) for p in plan.values())
    if low and analysis.capture_method == "dynamo":
        notes.append("the graph was captured by torch._dynamo.export, so it holds the code paths the model takes "
                     "under torch.compile (transformers: grouped-query attention through repeat_kv, mixture-of-experts "
                     "through grouped_mm_fallback) and the dtypes it read as constants")
    elif low and _follows_fake_tensor_path(analysis):
        notes.append("the graph was recorded on FakeTensors, where the model took another code path than in eager "
                     "(transformers: an attention mask built instead of SDPA's is_causal), equal to eager in FP32 "
                     f"within {COMPILED_PATH_BOUND:g} of each tensor's largest magnitude")
    new = [note for note in notes if note not in _SAID]
    if new:
        _SAID.update(new)
        log.warning("compfx: this plan can round otherwise than torch.autocast in %d place(s) (docs/fidelity.md): %s",
                    len(new), "; ".join(new[:3]))
    return notes


def _warn_if_searched_at_other_widths(plan: Plan, analysis: Analysis) -> None:
    """Op keys name layers, not widths, so a plan applies to the same layers resized; say so when the plan records
    the parameter shapes it was searched on (:meth:`Plan.with_parameter_shapes`) and this model's differ."""
    if plan.parameter_shapes is None:
        return
    here = tuple(map(tuple, parameter_shapes(analysis.graph_module)))
    if here == plan.parameter_shapes:
        return
    there, mine = sorted(set(plan.parameter_shapes) - set(here)), sorted(set(here) - set(plan.parameter_shapes))
    warnings.warn(
        f"compfx: this plan was searched on a model whose parameters have other shapes (e.g. {list(there[0]) if there else '-'} "
        f"there, {list(mine[0]) if mine else '-'} here): the same layers at other widths. It applies, as its op keys "
        "name layers, not widths, but its precisions were measured at the other shapes; search this model to "
        "measure them here.", stacklevel=3)


def _follows_fake_tensor_path(analysis: Analysis) -> bool:
    """Did capture's verification keep a recorded graph of the model's FakeTensor code path (within the bound)?"""
    verification = analysis.verification
    return analysis.capture_method == "record" and verification is not None and verification.code_path


def _plan_at(plan: Plan, analysis: Analysis, categories: Mapping[OpKey, Category]) -> tuple[Plan, tuple]:
    """``plan`` as it runs at ``analysis``'s signature (FP8 fallbacks applied), and the fallbacks with why."""
    fallbacks = fp8_fallbacks(analysis.ops, plan, device=analysis.device, categories=categories)
    if not fallbacks:
        return plan, ()
    here = plan.with_precisions({key: precision for key, (precision, _) in fallbacks.items()})
    return here, tuple((key, why) for key, (_, why) in fallbacks.items())


#: What a GraphModule has and a PlannedModule does not: its graph's (``compfx.apply`` returned a GraphModule before).
_GRAPH_MODULE_ONLY = frozenset({"graph", "code", "meta", "recompile", "print_readable", "to_folder"})


class FollowsModelModes(nn.Module):
    """A module that is its model (kept in ``_model``, not a submodule) in another form: it runs in the model's
    modes as they are at each call (a BatchNorm frozen with .eval(), model.eval() for evaluation), and
    train()/eval() set the model's."""

    @property
    def training(self) -> bool:
        return self._model.training if "_model" in self.__dict__ else True

    @training.setter
    def training(self, mode: bool) -> None:
        if "_model" in self.__dict__:  # nn.Module.__init__ sets it before there is a model
            self._model.training = mode

    def train(self, mode: bool = True):
        self._model.train(mode)
        return self


class PlannedModule(FollowsModelModes):
    """``model`` running ``plan`` at any input signature; one planned graph per signature, built on first use.

    What :func:`compfx.apply` returns, and ``compfx.optimize(...).module`` is.
    A graph that :func:`compfx.capture` recorded (or dynamo exported) holds the
    example inputs' sizes as constants, and every graph is specialised to the
    train/eval mode and the branches its inputs took. So the first call with a
    new signature (:func:`~compfx.graph_capture.input_signature`: shapes, dtypes,
    devices, argument structure, and every module's train/eval mode, read from
    the model at each call) captures the model again with those inputs and
    rewrites that graph with the same OpKey-keyed plan; the graph is kept for
    later calls. :attr:`specializations` lists each one and what it cost; a
    call with a known signature costs one dictionary lookup (microseconds) on
    top of the graph. :attr:`graph_module` is the graph of the example inputs,
    :attr:`graphs` every one; :meth:`replan` switches plans in place.

    Args:
        model: the model the plan was made for. Its Parameters and buffers are shared under their own names
            (``state_dict()`` keys are the model's), so an optimizer built on ``model.parameters()`` trains
            this module; they stay FP32 (master weights), and converting them (``.half()``) is refused.
        plan: the :class:`~compfx.plan.Plan` to run.
        analysis: the :class:`~compfx.analysis.Analysis` of ``model`` the plan was made from; the graph of its
            example inputs is built now.
        restore_output_dtypes: return outputs in the dtypes the model returns.
        captures: the per-signature captures, shared between modules of the same model (the search's plans).
        graph: the planned graph of the analysis's own inputs, if built already.

    Raises:
        BadInputError: ``model`` is not an ``nn.Module``, ``plan`` not a ``Plan`` or ``analysis`` not an
            ``Analysis``, or ``analysis`` was made from another model object.
        PlanMismatchError: the plan does not describe the analysed model.
        CaptureError: at a call, when the model cannot be captured again at a new input signature.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> a = compfx.analyze(model, torch.randn(3, 4))
        >>> planned = compfx.PlannedModule(model, compfx.Plan.amp(a), analysis=a)
        >>> planned(torch.randn(3, 4)).shape, planned(torch.randn(5, 4)).shape
        (torch.Size([3, 2]), torch.Size([5, 2]))
        >>> len(planned.specializations), planned.get_parameter("0.weight") is model[0].weight
        (1, True)
    """

    def __init__(self, model: nn.Module, plan: Plan, *, analysis: Analysis, restore_output_dtypes: bool = True,
                 captures: SignatureCaptures | None = None, graph: fx.GraphModule | None = None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise BadInputError(f"PlannedModule takes the model (an nn.Module) first; got {type(model).__name__}. "
                                "Build it as compfx.PlannedModule(model, plan, analysis=compfx.analyze(model, inputs)).")
        if not isinstance(plan, Plan):
            raise BadInputError(f"PlannedModule takes a compfx.Plan; got {type(plan).__name__}.")
        if not isinstance(analysis, Analysis):
            raise BadInputError(f"PlannedModule takes analysis=<the model's compfx.Analysis>; got "
                                f"{type(analysis).__name__}. Pass analysis=compfx.analyze(model, example_inputs).")
        plan.validate(analysis)
        _check_same_parameters(analysis.graph_module, model)
        _warn_if_searched_at_other_widths(plan, analysis)
        _mirror_state(self, model)
        # Plain attributes, not submodules: the tensors are registered above under the model's names.
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_graphs", {})
        object.__setattr__(self, "_outdated", [])  # the captures a change of the model outdated, until one fits again
        self._note_model_state()
        self.plan, self.analysis, self.restore_output_dtypes = plan, analysis, restore_output_dtypes
        self.captures = captures if captures is not None else SignatureCaptures(model, analysis)
        self.specializations: list[Specialization] = []
        if analysis.example_signature is not None:
            if graph is None:
                graph = _planned_graph(model, analysis, plan, self.captures.categories_of(analysis),
                                       restore_output_dtypes=restore_output_dtypes)
            graph.train(analysis.modes.get("", True) if analysis.modes is not None else model.training)
            self._graphs[analysis.example_signature] = graph

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        """What a graph for these inputs is specialised to: the inputs (:func:`~compfx.graph_capture.input_signature`)
        and every module's train/eval mode, in the model's order (as :func:`compfx.analyze` keys its example)."""
        # modes_of(model), from a list kept at construction: a training step pays this every call
        return input_signature(args, kwargs, tuple(module.training for module in self._modules_in_order))

    def forward(self, *args, **kwargs):
        check_weights_dtype(self._weights_dtype)
        if not self._held.unchanged():
            self._follow_model()
        graph = self._graphs.get(self.signature(args, kwargs))
        if graph is None:
            graph = self.specialize(args, kwargs)
        return run_as_planned(graph, args, kwargs, self.captures.device.type)

    def specialize(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        """The planned graph for these inputs in the model's current modes, built now if this signature is new."""
        if not self._held.unchanged():
            self._follow_model()
        signature = self.signature(args, kwargs)
        graph = self._graphs.get(signature)
        if graph is not None:
            return graph
        analysis, capture_seconds = self.captures.get(signature, args, kwargs, module_modes(self._model))
        _check_same_ops(self._outdated, analysis)
        start = time.perf_counter()
        categories = self.captures.categories_of(analysis)
        plan, fallbacks = _plan_at(self.plan, analysis, categories)
        graph = _planned_graph(self._model, analysis, plan, categories, restore_output_dtypes=self.restore_output_dtypes)
        graph.train(self.training)
        unplanned = tuple(op.key for op in analysis.ops if op.key not in self.plan)
        missing = len(set(self.plan) - set(analysis.keys))
        inputs = describe_inputs(args, kwargs)
        self.specializations.append(Specialization(inputs, self.training, capture_seconds,
                                                   time.perf_counter() - start, unplanned, missing, fallbacks))
        if unplanned or missing:
            log.warning("compfx: at inputs %s %s; the other ops run as planned", inputs, _plan_fit(unplanned, missing))
        if fallbacks:
            log.warning("compfx: at inputs %s, %d FP8 op(s) of the plan cannot run FP8 and run at AMP's precision "
                        "for them (low, for a GEMM) at these inputs only (%s)",
                        inputs, len(fallbacks), "; ".join(f"{key}: {why}" for key, why in fallbacks[:3]))
        self._graphs[signature] = graph
        return graph

    def _note_model_state(self) -> None:
        """Record the model's state as the graphs are built from it (what each call checks it still holds)."""
        model = self._model
        object.__setattr__(self, "_held", HeldState(model))
        object.__setattr__(self, "_modules_in_order", [module for _, module in model.named_modules()])
        object.__setattr__(self, "_weights_dtype", weights_dtype(model))

    def _follow_model(self) -> None:
        """The model holds other tensors or submodules than the graphs were built from, or moved: follow it where
        that is exact, else refuse (:class:`~compfx.errors.BadInputError`). Tensors replaced by their likes (same
        shape, dtype and device: ``load_state_dict(..., assign=True)``) are read in their place; any other change
        (a replaced submodule, another shape, another device) drops every graph and capture, and the next call
        captures the model again with the same plan. Never computes with tensors the model no longer holds."""
        change = self._held.change()
        check_computable(change, "the planned module")
        if change.same_layout:  # the planned graphs, and the captures a shadow or a rewrite reads, read the new ones
            for graph in [*self._graphs.values(), *(a.graph_module for a in self.captures._by_signature.values())]:
                _mirror_state(graph, self._model)
        else:
            log.warning("compfx: the model changed after it was planned (%s); the planned module captures it again "
                        "at its next inputs and runs the same plan there", change.describe())
            self._outdated.extend(self.captures._by_signature.values())
            self.captures = self.captures.again(change.device)
            self._graphs.clear()
        self._mirror_model_state()
        self._note_model_state()

    def _mirror_model_state(self) -> None:
        """This module's own registrations of the model's tensors, made again from the model as it is now."""
        self._modules.clear()
        self._parameters.clear()
        self._buffers.clear()
        self._non_persistent_buffers_set.clear()
        _mirror_state(self, self._model)

    def replan(self, plan: Plan) -> None:
        """Run ``plan`` from the next call on, in place: every input signature's graph is rewritten from it.

        The module keeps its Parameters and buffers (an optimizer built on them
        keeps training it) and its captures; only the casts change. What
        :class:`compfx.Guard` uses to move an op to FP32 mid-training.
        """
        if not isinstance(plan, Plan):
            raise BadInputError(f"replan() takes a compfx.Plan; got {type(plan).__name__}.")
        plan.validate(self.analysis)
        if plan.low_dtype != self.plan.low_dtype:
            raise PlanMismatchError(f"replan() got a plan in {dtype_name(plan.low_dtype)}, but this module's graphs "
                                    f"were captured for {dtype_name(self.plan.low_dtype)}; expected the same low dtype.")
        self.plan = plan
        for signature, old in list(self._graphs.items()):
            analysis = self.captures._by_signature[signature]
            categories = self.captures.categories_of(analysis)
            graph = _planned_graph(self._model, analysis, _plan_at(plan, analysis, categories)[0], categories,
                                   restore_output_dtypes=self.restore_output_dtypes)
            graph.train(old.training)
            self._graphs[signature] = graph

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # its Parameters, buffers and submodules
        except AttributeError:
            if name not in _GRAPH_MODULE_ONLY:
                raise
        # compfx.apply returned a GraphModule before it returned this module; say where its graph went
        raise AttributeError(f"'PlannedModule' object has no attribute {name!r}: it runs the plan at any input "
                             "signature, one GraphModule each; the one of the example inputs is .graph_module, so "
                             f"read .graph_module.{name}.")

    @property
    def graph_module(self) -> fx.GraphModule:
        """The planned ``torch.fx.GraphModule`` of the analysis's own example inputs."""
        graph = self._graphs.get(self.analysis.example_signature)
        if graph is None and self._graphs:
            graph = next(iter(self._graphs.values()))
        if graph is None:
            raise BadInputError("this PlannedModule has no graph yet: its analysis came without example inputs "
                                "(analyze_graph); call it once, or build it from compfx.analyze(model, inputs).")
        return graph

    @property
    def graphs(self) -> dict[Hashable, fx.GraphModule]:
        """The planned graph of each input signature met so far (the analysis's own first)."""
        return dict(self._graphs)

    def extra_repr(self) -> str:
        return (f"plan={self.plan.fingerprint} ({dtype_name(self.plan.low_dtype)}), {len(self._graphs)} input "
                f"signature(s)")

    def _apply(self, fn, recurse=True):
        # .to(dtype), .double(), .half() convert the model's Parameters too; the graphs would then meet dtypes the
        # plan's casts were not made for, and fail deep inside torch. Refused before anything is converted.
        own = next((t for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point()), None)
        if own is not None:
            converted = fn(torch.empty(0, dtype=own.dtype, device=own.device)).dtype
            if converted != own.dtype:
                raise BadInputError(
                    f"a PlannedModule's parameters stay {dtype_name(own.dtype)}: the plan's casts run on FP32 master "
                    f"weights, so converting them to {dtype_name(converted)} (.to(dtype), .double(), .half()) is "
                    "refused and nothing was converted. Move it to another device with .to(device); to train in "
                    "another dtype, convert the model itself and plan it again.")
        # the model's tensors are the ones the graphs read: move the model itself (its buffers too, which .to()
        # replaces), then register its tensors here again; the next call follows the move (_follow_model)
        self._model._apply(fn, recurse)
        self._mirror_model_state()
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the model (the keys are the model's), as ``model.load_state_dict`` does; with ``assign=True``
        the next call reads the checkpoint's tensors in place of the model's old ones. A checkpoint that does not
        fit the model (other keys or shapes) is a :class:`~compfx.errors.BadInputError`, and nothing is loaded."""
        _check_loadable(self._model, state_dict, strict=strict)
        result = self._model.load_state_dict(state_dict, strict=strict, assign=assign)
        self._mirror_model_state()
        return result

    def __reduce_ex__(self, protocol):
        # torch.fx unpickles a graph by tracing its code again, which compfx's own nodes (input checks, checkpoint
        # regions, custom Functions) do not survive: the copy would fail at its first call
        raise BadInputError(
            "a PlannedModule cannot be pickled (torch.save(module), pickle.dumps): its graphs are rebuilt from the "
            "model and the plan. Save module.state_dict() and module.plan.save(path); to run it again, load the "
            "state into the model and build compfx.PlannedModule(model, compfx.Plan.load(path), "
            "analysis=compfx.analyze(model, example_inputs)).")

    def __deepcopy__(self, memo):
        # copy.deepcopy would copy through __reduce_ex__, which pickling refuses; the copy's graphs, model and
        # Parameters are copied together, so the copy trains its own Parameters
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def __copy__(self):
        copied = type(self).__new__(type(self))
        copied.__setstate__(dict(self.__dict__))
        return copied


def _plan_fit(unplanned: tuple[OpKey, ...], missing: int) -> str:
    """How a new signature's graph and the plan differ, saying only what is the case."""
    parts = []
    if unplanned:
        parts.append(f"the model runs {len(unplanned)} op(s) the plan does not name (they follow: "
                     f"{', '.join(map(str, unplanned[:3]))}{', ...' if len(unplanned) > 3 else ''})")
    if missing:
        parts.append(f"the model lacks {missing} op(s) the plan names")
    return " and ".join(parts)


def _check_same_ops(outdated: list[Analysis], analysis: Analysis) -> None:
    """After the model changed, its first capture must have the ops one of the outdated captures had, or the plan
    no longer says what to run: :class:`~compfx.errors.PlanMismatchError` (and ``outdated`` is kept for the next
    try); once one fits, ``outdated`` is emptied and later signatures are planned as usual."""
    if not outdated:
        return
    keys = set(analysis.keys)
    if any(set(old.keys) == keys for old in outdated):
        outdated.clear()
        return
    before = set(outdated[0].keys)
    gone, new = sorted(before - keys), sorted(keys - before)
    raise PlanMismatchError(
        f"the model was changed after it was planned, and it now runs other ops than the plan was made for ("
        f"{len(new)} new, e.g. {', '.join(map(str, new[:2])) or '-'}; {len(gone)} gone, e.g. "
        f"{', '.join(map(str, gone[:2])) or '-'}). Plan the model as it is now: compfx.optimize(...) again, or "
        "compfx.PlannedModule(model, plan, analysis=compfx.analyze(model, inputs)) with a plan made for it.")


def _check_loadable(model: nn.Module, state_dict, *, strict: bool) -> None:
    """What torch would refuse after loading part of the checkpoint, refused before anything is loaded, in one
    :class:`~compfx.errors.BadInputError`: keys the model lacks or misses (``strict``), tensors of other shapes
    than the model's (with ``assign=True`` too)."""
    if not isinstance(state_dict, Mapping):
        raise BadInputError(f"load_state_dict() takes a mapping of names to tensors; got {type(state_dict).__name__}.")
    own = model.state_dict(keep_vars=True)
    if strict and set(state_dict) != set(own):
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        raise BadInputError(
            f"the state dict does not fit the model: {len(missing)} key(s) missing (e.g. {missing[:2]}), "
            f"{len(unexpected)} the model lacks (e.g. {unexpected[:2]}); nothing was loaded. Load a checkpoint of "
            "this model, or pass strict=False to load the keys it shares.")
    other = [f"{name} {tuple(value.shape)} (the model's is {tuple(own[name].shape)})"
             for name, value in state_dict.items()
             if isinstance(value, torch.Tensor) and name in own
             and isinstance(own[name], torch.Tensor) and value.shape != own[name].shape]
    if other:
        raise BadInputError(
            f"the state dict's tensors have other shapes than the model's: {'; '.join(other[:3])}; nothing was "
            "loaded. Load a checkpoint of this model; for another width, give the model layers of that width "
            "first (the planned module captures it again at them).")


def _check_same_parameters(source: fx.GraphModule, model: nn.Module) -> None:
    """The analysis must come from this model object, or the result would train another model's weights."""
    own = {id(p) for p in model.parameters()}
    foreign = [name for name, p in source.named_parameters() if id(p) not in own]
    if foreign:
        raise BadInputError(
            f"the analysis was captured from another model object (its parameter {foreign[0]!r} is not one of "
            "this model's). Pass the analysis made from this model, or example_inputs instead of analysis=."
        )


def _mirror_state(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` every parameter and buffer of ``model`` under the same names (same objects).

    The graph registers only what it reads; checkpoints need the rest too
    (e.g. BatchNorm's ``num_batches_tracked``). Buffers the graph holds that are
    not in the model's state dict (constants) become non-persistent.
    """
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                _owner(gm, module_name).register_parameter(name, param)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                persistent = name not in module._non_persistent_buffers_set
                _owner(gm, module_name).register_buffer(name, buffer, persistent=persistent)
    model_keys = set(model.state_dict())
    for module_name, module in gm.named_modules(remove_duplicate=False):
        for name in list(module._buffers):
            full = f"{module_name}.{name}" if module_name else name
            if full not in model_keys:
                module._non_persistent_buffers_set.add(name)


def _owner(root: nn.Module, path: str) -> nn.Module:
    """The submodule at ``path``, creating empty containers on the way (as GraphModule does)."""
    module = root
    for part in path.split(".") if path else ():
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module
