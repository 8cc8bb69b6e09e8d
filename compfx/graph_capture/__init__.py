"""Stage 1 of the pipeline: model -> functional FX graph with an OpKey on every numerical op.

:func:`capture` with ``method="auto"`` tries three tracers, in this order:

* **symbolic** (``symbolic.py``): ``torch.fx`` tracing that goes *through*
  built-in ``torch.nn`` modules (``nn.Linear`` becomes ``F.linear`` reading its
  parameters with ``get_attr``), with a FakeTensor value on every proxy so that
  Python checks and shape-driven branches resolve the way the example inputs
  take them. Its graphs compute shapes at run time; ``leaf_modules`` keeps
  chosen modules as one op.
* **record** (``record.py``): runs ``forward`` on FakeTensors under a
  ``TorchFunctionMode`` and writes every torch call into the graph. The model's
  own Python runs as in eager, so Hugging Face models land here, in a fraction
  of dynamo's time.
* **dynamo** (``dynamo.py``): ``torch._dynamo.export``, for what the other two
  cannot follow; its parameters are re-pointed at the model's own FQNs so its
  graph looks like theirs.

A branch on tensor values ends capture at once, with no fallback, since no
tracer can put both sides of it in one graph; so do wrong example inputs (the
model fails on them in eager too), with :class:`~compfx.errors.BadInputError`.
Every graph is specialised to the model's train/eval mode and to the branches
the example inputs take.

Every captured graph carries, whichever tracer made it:

* ``meta["val"]`` on every node (a FakeTensor or Python value) and
  ``meta["tensor_meta"]`` (shape, dtype) on tensor nodes;
* ``meta["compfx_key"]`` (``opkey.KEY_META``), an :class:`~compfx.opkey.OpKey`,
  on every numerical op (``nodes.py``: :func:`is_numerical_op`);
* ``gm.meta["compfx_capture_method"]``: the tracer that made it;
* ``meta["compfx_dtype_limits"]`` on calls that take a ``torch.finfo`` limit of
  their result's dtype as a literal (``dtype_limits.py``), so that the literal
  can follow the dtype a plan gives that result;
* the model's own ``torch.autocast`` blocks as ``_enter_autocast`` /
  ``_exit_autocast`` nodes, and ``meta["compfx_pinned"]`` on the ops of its
  ``enabled=False`` blocks (``autocast_blocks.py``);
* on a recorded graph, ``meta["compfx_dtype_read"]`` on each activation whose
  dtype the model's Python read (``dtype_reads.py``): that dtype is a constant
  of the graph, and :func:`changed_dtype_reads` names those a plan changes.

Recorded and dynamo graphs are specialised to the example inputs and check
them first (``signature.py``: :func:`check_input_shapes`, :func:`input_signature`).
Capture leaves the model as it found it: same mode, same parameters, same
buffers (``model_state.py``). Graphs that ``torch.compile`` hands a backend are
keyed the same way with :func:`key_dynamo_graph`. ``_sites.py`` finds the line
of the user's code that a failure names.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..batches import model_devices
from ..errors import BadInputError, CaptureError
from ..opkey import assign_op_keys
from ..state import buffers_restored, rng_preserved, torch_rng_preserved
from ._sites import ValueBranchError, error_site, first_line, reads_a_value
from .autocast_blocks import (PINNED_META, AutocastRefusedError, autocast_probe, holds_half_precision, is_pinned,
                              mark_pinned)
from .dtype_limits import LIMIT_META, mark_dtype_limits
from .dtype_reads import DTYPE_READ_META, changed_dtype_reads
from .held_state import HeldState
from .dynamo import CAPTURE_DEFAULTS, capture_defaults, dynamo_capture, key_dynamo_graph
from .model_state import (get_attribute, hooks_warning, named_tensors, stored_attributes_warning,
                          tracer_values_removed)
from .nodes import (
    DATA_MOVEMENT_KINDS,
    complete_metadata,
    has_side_effects,
    is_data_movement,
    is_in_place,
    is_numerical_op,
    meta_value,
    op_nodes,
    produces_float,
    renorms_weight,
    writes_input,
)
from .checkpoints import inline_checkpoint_bodies, keep_checkpoints, outline_checkpoint_regions
from .record import is_kv_cache, record_capture, with_kv_caches_copied
from .signature import (
    ExampleInputs,
    check_input_shapes,
    describe_inputs,
    distinct_input_tensors,
    input_signature,
    modes_of,
    module_modes,
    normalize_example_inputs,
    with_input_check,
)
from .symbolic import reads_its_state_in_python, symbolic_capture
from .verify import VERIFICATION_META, CaptureVerification, verify_capture


__all__ = [
    "capture",
    "keep_checkpoints",
    "inline_checkpoint_bodies",
    "outline_checkpoint_regions",
    "CaptureVerification",
    "VERIFICATION_META",
    "CAPTURE_METHODS",
    "CAPTURE_DEFAULTS",
    "capture_defaults",
    "is_kv_cache",
    "check_input_shapes",
    "input_signature",
    "modes_of",
    "describe_inputs",
    "module_modes",
    "reads_its_state_in_python",
    "key_dynamo_graph",
    "distinct_input_tensors",
    "normalize_example_inputs",
    "ExampleInputs",
    "DATA_MOVEMENT_KINDS",
    "is_data_movement",
    "is_in_place",
    "renorms_weight",
    "writes_input",
    "has_side_effects",
    "is_numerical_op",
    "produces_float",
    "op_nodes",
    "meta_value",
    "get_attribute",
    "named_tensors",
    "mark_dtype_limits",
    "LIMIT_META",
    "mark_pinned",
    "is_pinned",
    "PINNED_META",
    "changed_dtype_reads",
    "DTYPE_READ_META",
]


#: What ``capture(method=...)`` takes; ``"auto"`` tries the other three in this order.
CAPTURE_METHODS = ("auto", "symbolic", "record", "dynamo")


def capture(
    model: nn.Module,
    example_inputs,
    *,
    leaf_modules: Iterable[type | str] = (),
    method: str = "auto",
    modes: Mapping[str, bool] | None = None,
    verify: bool = False,
) -> fx.GraphModule:
    """Trace ``model`` to a functional FX graph; every numerical op gets an OpKey.

    The graph is specialised to the model's train/eval mode and to the branches
    the example inputs take. Recorded and dynamo graphs are specialised to the
    example inputs' shapes too and check them when called
    (:func:`check_input_shapes`); a :class:`compfx.PlannedModule` captures again
    per input signature. A Hugging Face KV cache in the output comes back as
    ``None`` (:func:`is_kv_cache`); the dynamo fallback passes
    ``use_cache=False`` where ``forward`` takes it and the inputs do not set it
    (:data:`CAPTURE_DEFAULTS`). The model's own modes are put back afterwards,
    whatever happens. :func:`compfx.analyze` (and so ``optimize``, ``apply`` and
    the callbacks) captures and verifies; call this for the graph alone.

    Args:
        model: the ``nn.Module`` to trace.
        example_inputs: a tensor, a tuple of positional arguments, a dict of keyword arguments, or
            ``(args, kwargs)``.
        leaf_modules: module types or qualified names kept as one ``call_module`` op (symbolic tracing only).
        method: ``"auto"`` (symbolic, then record, then dynamo), ``"symbolic"`` (``torch.fx`` proxies with
            FakeTensor values; its graphs compute shapes at run time), ``"record"`` (forward run on FakeTensors,
            every torch call written down: Hugging Face models land here) or ``"dynamo"``
            (``torch._dynamo.export``).
        modes: module path -> training: capture in those train/eval modes instead of the current ones
            (:func:`module_modes`).
        verify: check each tracer's graph against the model before taking it
            (:func:`~compfx.graph_capture.verify.verify_capture`: outputs, every gradient and the tensors saved
            for backward, compared bitwise); an unfaithful graph is passed over for the next tracer. The result is
            in ``gm.meta["compfx_capture_verification"]``.

    Returns:
        torch.fx.GraphModule: the graph, sharing the model's Parameters and buffers, with ``meta["val"]`` on
        every node, an :class:`~compfx.opkey.OpKey` in ``meta["compfx_key"]`` on every numerical op
        (:func:`op_nodes` lists them) and the tracer in ``gm.meta["compfx_capture_method"]``.

    Raises:
        BadInputError: the example inputs do not fit the model (it fails on them in eager too), or an unknown
            ``method``.
        CaptureError: no tracer captures the model (or, with ``verify``, none faithfully); the message names the
            line of the model's code, or the first output or parameter that differs.

    Example::

        >>> import torch, compfx
        >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
        >>> [str(n.meta["compfx_key"]) for n in compfx.graph_capture.op_nodes(gm)]
        ['0:linear#0', '1:relu#0']
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"capture() takes an nn.Module; got {type(model).__name__}.")
    if method not in CAPTURE_METHODS:
        raise BadInputError(f"method={method!r}; expected one of {', '.join(map(repr, CAPTURE_METHODS))}.")
    args, kwargs = distinct_input_tensors(*normalize_example_inputs(example_inputs))  # one input, one placeholder
    # rng_preserved: a forward that draws random numbers, or reseeds, leaves the caller's generators as they were;
    # _ONE_AT_A_TIME: the tracers patch process-wide state, which two captures at once would leave patched
    with _ONE_AT_A_TIME, _modes_restored(model), _fake_tensor_failures_quiet(), rng_preserved(*model_devices(model)):
        if modes is not None:
            for name, module in model.named_modules():
                module.training = modes.get(name, module.training)
        held = HeldState(model)  # the eager runs (verification, the failure check) are forward calls too
        try:
            gm = _capture_with(model, args, kwargs, leaf_modules, method, verify)
        except Exception as error:
            _refuse_replaced_modules(held, error)
            raise
        _refuse_replaced_modules(held)
    hooks = hooks_warning(model, leaves={n.target for n in gm.graph.nodes if n.op == "call_module"})
    if hooks:
        warnings.warn(hooks, stacklevel=2)
    assign_op_keys(gm, include=is_numerical_op)
    mark_dtype_limits(gm)
    mark_pinned(gm)
    return gm


