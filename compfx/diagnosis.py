"""Per-op numerics of a planned module against an FP32 shadow: where low precision overflows, underflows or drifts.

:func:`diagnose` runs one forward and backward of the planned graph and of the
model's own FP32 graph (the capture the plan was applied to) on the same batch,
with the same parameters, buffers and RNG state, through a
:class:`torch.fx.Interpreter` that keeps every keyed op's output and the
gradient reaching it. Each op gets one :class:`OpDiagnosis` row. The model, its
gradients, its buffers, any optimizer and the RNG are left bitwise as they were:
gradients are taken with ``torch.autograd.grad`` (nothing accumulates into
``.grad``), buffers a forward updates in place (BatchNorm statistics, counters)
are copied back, and the RNG is forked.

An op is an **origin** when non-finite values start there: in forward, its
output is not finite although every value it was computed from (the outputs of
its keyed producers, the model's inputs and weights) is; in backward, the
gradient reaching its output is finite but a gradient it passes to an input is
not. :class:`compfx.Guard` moves origins to FP32.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
import torch.nn as nn
from tabulate import tabulate
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _PyTreeCodeGen
from torch.utils import _pytree as pytree

from .analysis import analyze
from .planned_module import PlannedModule
from .batches import check_first_batch, check_loss, copied_batch, model_device, model_devices, model_loss, split_batch
from .graph_capture import module_modes
from .errors import BadInputError
from .opkey import KEY_META, OpKey
from .passes.pad_shapes import PAD_META
from .plan import Plan
from .state import RngState, dense_values, restore_values, saved_values, torch_rng_preserved
from .vocabulary import Precision, dtype_name, short_dtype_name

__all__ = ["diagnose", "diagnose_inputs", "Diagnosis", "OpDiagnosis", "planned_module", "shadow_graph_of",
           "untouched_state", "rng_state"]

LossFn = Callable[[Any, Any], torch.Tensor]
#: Given the planned run's output, the tensors to differentiate and the gradients to start from.
BackwardFrom = Callable[[Any], "tuple[list[torch.Tensor], list[torch.Tensor] | None]"]


@dataclass(frozen=True)
class OpDiagnosis:
    """The numerics of one op under the plan, against the FP32 shadow (fractions are of the op's elements).

    ``overflow``: outputs that are non-finite or beyond the low dtype's range;
    ``underflow``: outputs that are zero where the shadow's are not; ``error``:
    ``||out - shadow|| / ||shadow||`` (inf when the output is not finite).
    ``grad_*`` are the same for the gradient reaching the op's output (None
    without a backward, or where no gradient reaches it). ``None`` fields mean
    the op has no floating output.
    """

    key: OpKey
    precision: Precision
    dtype: torch.dtype | None
    overflow: float | None
    underflow: float | None
    error: float | None
    grad_overflow: float | None = None
    grad_underflow: float | None = None
    grad_error: float | None = None
    origin: bool = False

    @property
    def risk(self) -> tuple:
        """Sort key, most at risk first: origins, then overflow (forward or backward), underflow, error."""
        def value(x):
            return -(x if x is not None and not math.isnan(x) else 0.0)
        overflow = max(self.overflow or 0.0, self.grad_overflow or 0.0)
        underflow = max(self.underflow or 0.0, self.grad_underflow or 0.0)
        return (not self.origin, value(overflow), value(underflow), value(self.error))


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` found: one :class:`OpDiagnosis` per keyed op, in graph order, and both losses.

    ``str(diagnosis)`` is a table sorted by risk. ``producers[key]`` are the
    keyed ops whose outputs reach ``key`` (through casts and data movement).
    """

    rows: tuple[OpDiagnosis, ...]
    plan: Plan
    loss: float | None
    shadow_loss: float | None
    producers: Mapping[OpKey, tuple[OpKey, ...]]

    @property
    def origins(self) -> tuple[OpKey, ...]:
        """The ops where non-finite values start (graph order)."""
        return tuple(row.key for row in self.rows if row.origin)

    @property
    def finite(self) -> bool:
        """True when the loss, every op output and every gradient (those passed to weights too) were finite."""
        return ((self.loss is None or math.isfinite(self.loss)) and not self.origins
                and not any(math.inf in (r.error, r.grad_error) for r in self.rows))

    def row(self, key: OpKey) -> OpDiagnosis:
        for row in self.rows:
            if row.key == key:
                return row
        raise KeyError(key)

    def table(self, limit: int | None = None, tablefmt: str = "simple") -> str:
        """The rows sorted by risk (the ``limit`` riskiest), as a text table."""
        rows = sorted(self.rows, key=lambda r: r.risk)[:limit]
        return tabulate([[str(r.key), r.precision, short_dtype_name(r.dtype) if r.dtype else "-",
                          _fraction(r.overflow), _fraction(r.grad_overflow), _fraction(r.underflow),
                          _fraction(r.grad_underflow), _number(r.error), _number(r.grad_error),
                          "yes" if r.origin else ""] for r in rows],
                        headers=["op key", "precision", "dtype", "overflow", "grad overflow", "underflow",
                                 "grad underflow", "rel. error", "grad rel. error", "origin"], tablefmt=tablefmt)

    def __str__(self) -> str:
        low = dtype_name(self.plan.low_dtype)
        return (f"{self.table()}\nloss {_number(self.loss)} (FP32 shadow {_number(self.shadow_loss)}); low dtype {low}; "
                f"origins: {', '.join(map(str, self.origins)) or 'none'}")


