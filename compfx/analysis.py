"""Stage 2 of the pipeline: classify every captured op and check Tensor Core eligibility.

:func:`analyze` captures the model and returns an :class:`Analysis`: one
:class:`OpInfo` per op that carries a precision bit, in graph order. Data
movement (view, permute, getitem, cat, ...) carries none: it follows its input.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
from tabulate import tabulate
from torch.utils import _pytree as pytree

from .graph_capture import (VERIFICATION_META, capture, get_attribute, input_signature, is_pinned, module_modes,
                            modes_of, normalize_example_inputs, op_nodes)
from .batches import model_device
from .graph_capture.functions import FunctionCall
from .errors import BadInputError
from .float8 import fp8_eligible
from .opkey import KEY_META, OpKey
from .oplists import classify
from .tensor_cores import pad_eligible, tc_eligible
from .vocabulary import Category, check_low_dtype, default_low_dtype, dtype_name

__all__ = ["OpInfo", "Analysis", "analyze", "analyze_graph", "fingerprint_of", "parameter_shapes", "describe_op",
           "category_label", "check_device", "check_capability"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpInfo:
    """What the analysis knows about one operator."""

    key: OpKey
    category: Category
    tc_eligible: bool
    reason: str
    input_shapes: tuple[Shape, ...]
    output_shapes: tuple[Shape, ...]
    #: Can it run FP8 (:mod:`compfx.float8`)? Only set by ``analyze(..., fp8=True)``; the search decides "should".
    fp8_eligible: bool = False
    fp8_reason: str = "FP8 not analysed (analyze(..., fp8=True))"
    #: Does the op miss the Tensor Core rule for the low dtype, in a way zero-padding would fix
    #: (:func:`compfx.tensor_cores.pad_eligible`)? Judged from shapes on any device; the search decides "should".
    pad_eligible: bool = False
    pad_reason: str = ""
    #: Inside one of the model's ``torch.autocast(enabled=False)`` blocks (:mod:`compfx.graph_capture.autocast_blocks`):
    #: ``Plan.amp`` runs it in FP32, and the search leaves it there unless ``SearchConfig(search_pinned=True)``.
    pinned: bool = False

    @property
    def kind(self) -> str:
        return self.key.kind

    @property
    def adjustable_in_stage1(self) -> bool:
        """CoMP Stage 1 tries this op at both precisions (blacklist, or whitelist without TC), unless it is pinned."""
        return not self.pinned and (self.category is Category.BLACKLIST
                                    or (self.category is Category.WHITELIST and not self.tc_eligible))


def fingerprint_of(keys) -> str:
    """The fingerprint of a graph whose ops carry ``keys``, in order (what :attr:`Analysis.fingerprint` is)."""
    return hashlib.sha256("\n".join(map(str, keys)).encode()).hexdigest()[:16]


def parameter_shapes(gm: fx.GraphModule, example_inputs=()) -> list[list[int]]:
    """The distinct shapes of the parameters a graph reads, sorted: what tells apart two models whose ops are
    named alike (the same layers at other widths). Parameters are ``get_attr`` nodes in compfx's captures and
    graph inputs (``example_inputs``) in the graphs ``torch.compile`` hands a backend.

    >>> import torch, compfx
    >>> a = compfx.analyze(torch.nn.Linear(4, 8), torch.randn(2, 4))
    >>> parameter_shapes(a.graph_module)
    [[8], [8, 4]]
    """
    found = {tuple(t.shape) for t in example_inputs if isinstance(t, nn.Parameter)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                value = get_attribute(gm, node.target)
            except AttributeError:
                continue
            if isinstance(value, nn.Parameter):
                found.add(tuple(value.shape))
    return [list(shape) for shape in sorted(found)]


@dataclass(frozen=True, eq=False)
class Analysis:
    """Per-op analysis of one captured model (``ops`` in graph order)."""

    ops: tuple[OpInfo, ...]
    device: torch.device
    low_dtype: torch.dtype
    graph_module: fx.GraphModule = field(repr=False)
    capture_method: str = "symbolic"
    #: How the graph was captured, so that it can be captured again at other input shapes
    #: (:class:`compfx.planned_module.PlannedModule`): the example inputs' :func:`~compfx.graph_capture.input_signature`
    #: (None for graphs handed over by torch.compile), the leaf modules, and each module's train/eval mode.
    example_signature: Hashable = field(default=None, repr=False)
    leaf_modules: tuple = ()
    modes: Mapping[str, bool] | None = field(default=None, repr=False)
    #: Whether FP8 eligibility was analysed (``analyze(..., fp8=True)``); re-captures keep it.
    fp8: bool = False

    @property
    def keys(self) -> tuple[OpKey, ...]:
        return tuple(op.key for op in self.ops)

    @property
    def verification(self):
        """What :func:`compfx.graph_capture.capture` found when it checked this graph against the model (a
        :class:`~compfx.graph_capture.CaptureVerification`), or None if it was not checked."""
        return self.graph_module.meta.get(VERIFICATION_META)

    @property
    def fingerprint(self) -> str:
        """Hash of the op keys: equal for the same model structure, whatever the device."""
        return fingerprint_of(self.keys)

    @property
    def stage1_ops(self) -> tuple[OpInfo, ...]:
        """CoMP's Stage1_OP_list: whitelisted and blacklisted ops."""
        return tuple(op for op in self.ops if op.category is not Category.OTHER)

    @property
    def stage1_adjustable(self) -> tuple[OpInfo, ...]:
        """Stage-1 ops that Stage 1 tries at both precisions."""
        return tuple(op for op in self.ops if op.adjustable_in_stage1)

    @property
    def other_ops(self) -> tuple[OpInfo, ...]:
        return tuple(op for op in self.ops if op.category is Category.OTHER)

    def index(self, key: OpKey) -> int:
        return self.keys.index(key)

    def op(self, key: OpKey) -> OpInfo:
        return self.ops[self.index(key)]

    def table(self, precisions: Mapping[OpKey, str] | None = None, tablefmt: str = "simple") -> str:
        """The analysis as a text table (plus a precision column when given a plan).

        A "pad" column appears when some op is :attr:`OpInfo.pad_eligible`: what
        padding would change ("padded" in front when ``precisions`` is a plan
        that pads the op).
        """
        headers = ["#", "op key", "category", "TC", "reason", "input shapes"]
        padding = any(op.pad_eligible for op in self.ops)
        if padding:
            headers.append("pad")
        if precisions is not None:
            headers.append("precision")
        padded = getattr(precisions, "padded", frozenset())
        rows = []
        for i, op in enumerate(self.ops):
            row = [i, str(op.key), category_label(op), "yes" if op.tc_eligible else "no", op.reason,
                   " ".join("x".join(map(str, s)) for s in op.input_shapes)]
            if padding:
                row.append(("padded: " if op.key in padded else "") + op.pad_reason if op.pad_eligible else "")
            if precisions is not None:
                row.append(precisions.get(op.key, "-"))
            rows.append(row)
        return tabulate(rows, headers=headers, tablefmt=tablefmt)

    def summary(self) -> str:
        counts = {c: sum(op.category is c for op in self.ops) for c in Category}
        tc = sum(op.tc_eligible for op in self.ops)
        pad = sum(op.pad_eligible for op in self.ops)
        pinned = sum(op.pinned for op in self.ops)
        return (f"{len(self.ops)} ops on {self.device} (low dtype {dtype_name(self.low_dtype)}): "
                f"{counts[Category.WHITELIST]} whitelist ({tc} tensor-core eligible"
                + (f", {pad} would meet the rule if padded" if pad else "") + "), "
                f"{counts[Category.BLACKLIST]} blacklist, {counts[Category.OTHER]} other"
                + (f"; {pinned} pinned to FP32 by the model's autocast(enabled=False) blocks" if pinned else "")
                + f"; Stage 1 adjusts {len(self.stage1_adjustable)}.")