#: Captures take turns, in every thread. torch.fx's symbolic tracer replaces ``nn.Module.__call__`` and
#: ``__getattr__`` while it traces, and compfx's tracers swap ``torch.autograd.Function.apply`` and register global
#: module hooks (each passes other threads' calls through untouched); two traces at once would each put back what
#: the other had patched, leaving every later module call of the process going to a finished tracer. Reentrant: a
#: capture inside a capture (a planned block captured while its model runs under a tracer) is one thread's.
_ONE_AT_A_TIME = threading.RLock()


#: The tracers ``method="auto"`` tries, in order.
_TRACERS = ("symbolic", "record", "dynamo")


def _capture_with(model, args, kwargs, leaf_modules, method, verify) -> fx.GraphModule:
    """The method choice: each tracer ``method`` allows, in order, until one gives a graph (that, with ``verify``,
    trains exactly as the model does: :func:`~compfx.graph_capture.verify.verify_capture`)."""
    attempts = _Attempts(model)
    device_type = _probed_device_type(model, args, kwargs)  # the model's own autocast blocks open under a probe
    for tracer in _TRACERS if method == "auto" else (method,):
        if tracer != "symbolic" and tuple(leaf_modules):
            warnings.warn(
                f"compfx captures {type(model).__name__} by running it (recording, or dynamo), which inlines every "
                "module: leaf_modules is ignored and those modules' ops get keys of their own.",
                stacklevel=4,
            )
            leaf_modules = ()
        try:
            # a KV cache passed in is written by the run: each tracer writes into a copy of its own
            gm = _trace(tracer, model, *with_kv_caches_copied((args, kwargs)), leaf_modules, device_type)
        except BadInputError:
            raise
        except ValueBranchError as error:
            # No tracer can make one graph of it; our message names the line.
            raise CaptureError(str(error)) from error.__cause__
        except Exception as error:  # noqa: BLE001 - dynamo fails with anything; the others with CaptureError
            if tracer == "record" or (tracer == method and tracer == "symbolic"):
                _check_runs_eagerly(model, args, kwargs, error)  # wrong example inputs: say so, skip dynamo
            attempts.failed(tracer, error)
            continue
        if verify:
            verification = verify_capture(model, gm, args, kwargs, method=tracer)
            gm.meta[VERIFICATION_META] = verification
            if not verification.faithful:
                attempts.unfaithful(verification)
                continue
            if verification.notes:  # where bitwise equality could not be checked, say so
                warnings.warn(f"compfx: {verification.summary()}", stacklevel=4)
        return gm
    raise attempts.error() from attempts.cause()