def _fraction(x: float | None) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.2%}")


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def diagnose(module: nn.Module, batch, *, loss_fn: LossFn | None = None, plan: Plan | None = None,
             low_dtype: torch.dtype | None = None) -> Diagnosis:
    """Run one forward and backward of ``module`` beside an FP32 shadow; say, per op, where precision hurts.

    Per op: overflow and underflow counts, the error of its output and gradient
    against the FP32 shadow of the same step, and the ops where NaN/inf start.
    The model, its gradients and buffers, any optimizer and the RNG are left
    bitwise unchanged.

    Args:
        module: a :class:`~compfx.planned_module.PlannedModule` (``compfx.apply``'s, ``optimize(...).module``),
            or a plain model, run under ``plan``.
        batch: what the training loop feeds: a tensor, a tuple ``(inputs..., target)`` or a dict of keyword
            arguments (see :func:`~compfx.batches.split_batch`).
        loss_fn: ``loss_fn(output, batch) -> loss``; default: the model's own ``output.loss``, else the sum of its
            floating outputs.
        plan: the plan to run a plain model under; default: ``Plan.amp`` in ``low_dtype`` ("where would AMP
            hurt?"). A PlannedModule runs its own plan.
        low_dtype: the precision of "low" ops for the default plan; default: float16 on CUDA, bfloat16 elsewhere.

    Returns:
        Diagnosis: one row per op in graph order (``.row(key)``), ``.origins`` (the ops where non-finite values
        start), ``.finite``, both losses; ``str(diagnosis)`` is a table sorted by risk.

    Raises:
        BadInputError: a ``loss_fn`` that is not callable; a batch the model cannot run in FP32; a PlannedModule
            given another ``plan=``; or a planned graph alone (``.graph_module``), without its model.
        PlanMismatchError: ``plan`` was made for another model.
        CaptureError: the model cannot be captured at the batch's inputs.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> with torch.no_grad(): _ = model[0].weight.fill_(0.5), model[1].weight.fill_(1e4)  # 1.6e6: beyond fp16
        >>> d = compfx.diagnose(model, torch.full((3, 4), 10.0), low_dtype=torch.float16)
        >>> d.origins, d.row(d.origins[0]).overflow > 0
        ((OpKey('1:linear#0'),), True)
    """
    loss_fn = loss_fn if loss_fn is not None else _default_loss
    if not callable(loss_fn):
        raise BadInputError(f"loss_fn={loss_fn!r}; expected a callable (output, batch) -> scalar tensor, or None.")
    model = module._model if isinstance(module, PlannedModule) else module
    if isinstance(model, nn.Module) and not (isinstance(model, fx.GraphModule) and "compfx_plan" in model.meta):
        # bad inputs (a meta-device model, integer batches for float layers) fail here, as a BadInputError, before
        # any work; the model, its buffers and the RNG are left as they were
        check_first_batch(model, batch, loss_fn, model_device(model), where="the batch, in FP32, before diagnose")
    planned = planned_module(module, batch, plan=plan, low_dtype=low_dtype)
    args, kwargs = split_batch(copied_batch(batch))  # a model may write its inputs: never the caller's tensors

    def from_loss(output):
        return [check_loss(loss_fn(output, batch))], None

    return diagnose_inputs(planned, args, kwargs, backward_from=from_loss)