def category_label(op) -> str:
    """An op's category as tables print it: ``"whitelist"``, or ``"whitelist, pinned"`` for a pinned op."""
    return f"{op.category}, pinned" if getattr(op, "pinned", False) else str(op.category)


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device``; :class:`BadInputError` for a string torch does not know.

    >>> check_device("cuda:1")
    device(type='cuda', index=1)
    >>> check_device("tpu9")
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: device='tpu9' is not a device torch knows (...); expected e.g. 'cpu', 'cuda' or 'cuda:0'.
    """
    if isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise BadInputError(f"device={device!r} is not a device torch knows ({(str(error).splitlines() or [''])[0]}); "
                            "expected e.g. 'cpu', 'cuda' or 'cuda:0'.") from None


def check_capability(capability) -> tuple[int, int] | None:
    """``capability`` as ``(major, minor)`` ints, or None; :class:`BadInputError` for anything else.

    >>> check_capability([8, 0]), check_capability(None)
    ((8, 0), None)
    """
    if capability is None:
        return None
    if (not isinstance(capability, (tuple, list)) or len(capability) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in capability)):
        raise BadInputError(f"capability={capability!r}; expected the CUDA compute capability as two ints "
                            "(major, minor), e.g. (8, 0) for an A100.")
    return (capability[0], capability[1])


def _check_visible(device: torch.device, capability) -> None:
    """A CUDA device this process cannot see is planned for only with its ``capability`` given (what the Tensor
    Core and FP8 rules read from the device); without it, :class:`BadInputError` (a mistyped index, say)."""
    if device.type != "cuda" or capability is not None:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index is None and count or device.index is not None and device.index < count:
        return
    seen = f"it sees {count} CUDA device(s)" if count else "it has no CUDA"
    raise BadInputError(f"device={str(device)!r} is not a device this process can see ({seen}). Analyse for a "
                        "device it has, or, to plan for a GPU it cannot see, give that GPU's compute capability, "
                        "e.g. analyze(..., device='cuda', capability=(8, 0)).")


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _dim(d) -> int:
    """A concrete dim; a symbolic one (torch.compile with dynamic shapes) by its example value."""
    return d if isinstance(d, int) else int(d.node.hint)


def _shapes(value) -> tuple[Shape, ...]:
    return tuple(tuple(_dim(d) for d in t.shape) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _input_values(node: fx.Node):
    return pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else None, (node.args, node.kwargs))


def _conv_groups(node: fx.Node) -> int:
    groups = node.kwargs.get("groups", node.args[6] if len(node.args) > 6 else 1)
    return groups if isinstance(groups, int) else 1


def _category(node: fx.Node, key: OpKey, device: torch.device, overrides: Mapping[str, str] | None) -> Category:
    """The op's list, by its kind (:func:`compfx.oplists.classify`). A custom autograd Function is on the
    lower-precision list whatever its class is called: eager AMP runs its forward under autocast, as "low" runs
    it (:func:`compfx.cast_policy.low_runs_under_autocast`), so AMP's plan is autocast there too."""
    if isinstance(node.target, FunctionCall) and not (overrides and key.kind in overrides):
        return Category.WHITELIST
    return classify(key.kind, device.type, overrides)