def _trace(tracer: str, model, args, kwargs, leaf_modules, device_type: str | None) -> fx.GraphModule:
    held = HeldState(model)
    try:
        with tracer_values_removed(model) as stored:  # what forward assigned to the model while tracing is the tracer's
            gm = _trace_with(tracer, model, args, kwargs, leaf_modules, device_type)
    except Exception as error:
        _refuse_replaced_modules(held, error)  # what the tracer failed on, when that is it
        raise
    _refuse_replaced_modules(held)
    if stored:
        warnings.warn(stored_attributes_warning(stored), stacklevel=5)
    return gm


def _refuse_replaced_modules(held: HeldState, cause: BaseException | None = None) -> None:
    """A forward that replaced submodules while it was traced: they are put back (the new ones hold the tracer's
    values), and the capture refused, saying so."""
    replaced = () if held.unchanged() else held.change().modules
    if replaced:
        held.put_back_modules()
        raise CaptureError(f"forward() replaces submodules of the model when it runs ({', '.join(replaced[:3])}); a "
                           "graph cannot hold that, and the new layers would not be the ones the optimizer trains. "
                           "Create submodules in __init__ and only call them in forward") from cause


def _trace_with(tracer: str, model, args, kwargs, leaf_modules, device_type: str | None) -> fx.GraphModule:
    if tracer == "symbolic":
        gm = keep_checkpoints(_as_under_autocast(lambda: symbolic_capture(model, args, kwargs, leaf_modules),
                                                 device_type))
    elif tracer == "record":
        gm = with_input_check(keep_checkpoints(_as_under_autocast(lambda: record_capture(model, args, kwargs),
                                                                  device_type)))
    else:
        gm = with_input_check(dynamo_capture(model, args, kwargs))
    gm.meta["compfx_capture_method"] = tracer
    missing = complete_metadata(gm)
    if missing:
        raise CaptureError(
            f"{tracer} capture left no example value on {', '.join(n.name for n in missing[:5])}; compfx needs "
            "shapes and dtypes on every node")
    return gm


