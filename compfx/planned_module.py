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
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from .analysis import Analysis, analyze, analyze_graph, parameter_shapes
from .cast_policy import check_weights_dtype, run_as_planned, weights_dtype
from .graph_capture import (capture, changed_dtype_reads, describe_inputs, input_signature, keep_checkpoints,
                            module_modes)
from .graph_capture.verify import COMPILED_PATH_BOUND
from .errors import BadInputError, CaptureError, PlanMismatchError
from .float8 import fp8_fallbacks
from .opkey import OpKey
from .passes import apply_precisions
from .plan import Plan
from .per_module import apply_per_module
from .regions import analyze_regions
from .vocabulary import Category, Precision, dtype_name

__all__ = ["apply", "plan_blocks", "PlannedModule", "planned_graph", "priced_regions_graph", "Specialization",
           "SignatureCaptures"]

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


@dataclass(frozen=True)
class Specialization:
    """One input signature a :class:`PlannedModule` met after its first: what it cost, and how the plan fit.

    ``inputs`` describes the shapes; ``capture_seconds`` is 0 when another
    module of the same :class:`SignatureCaptures` had captured this signature
    already; ``unplanned`` are ops of this graph that the plan does not name
    (they follow), ``missing`` plan entries whose op this graph lacks,
    ``fp8_fallbacks`` the plan's FP8 ops that cannot run FP8 at these shapes,
    with why (they run low here: :func:`compfx.float8.fp8_fallbacks`).
    """

    inputs: str
    training: bool
    capture_seconds: float
    rewrite_seconds: float
    unplanned: tuple[OpKey, ...] = ()
    missing: int = 0
    fp8_fallbacks: tuple[tuple[OpKey, str], ...] = ()


class SignatureCaptures:
    """Captures of one model per input signature, shared by every :class:`PlannedModule` of that model.

    A search runs many plans over the same batches; each signature is captured
    and analysed once, and each plan only rewrites it. ``analysis`` is the
    first capture; its settings (method, leaf modules, modes, device, low
    dtype, categories) are reused for every other signature, so the op keys
    mean the same thing in each.
    """

    def __init__(self, model: nn.Module, analysis: Analysis):
        self.model, self.analysis = model, analysis
        self.categories = {op.key: op.category for op in analysis.ops}
        self._by_signature: dict[Hashable, Analysis] = {}
        if analysis.example_signature is not None:
            self._by_signature[analysis.example_signature] = analysis

    def __len__(self) -> int:
        return len(self._by_signature)

    def get(self, signature: Hashable, args: tuple, kwargs: dict, modes: dict[str, bool]) -> tuple[Analysis, float]:
        """The analysis at ``signature`` (captured now, in ``modes``, each module's train/eval mode, if need be), and
        the seconds that capture took (0 if cached)."""
        found = self._by_signature.get(signature)
        if found is not None:
            return found, 0.0
        start = time.perf_counter()
        base = self.analysis
        training = modes.get("", True)
        try:
            gm = capture(self.model, (args, kwargs), method=base.capture_method, leaf_modules=base.leaf_modules,
                         modes=modes)
        except CaptureError as error:
            raise CaptureError(
                f"inputs {describe_inputs(args, kwargs)} ({'train' if training else 'eval'} mode) are a new input "
                f"signature, and capturing {type(self.model).__name__} again for them ({base.capture_method}, the "
                f"tracer of the first capture) failed: {error}. Use batches of shapes it captures at (e.g. "
                "DataLoader(..., drop_last=True) for a ragged last batch), or make forward capturable at these "
                "shapes.") from error
        analysis = analyze_graph(gm, device=base.device, low_dtype=base.low_dtype, fp8=base.fp8)
        self._by_signature[signature] = analysis
        return analysis, time.perf_counter() - start

    def categories_of(self, analysis: Analysis) -> dict[OpKey, Category]:
        """The first analysis's category for each op it has (overrides included), the default classification else."""
        return {op.key: self.categories.get(op.key, op.category) for op in analysis.ops}


#: What a GraphModule has and a PlannedModule does not: its graph's (``compfx.apply`` returned a GraphModule before).
_GRAPH_MODULE_ONLY = frozenset({"graph", "code", "meta", "recompile", "print_readable", "to_folder"})


class PlannedModule(nn.Module):
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
        BadInputError: ``plan`` is not a ``Plan``, or ``analysis`` was made from another model object.
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
        if not isinstance(plan, Plan):
            raise BadInputError(f"PlannedModule takes a compfx.Plan; got {type(plan).__name__}.")
        plan.validate(analysis)
        _check_same_parameters(analysis.graph_module, model)
        _warn_if_searched_at_other_widths(plan, analysis)
        _mirror_state(self, model)
        # Plain attributes, not submodules: the tensors are registered above under the model's names.
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_graphs", {})
        object.__setattr__(self, "_modules_in_order", [module for _, module in model.named_modules()])
        object.__setattr__(self, "_weights_dtype", weights_dtype(model))
        self.plan, self.analysis, self.restore_output_dtypes = plan, analysis, restore_output_dtypes
        self.captures = captures if captures is not None else SignatureCaptures(model, analysis)
        self.specializations: list[Specialization] = []
        if analysis.example_signature is not None:
            if graph is None:
                graph = _planned_graph(model, analysis, plan, self.captures.categories_of(analysis),
                                       restore_output_dtypes=restore_output_dtypes)
            graph.train(analysis.modes.get("", True) if analysis.modes is not None else model.training)
            self._graphs[analysis.example_signature] = graph

    # The planned module is the model in another precision: it runs in the model's modes as they are at each call
    # (a BatchNorm frozen with .eval(), model.eval() for evaluation), and train()/eval() set the model's.
    @property
    def training(self) -> bool:
        return self._model.training if "_model" in self.__dict__ else True

    @training.setter
    def training(self, mode: bool) -> None:
        if "_model" in self.__dict__:  # nn.Module.__init__ sets it before there is a model
            self._model.training = mode

    def train(self, mode: bool = True) -> "PlannedModule":
        self._model.train(mode)
        return self

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        """What a graph for these inputs is specialised to: the inputs (:func:`~compfx.graph_capture.input_signature`)
        and every module's train/eval mode, in the model's order (as :func:`compfx.analyze` keys its example)."""
        # modes_of(model), from a list kept at construction: a training step pays this every call
        return input_signature(args, kwargs, tuple(module.training for module in self._modules_in_order))

    def forward(self, *args, **kwargs):
        check_weights_dtype(self._weights_dtype)
        graph = self._graphs.get(self.signature(args, kwargs))
        if graph is None:
            graph = self.specialize(args, kwargs)
        return run_as_planned(graph, args, kwargs, self.analysis.device.type)

    def specialize(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        """The planned graph for these inputs in the model's current modes, built now if this signature is new."""
        signature = self.signature(args, kwargs)
        graph = self._graphs.get(signature)
        if graph is not None:
            return graph
        analysis, capture_seconds = self.captures.get(signature, args, kwargs, module_modes(self._model))
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
        return super()._apply(fn, recurse)

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