def describe_op(node: fx.Node, *, device: torch.device, low_dtype: torch.dtype,
                overrides: Mapping[str, str] | None = None, capability=None, fp8: bool = False) -> OpInfo:
    """Build the :class:`OpInfo` of one keyed node (with its FP8 eligibility when ``fp8``)."""
    key: OpKey = node.meta[KEY_META]
    category = _category(node, key, device, overrides)
    input_shapes = _shapes(_input_values(node))
    groups = _conv_groups(node) if key.kind.startswith("conv") else 1
    eligible, reason = tc_eligible(key.kind, category, input_shapes, low_dtype=low_dtype, device=device,
                                   capability=capability, groups=groups)
    can_pad, pad_reason = pad_eligible(key.kind, category, input_shapes, groups=groups,
                                       is_module_call=node.op == "call_module")
    info = OpInfo(key, category, eligible, reason, input_shapes, _shapes(node.meta.get("val")),
                  pad_eligible=can_pad, pad_reason=pad_reason, pinned=is_pinned(node))
    if not fp8:
        return info
    can, why = fp8_eligible(key.kind, input_shapes, device=device, capability=capability,
                            is_module_call=node.op == "call_module")
    return dataclasses.replace(info, fp8_eligible=can, fp8_reason=why)


def analyze_graph(gm: fx.GraphModule, *, device: torch.device, low_dtype: torch.dtype,
                  overrides: Mapping[str, str] | None = None, capability: tuple[int, int] | None = None,
                  fp8: bool = False) -> Analysis:
    """Analyse an already captured graph (used by :func:`analyze` and the compile backend)."""
    capability = capability or _cuda_capability(device)
    ops = tuple(describe_op(n, device=device, low_dtype=low_dtype, overrides=overrides, capability=capability,
                            fp8=fp8) for n in op_nodes(gm))
    return Analysis(ops, device, low_dtype, gm, gm.meta.get("compfx_capture_method", "symbolic"), fp8=fp8)