#: What to do when no tracer captured the model, unless the failure that got furthest knows better (``advice``).
_CAPTURE_ADVICE = ("Check that forward() runs on the example inputs, replace branches on tensor values with torch.where, "
                   "or keep the offending submodule opaque with capture(..., leaf_modules=[...]).")


class _Attempts:
    """What each tracer gave, for the error when none gave a faithful graph."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.tried: list[str] = []
        self.failures: list[tuple[str, str, tuple[bool, int]]] = []  # (tracer, what happened, how far it got)
        self.errors: list[BaseException] = []
        self.mismatches: list[CaptureVerification] = []

    def failed(self, tracer: str, error: BaseException) -> None:
        self.tried.append(tracer)
        text = str(error) if isinstance(error, CaptureError) else (
            f"dynamo export failed with {first_line(error)} at {error_site(error)}")
        self.failures.append((tracer, text, (reads_a_value(error), getattr(error, "progress", None) or 0)))
        self.errors.append(error)

    def unfaithful(self, verification: CaptureVerification) -> None:
        self.tried.append(verification.method)
        self.mismatches.append(verification)

    def _furthest_first(self) -> list[int]:
        return sorted(range(len(self.failures)), key=lambda i: self.failures[i][2], reverse=True)

    def cause(self) -> BaseException | None:
        """The exception behind the error's lead (None when it is a graph that trains differently)."""
        return None if self.mismatches else self.errors[self._furthest_first()[0]]

    def error(self) -> CaptureError:
        """One line: what blocked capture (the first graph that trains differently, else the failure of the
        tracer that got furthest, a read of a tensor's value first), which tracers were tried, what to do."""
        name, tried = type(self.model).__name__, ", ".join(self.tried)
        others = [f"{tracer}: {text}" for tracer, text, _ in self.failures]
        if self.mismatches:
            first, *rest = self.mismatches
            same = [tracer for tracer, text, _ in self.failures if text == first.mismatch]
            others = [m.summary() for m in rest] + [f"{tracer}: {text}" for tracer, text, _ in self.failures
                                                    if text != first.mismatch]
            return CaptureError(
                f"compfx could not capture {name} faithfully (tried {tried}): the {first.method} graph would train "
                f"differently from the model: {first.mismatch}. compfx does not plan a graph that changes what "
                "training computes; rewrite that part of forward() (gradient hooks on intermediate tensors and "
                "saved-tensor hooks are not captured), or report this model."
                + (f" {' and '.join(same)} failed the same way." if same else "")
                + (f" Other tracers: {'; '.join(others)}." if others else ""))
        order = self._furthest_first()
        lead = self.failures[order[0]]
        same = [self.failures[i][0] for i in order[1:] if self.failures[i][1] == lead[1]]
        rest = [others[i] for i in order[1:] if self.failures[i][1] != lead[1]]
        advice = getattr(self.errors[order[0]], "advice", _CAPTURE_ADVICE)
        return CaptureError(
            f"compfx could not capture {name} as one FX graph (tried {tried})"
            f"{f'; {lead[0]} got furthest' if len(self.failures) > 1 else ''}: {lead[1]}."
            + (f" {advice}" if advice else "")
            + (f" {' and '.join(same)} failed the same way." if same else "")
            + (f" Other tracers: {'; '.join(rest)}." if rest else ""))