def _default_loss(output, batch) -> torch.Tensor:
    try:
        return model_loss(output, batch)
    except BadInputError:
        leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not leaves:
            raise
        return sum(t.float().sum() for t in leaves)


def planned_module(module: nn.Module, batch, *, plan: Plan | None = None,
                   low_dtype: torch.dtype | None = None) -> PlannedModule:
    """``module`` itself when it is a :class:`PlannedModule`; else the model under ``plan`` (default ``Plan.amp``)."""
    if isinstance(module, PlannedModule):
        if plan is not None and plan != module.plan:
            raise BadInputError("diagnose() got a PlannedModule and another plan=; the module runs its own plan. "
                                "Drop plan=, or pass the plain model with plan=.")
        return module
    if not isinstance(module, nn.Module):
        raise BadInputError(f"diagnose() takes an nn.Module or a compfx PlannedModule; got {type(module).__name__}.")
    if isinstance(module, fx.GraphModule) and "compfx_plan" in module.meta:
        raise BadInputError("diagnose() got a planned graph (a PlannedModule's .graph_module); it needs the model "
                            "it came from to run the FP32 shadow. Pass the PlannedModule itself (what compfx.apply "
                            "returns) or the model with plan=.")
    args, kwargs = split_batch(batch)
    if plan is not None:
        low_dtype = plan.low_dtype
    analysis = analyze(module, kwargs if kwargs else args, low_dtype=low_dtype)
    return PlannedModule(module, plan if plan is not None else Plan.amp(analysis), analysis=analysis)


def diagnose_inputs(planned: PlannedModule, args: tuple, kwargs: dict, *,
                    backward_from: BackwardFrom | None = None) -> Diagnosis:
    """:func:`diagnose` on inputs already split; ``backward_from(output)`` gives what to differentiate (None: forward only).

    :class:`compfx.Guard` calls it with the gradient that reached the module's
    output in the training step, so the backward is the step's own.
    """
    graph = planned.specialize(args, kwargs)
    shadow_graph = shadow_graph_of(planned, args, kwargs)
    with untouched_state(planned._model) as replay:
        low = _record(graph, args, kwargs, backward_from)
        replay()
        fp32 = _record(shadow_graph, args, kwargs, _shadow_backward(backward_from, low))
    rows = tuple(_row(key, planned.plan, planned.plan.low_dtype, low, fp32) for key in low.keys)
    return Diagnosis(rows, planned.plan, low.loss, fp32.loss, low.producers)