def analyze(
    model: nn.Module,
    example_inputs,
    *,
    device: torch.device | str | None = None,
    low_dtype: torch.dtype | None = None,
    overrides: Mapping[str, str] | None = None,
    leaf_modules: Iterable[type | str] = (),
    capability: tuple[int, int] | None = None,
    method: str = "auto",
    fp8: bool = False,
    verify: bool = True,
) -> Analysis:
    """Capture ``model`` as an FX graph and classify each op: what a plan can give it ("can it").

    Each op gets an :class:`~compfx.opkey.OpKey` and autocast's category (whitelist / blacklist / other), its
    Tensor Core and padding eligibility, and with ``fp8`` its FP8 eligibility. The capture is verified: the
    graph must give the model's outputs, every parameter's gradient and its saved-tensor count on the example
    inputs, or the next tracer is tried (``Analysis.verification`` says what was found). The model, its modes and
    the RNG are left as they were.

    Args:
        model: the ``nn.Module`` to analyse.
        example_inputs: a tensor, a tuple of positional arguments, a dict of keyword arguments, or
            ``(args, kwargs)``, as one batch's inputs (without the target).
        device: the device planned for; default: the device of the model's parameters.
        low_dtype: the precision of "low" ops; default: float16 on CUDA, bfloat16 elsewhere.
        overrides: op kind -> category (``"whitelist"``, ``"blacklist"``, ``"other"``), over autocast's lists.
        leaf_modules: module types or names that symbolic tracing keeps as one op each.
        capability: the CUDA compute capability to plan for, e.g. ``(8, 0)``, when this process cannot see that
            GPU (read from the device otherwise).
        method: the tracer: ``"auto"`` (symbolic, then record, then dynamo), ``"symbolic"``, ``"record"`` or
            ``"dynamo"`` (see :func:`compfx.capture`).
        fp8: also mark the ops that can run FP8 (``OpInfo.fp8_eligible``, ``fp8_reason``; :mod:`compfx.float8`);
            a plan may give ``"fp8"`` only to those.
        verify: check the capture against the model (one eager and one graph forward and backward); False skips
            it, at the risk of planning a graph that trains something else.

    Returns:
        Analysis: the ops in graph order (``.ops``, each an :class:`OpInfo`), the captured graph
        (``.graph_module``, never changed by planning), the model's fingerprint, ``.table()`` and ``.summary()``.

    Raises:
        BadInputError: ``model`` is not an ``nn.Module``, the example inputs do not fit it (it fails on them in
            eager too), or a setting is not one compfx knows (``device``, ``low_dtype``, ``capability``).
        CaptureError: no tracer captures the model faithfully (a branch on tensor values, say); the message names
            the line of the model's code, or the first output or parameter that differs.

    Example::

        >>> import torch, compfx
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 10), torch.nn.Softmax(-1))
        >>> a = compfx.analyze(model, torch.randn(4, 16), device="cuda", capability=(8, 0))
        >>> [(str(op.key), str(op.category), op.tc_eligible) for op in a.ops]
        [('0:linear#0', 'whitelist', False), ('1:softmax#0', 'blacklist', False)]
        >>> [(op.fp8_eligible, op.fp8_reason) for op in compfx.analyze(model, torch.randn(16, 16), fp8=True).ops]
        [(False, 'out_features=10 is not a multiple of 16'), (False, 'no float8 path for softmax (only linear, matmul and mm with a 2-D right operand)')]
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"analyze() takes an nn.Module; got {type(model).__name__}. Pass the model object "
                            "itself (e.g. the result of its factory), not its name.")
    device = check_device(device) if device is not None else model_device(model)
    low_dtype = check_low_dtype(low_dtype if low_dtype is not None else default_low_dtype(device))
    capability = check_capability(capability)
    _check_visible(device, capability)
    leaf_modules = tuple(leaf_modules)
    gm = capture(model, example_inputs, leaf_modules=leaf_modules, method=method, verify=verify)
    analysis = analyze_graph(gm, device=device, low_dtype=low_dtype, overrides=overrides, capability=capability,
                             fp8=fp8)
    args, kwargs = normalize_example_inputs(example_inputs)
    return dataclasses.replace(analysis, example_signature=input_signature(args, kwargs, modes_of(model)),
                               leaf_modules=leaf_modules, modes=module_modes(model))
