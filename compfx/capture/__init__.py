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
import warnings
from typing import Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from ..errors import BadInputError, CaptureError
from ..opkey import assign_op_keys
from ._sites import ValueBranchError, error_site, first_line
from .autocast_blocks import PINNED_META, autocast_probe, holds_half_precision, is_pinned, mark_pinned
from .dtype_limits import LIMIT_META, mark_dtype_limits
from .dtype_reads import DTYPE_READ_META, changed_dtype_reads
from .dynamo import CAPTURE_DEFAULTS, capture_defaults, dynamo_capture, key_dynamo_graph
from .model_state import buffers_restored, get_attribute, named_tensors
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
    writes_input,
)
from .record import is_kv_cache, record_capture
from .signature import (
    ExampleInputs,
    check_input_shapes,
    describe_inputs,
    input_signature,
    module_modes,
    normalize_example_inputs,
    with_input_check,
)
from .symbolic import reads_its_state_in_python, symbolic_capture


__all__ = [
    "capture",
    "CAPTURE_METHODS",
    "CAPTURE_DEFAULTS",
    "capture_defaults",
    "is_kv_cache",
    "check_input_shapes",
    "input_signature",
    "describe_inputs",
    "module_modes",
    "reads_its_state_in_python",
    "key_dynamo_graph",
    "buffers_restored",
    "normalize_example_inputs",
    "ExampleInputs",
    "DATA_MOVEMENT_KINDS",
    "is_data_movement",
    "is_in_place",
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
) -> fx.GraphModule:
    """Trace ``model`` to a functional FX graph; every numerical op gets an OpKey.

    ``method`` is ``"auto"`` (symbolic, then record, then dynamo),
    ``"symbolic"``, ``"record"`` or ``"dynamo"``. *Symbolic* tracing follows
    the code with proxies; its graphs compute shapes at run time. *Record* runs
    forward on FakeTensors and writes down every torch call (Hugging Face models
    land here: their Python runs as is, in a fraction of dynamo's time);
    *dynamo* is ``torch._dynamo.export``. Recorded and dynamo graphs are
    specialised to the example inputs' shapes and check them when called
    (:func:`check_input_shapes`); :class:`compfx.apply.PlannedModule` re-captures
    per input signature. ``leaf_modules`` names module types or qualified names
    that stay as one ``call_module`` op (symbolic capture only). The graph is
    specialised to the model's current train/eval mode and to the branches the
    example inputs take. A Hugging Face KV cache in the output comes back as
    ``None`` (:func:`is_kv_cache`); the dynamo fallback passes ``use_cache=False``
    where ``forward`` takes it and the inputs do not set it (:data:`CAPTURE_DEFAULTS`).
    ``modes`` (module path -> training) captures with those train/eval modes
    instead of the current ones (:func:`module_modes`); the model's own modes
    are put back afterwards, whatever happens.

    >>> import torch, compfx
    >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
    >>> [str(n.meta["compfx_key"]) for n in compfx.op_nodes(gm)]
    ['0:linear#0', '1:relu#0']
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"capture() takes an nn.Module; got {type(model).__name__}.")
    if method not in CAPTURE_METHODS:
        raise BadInputError(f"method={method!r}; expected one of {', '.join(map(repr, CAPTURE_METHODS))}.")
    args, kwargs = normalize_example_inputs(example_inputs)
    with _modes_restored(model), _fake_tensor_failures_quiet():
        if modes is not None:
            for name, module in model.named_modules():
                module.training = modes.get(name, module.training)
        gm = _capture_with(model, args, kwargs, leaf_modules, method)
    missing = complete_metadata(gm)
    if missing:
        raise CaptureError(
            f"{gm.meta['compfx_capture_method']} capture left no example value on "
            f"{', '.join(n.name for n in missing[:5])}; compfx needs shapes and dtypes on every node. "
            "Try the other method= or report this model."
        )
    assign_op_keys(gm, include=is_numerical_op)
    mark_dtype_limits(gm)
    mark_pinned(gm)
    return gm


def _capture_with(model, args, kwargs, leaf_modules, method) -> fx.GraphModule:
    """The method choice: each tracer ``method`` allows, in order, until one gives a graph."""
    failures: list[str] = []
    device_type = _probed_device_type(model, args, kwargs)
    if method in ("auto", "symbolic"):
        try:
            gm = _as_under_autocast(lambda: symbolic_capture(model, args, kwargs, leaf_modules), device_type)
            gm.meta["compfx_capture_method"] = "symbolic"
            return gm
        except BadInputError:
            raise
        except ValueBranchError as error:
            # No tracer can make one graph of it; our message names the line.
            raise CaptureError(str(error)) from error.__cause__
        except CaptureError as error:
            if method == "symbolic":
                _check_runs_eagerly(model, args, kwargs, error)  # wrong example inputs: say so
                raise CaptureError(_capture_advice(model, [str(error)])) from error
            failures.append(str(error))
    if tuple(leaf_modules):
        warnings.warn(
            f"compfx captures {type(model).__name__} by running it (recording, or dynamo), which inlines every "
            "module: leaf_modules is ignored and those modules' ops get keys of their own.",
            stacklevel=3,
        )
    if method in ("auto", "record"):
        try:
            gm = _as_under_autocast(lambda: record_capture(model, args, kwargs), device_type)
            gm.meta["compfx_capture_method"] = "record"
            return with_input_check(gm)
        except ValueBranchError as error:
            raise CaptureError(str(error)) from error.__cause__
        except CaptureError as error:
            _check_runs_eagerly(model, args, kwargs, error)  # wrong example inputs: say so, skip dynamo
            if method == "record":
                raise CaptureError(_capture_advice(model, [str(error)])) from error
            failures.append(str(error))
    try:
        gm = dynamo_capture(model, args, kwargs)
    except Exception as error:
        failures.append(f"dynamo export failed with {first_line(error)} at {error_site(error)}")
        raise CaptureError(_capture_advice(model, failures)) from error
    gm.meta["compfx_capture_method"] = "dynamo"
    return with_input_check(gm)


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
    except CaptureError as error:
        if "unsafe to autocast" not in str(error):  # CUDA autocast refuses binary_cross_entropy
            raise
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
        cuda = sorted({t.device.index or 0 for t in (*model.parameters(), *pytree.tree_leaves((args, kwargs)))
                       if isinstance(t, torch.Tensor) and t.is_cuda})
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), buffers_restored(model), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure here is the inputs' (or the model's own)
        described = ", ".join(f"{type(v).__name__}{tuple(v.shape)}:{v.dtype}:{v.device}" if isinstance(v, torch.Tensor)
                              else type(v).__name__ for v in pytree.tree_leaves((args, kwargs)))[:300]
        raise BadInputError(
            f"{type(model).__name__} fails on the example inputs even without compfx ({first_line(error)}); they "
            f"were {described}. Give example inputs that forward() accepts (the shapes, dtypes and device of a real "
            "batch).") from capture_error


def _capture_advice(model: nn.Module, failures: list[str]) -> str:
    return (
        f"compfx could not capture {type(model).__name__} as one FX graph: {'; '.join(failures)}. "
        "Check that forward() runs on the example inputs, replace branches on tensor values with "
        "torch.where, or keep the offending submodule opaque with capture(..., leaf_modules=[...])."
    )