def _as_under_autocast(trace, device_type: str | None) -> fx.GraphModule:
    """``trace()`` with autocast on at FP32 for the model's device (``autocast_blocks.autocast_probe``), so the
    model opens the ``autocast(enabled=False)`` blocks it opens under the user's autocast; again without it
    when the graph holds half-precision values (FP32 autocast may have cast them) or autocast refused an op.
    No device type: no probe."""
    if device_type is None:
        return trace()
    try:
        with autocast_probe(device_type):
            gm = trace()
    except AutocastRefusedError:  # CUDA autocast refuses binary_cross_entropy
        return trace()
    return trace() if holds_half_precision(gm) else gm


def _probed_device_type(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """The device type to capture under FP32 autocast: the parameters', else the inputs', else ``"cpu"``; None
    (no probe) in eval mode, where torch.nn's inference fast paths switch off whenever autocast is on, and for a
    model or inputs holding half-precision tensors, which FP32 autocast would cast."""
    tensors = [t for t in (*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs)))
               if isinstance(t, torch.Tensor)]
    if not model.training or any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors):
        return None
    return tensors[0].device.type if tensors else "cpu"


@contextlib.contextmanager
def _modes_restored(model: nn.Module):
    """Whatever a tracer does, the user's modules keep their train/eval mode."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


class _DropFailedMetaTracebacks(logging.Filter):
    """Drops FakeTensor's "failed while attempting to run meta for ..." records, each a full traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _fake_tensor_failures_quiet():
    """While capturing, an op whose shapes do not fit makes FakeTensor log its traceback to stderr
    (dozens of ``fake_tensor.py`` lines); compfx reports that failure itself, once, in its error."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    dropper = _DropFailedMetaTracebacks()
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)


def _check_runs_eagerly(model: nn.Module, args: tuple, kwargs: dict, capture_error: Exception) -> None:
    """After a capture failure: if ``model`` fails on the example inputs in plain eager mode too, the inputs are
    wrong (shape, dtype, device), not the tracing; raise :class:`BadInputError` saying so. Changes nothing."""
    try:
        inputs = [t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with torch.no_grad(), torch_rng_preserved(*model_devices(model), *inputs), buffers_restored(model), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure here is the inputs' (or the model's own)
        described = ", ".join(f"{type(v).__name__}{tuple(v.shape)}:{v.dtype}:{v.device}" if isinstance(v, torch.Tensor)
                              else type(v).__name__ for v in pytree.tree_leaves((args, kwargs)))[:300]
        raise BadInputError(
            f"{type(model).__name__} fails on the example inputs even without compfx ({first_line(error)}); they "
            f"were {described}. Give example inputs that forward() accepts (the shapes, dtypes and device of a real "
            "batch).") from capture_error