def shadow_graph_of(planned: PlannedModule, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The model's own FP32 graph at these inputs (the capture the plan rewrites), sharing its Parameters."""
    modes = module_modes(planned._model)
    return planned.captures.get(planned.signature(args, kwargs), args, kwargs, modes)[0].graph_module


@contextmanager
def untouched_state(model: nn.Module, rng=None):
    """Run forwards inside that leave ``model``'s buffers and the RNG as they were; yields ``replay()``, which puts
    both back to where they were at entry (or the RNG to ``rng``, a :func:`rng_state`), so that the next run
    sees what the first saw (the same BatchNorm statistics, the same dropout masks)."""
    buffers = saved_values(model.buffers())
    with torch_rng_preserved(*model_devices(model)):
        start = rng if rng is not None else rng_state(model)

        def replay():
            restore_values(buffers)
            start.restore()

        if rng is not None:
            rng.restore()
        try:
            yield replay
        finally:
            restore_values(buffers)


def rng_state(model: nn.Module) -> RngState:
    """The CPU generator's state and those of ``model``'s CUDA devices (what :func:`untouched_state` replays)."""
    return RngState.now(*model_devices(model))


def _shadow_backward(backward_from: BackwardFrom | None, low: "_Run") -> BackwardFrom | None:
    """The shadow's backward starts from the same output gradients as the planned run's, when those were given."""
    if backward_from is None or low.start_grads is None:
        return backward_from
    start = [g.detach() for g in low.start_grads]

    def from_output(output):
        tensors, _ = backward_from(output)
        return tensors, [g.to(t.dtype) for g, t in zip(start, tensors)]
    return from_output


@dataclass
class _Run:
    """One interpreted run: each keyed op's output and the gradient reaching it, and where non-finite values start."""

    keys: list[OpKey]
    outputs: dict[OpKey, list[torch.Tensor]]
    grads: dict[OpKey, list[torch.Tensor | None]]
    origins: set[OpKey]
    producers: dict[OpKey, tuple[OpKey, ...]]
    loss: float | None
    start_grads: list[torch.Tensor] | None


class _Recorder(fx.Interpreter):
    """Runs a graph node by node, keeping every node's value (detached copies are not needed: nothing is in place
    after a keyed op in the graphs compfx captures, and the values are read before the next step)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, node: fx.Node) -> Any:
        value = super().run_node(node)
        self.values[node] = value
        return value


def _record(gm: fx.GraphModule, args: tuple, kwargs: dict, backward_from: BackwardFrom | None) -> _Run:
    interpreter = _Recorder(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    grad_on = torch.is_grad_enabled() and backward_from is not None
    with torch.set_grad_enabled(grad_on):
        output = interpreter.run(*_bind(gm, placeholders, args, kwargs))
    keyed = [n for n in gm.graph.nodes if KEY_META in n.meta]
    values = interpreter.values
    outputs = {n.meta[KEY_META]: _floats(values[_sliced_back(n)]) for n in keyed}
    producers = {n.meta[KEY_META]: tuple(p.meta[KEY_META] for p in _sources(n) if KEY_META in p.meta) for n in keyed}
    origins = {n.meta[KEY_META] for n in keyed
               if not _all_finite(outputs[n.meta[KEY_META]])
               and all(_all_finite(_floats(values.get(s))) for s in _sources(n))}
    grads: dict[OpKey, list] = {}
    loss, start = None, None
    if backward_from is not None:
        tensors, start = backward_from(output)
        if start is None:  # differentiating a loss: report it
            loss = float(tensors[0].detach().float().sum())
        if grad_on:
            grads, origins_back = _backward(keyed, values, outputs, tensors, start)
            if not origins:  # after a forward overflow every gradient is meaningless
                origins |= origins_back
    return _Run([n.meta[KEY_META] for n in keyed], outputs, grads, origins, producers, loss, start)


def _sliced_back(node: fx.Node) -> fx.Node:
    """The node holding ``node``'s output as the model sees it: a padded op's is its last slice (the FP32 shadow
    is not padded, so that is what compares)."""
    while len(node.users) == 1 and next(iter(node.users)).meta.get(PAD_META) == "result":
        node = next(iter(node.users))
    return node


def _bind(gm: fx.GraphModule, placeholders: list[fx.Node], args: tuple, kwargs: dict) -> list:
    """The placeholder values for ``gm.forward(*args, **kwargs)``, in placeholder order, bound as its generated
    code binds them: through the input spec of a recorded or exported graph, by name for a traced one."""
    codegen = gm.graph._codegen
    if isinstance(codegen, _PyTreeCodeGen) and codegen.pytree_info is not None:
        return fx_pytree.tree_flatten_spec((list(args), kwargs), codegen.pytree_info.in_spec)
    if not kwargs:
        return list(args)
    _LazyGraphModule.force_recompile(gm)  # until then its forward is (*args, **kwargs)
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return [bound.arguments[p.target] if p.target in bound.arguments else p.args[0] for p in placeholders]


def _floats(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(dense_values(t)).all()) for t in tensors)


def _sources(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node``'s value is computed from: keyed producers, inputs and attributes, found through
    casts and data movement (nodes without an OpKey)."""
    found, seen, todo = [], set(), list(node.all_input_nodes)
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if KEY_META in current.meta or current.op in ("placeholder", "get_attr"):
            found.append(current)
        else:
            todo.extend(current.all_input_nodes)
    return found


def _backward(keyed: list[fx.Node], values: dict, outputs: dict, tensors: list[torch.Tensor],
              start: list[torch.Tensor] | None) -> tuple[dict, set]:
    """The gradient reaching each keyed op's outputs, and the ops whose backward first turns them non-finite."""
    wanted: dict[int, torch.Tensor] = {}
    for node in keyed:
        for t in outputs[node.meta[KEY_META]]:
            if t.requires_grad:
                wanted.setdefault(id(t), t)
        for source in node.all_input_nodes:  # the inputs it hands gradients to (its per-use casts, mostly)
            for t in _floats(values.get(source)):
                if t.requires_grad:
                    wanted.setdefault(id(t), t)
    differentiable = [t for t in tensors if t.requires_grad]
    if not differentiable or not wanted:
        return {}, set()
    computed = torch.autograd.grad(differentiable, list(wanted.values()),
                                   grad_outputs=start if start is not None else None, allow_unused=True)
    grad_of = dict(zip(wanted, computed))
    grads = {node.meta[KEY_META]: [grad_of.get(id(t)) for t in outputs[node.meta[KEY_META]]] for node in keyed}
    origins = set()
    for node in keyed:
        reaching = [g for g in grads[node.meta[KEY_META]] if g is not None]
        passed = [grad_of.get(id(t)) for s in node.all_input_nodes for t in _floats(values.get(s))]
        passed = [g for g in passed if g is not None]
        if reaching and _all_finite(reaching) and not _all_finite(passed):
            origins.add(node.meta[KEY_META])
    return grads, origins


def _row(key: OpKey, plan: Plan, low_dtype: torch.dtype, low: _Run, fp32: _Run) -> OpDiagnosis:
    outputs, shadows = low.outputs[key], fp32.outputs.get(key, [])
    precision = plan.get(key, Precision.FOLLOW)
    if not outputs:
        return OpDiagnosis(key, precision, None, None, None, None, origin=key in low.origins)
    overflow, underflow, error = _compare(outputs, shadows, low_dtype)
    grads = [g for g in low.grads.get(key, []) if g is not None]
    shadow_grads = [g for g in fp32.grads.get(key, []) if g is not None]
    grad_stats = _compare(grads, shadow_grads, low_dtype) if grads else (None, None, None)
    return OpDiagnosis(key, precision, outputs[0].dtype, overflow, underflow, error, *grad_stats,
                       origin=key in low.origins)


@torch.no_grad()
def _compare(values: list[torch.Tensor], shadows: list[torch.Tensor], low_dtype: torch.dtype):
    """(overflow, underflow, relative error) of ``values`` against ``shadows``, over all their elements."""
    limit = torch.finfo(low_dtype).max
    count = sum(t.numel() for t in values) or 1
    overflow = sum(int((~torch.isfinite(t) | (t.abs() > limit)).sum()) for t in values) / count
    paired = [(t, s) for t, s in zip(values, shadows) if t.shape == s.shape]
    if len(paired) != len(values) or not paired:
        return overflow, None, None
    underflow = sum(int(((t == 0) & (s != 0)).sum()) for t, s in paired) / count
    if not _all_finite(values):
        return overflow, underflow, math.inf
    if not _all_finite(shadows):
        return overflow, underflow, math.nan
    difference = math.sqrt(sum(float(torch.linalg.vector_norm(t.double() - s.double())) ** 2 for t, s in paired))
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(s.double())) ** 2 for _, s in paired))
    return overflow, underflow, difference / norm if norm > 0 else difference
