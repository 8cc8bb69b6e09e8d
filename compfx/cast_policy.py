"""The cast rules, defined once: what a cast is, which inputs a plan casts, who shares a cast, which ops run under autocast.

The cast pass (:mod:`compfx.passes.insert_casts`) applies these rules to a
graph; the profiler (:mod:`compfx.costmodel.profile`) applies them to one op
in isolation; the predictor, the cast report and the compile backend read a
rewritten graph with them. Keeping them here is what makes the cost model
price the graph the pass builds, and the report count the casts the cost
model prices.

* **Which inputs are cast** (:func:`castable`): every floating input of an op
  (activations *and* parameters), except

  - an input the op writes (``x.add_(y)``, ``inplace=True``, ``out=``): a cast
    would make the write land on a temporary copy (:func:`mutated_positions`);
  - the weight, bias and running statistics of normalisation ops
    (:data:`NORM_KINDS`): their kernels take FP32 parameters beside a low
    activation, and casting a running-stat buffer would lose its in-place update.
    On CUDA, layer norm's and group norm's kernels take their weight and bias
    only in the input's dtype (:data:`SAME_DTYPE_PARAMETERS_ON_CUDA`), so there
    a plan that runs them low casts those too;
  - float64 tensors, which autocast leaves alone too.

* **Who shares a cast** (:func:`shares_cast`): a parameter or buffer is cast
  once per dtype and forward, and all its uses share that cast (autocast's
  weight-cast cache); every other tensor is cast once per use, right before
  the op that reads it, as autocast casts inside each op. The gradients of an
  activation's uses then meet in the activation's own dtype, never in the
  low dtype of a shared cast.

* **Which ops run under autocast** (:func:`runs_under_autocast`): composite ops
  that autocast casts *inside* (:data:`COMPOSITE_KINDS`: multi-head attention,
  RNNs) and opaque leaf modules run their "low" under ``torch.autocast``
  (:class:`AutocastRegion`), exactly as in eager AMP, instead of having their
  inputs cast.

* **Which ops take mixed dtypes** (:func:`runs_as_is`): "follow" ops run on
  whatever reaches them when the dtypes agree or the op type-promotes
  (:data:`PROMOTING_KINDS`); GEMMs and RNNs reject mixed inputs.

* **FP32 by a dtype argument** (:func:`fp32_by_dtype_argument`): on CUDA,
  autocast runs softmax, sum, cumsum and the other ops of its
  ``fp32_set_opt_dtype`` policy in FP32 by passing ``dtype=torch.float32``, not
  by casting their input (softmax then reads the low input and writes FP32,
  with no FP32 copy of its input); a plan's FP32 does the same there.

* **What a cast is** (:func:`is_cast`): a conversion node (``.to``,
  ``.float()``, ``.type_as``, ``aten._to_copy``, ...) that changes the
  floating dtype of its input, read from the metadata on both sides.

* **What dtype an op computes in** (:func:`compute_dtype`): its autocast
  region's, else the promoted dtype of the inputs its precision applies to.

* **A planned graph runs outside the caller's autocast** (:func:`run_as_planned`):
  its casts are the plan; an autocast around it would run the ops the plan keeps
  in FP32 in low precision too.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .graph_capture import meta_value, renorms_weight, writes_input
from .graph_capture.functions import FunctionCall
from .opkey import KEY_META, normalize_kind
from .errors import BadInputError
from .vocabulary import Precision, dtype_name, short_dtype_name

__all__ = [
    "NORM_KINDS", "SAME_DTYPE_PARAMETERS_ON_CUDA", "COMPOSITE_KINDS", "PROMOTING_KINDS", "FP32_BY_DTYPE_ARGUMENT_ON_CUDA", "CAST_KINDS", "CAST_META", "AutocastRegion",
    "mutated_positions", "castable", "castable_inputs", "is_model_tensor", "shares_cast", "runs_under_autocast", "low_runs_under_autocast",
    "runs_as_is", "fp32_by_dtype_argument", "is_cast", "compute_dtype", "precision_dtype", "run_as_planned",
]

#: Ops whose weight/bias/running stats stay FP32 whatever the op's precision.
NORM_KINDS = frozenset({"batch_norm", "layer_norm", "group_norm", "instance_norm"})
#: Norm ops whose CUDA kernels read weight and bias in the input's dtype ("expected scalar type Half but found
#: Float" beside a low input; batch and instance norm take FP32 ones, as cuDNN wants). CUDA autocast runs them in
#: FP32, so only a plan that runs them low meets this; CPU kernels take FP32 parameters beside a low input.
SAME_DTYPE_PARAMETERS_ON_CUDA = frozenset({"layer_norm", "group_norm"})
#: Ops that autocast casts *inside*; "low" runs them under torch.autocast. einsum is one on CPU, where it reaches
#: autocast as its GEMMs: it first sums an index only one operand has, in that operand's dtype, which casting its
#: inputs would not (CUDA autocast casts einsum's inputs, as the region does there too).
COMPOSITE_KINDS = frozenset({"multi_head_attention", "gru", "lstm", "rnn_tanh", "rnn_relu", "einsum"})
#: CUDA autocast's ``fp32_set_opt_dtype`` ops (autocast_mode.cpp): FP32 is ``dtype=torch.float32``, not a cast.
FP32_BY_DTYPE_ARGUMENT_ON_CUDA = frozenset({"softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod",
                                            "linalg_vector_norm", "linalg_matrix_norm"})
#: "Other" ops that take mixed floating inputs and type-promote them (TensorIterator ops).
PROMOTING_KINDS = frozenset("""
    add sub rsub mul div where maximum minimum fmax fmin pow float_power atan2 lerp addcmul addcdiv
    clamp clip clamp_min clamp_max hypot copysign remainder fmod floor_divide eq ne lt le gt ge
    logaddexp logaddexp2 xlogy heaviside
""".split())
#: Op kinds (after :func:`compfx.opkey.normalize_kind`) that convert dtypes: method, function and aten spellings.
CAST_KINDS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double", "to_copy",
                        "convert_element_type"})
#: ``node.meta`` flag on every cast node compfx inserts.
CAST_META = "compfx_cast"

#: Argument positions through which an op names its input (positional or keyword).
_INPUT_POSITIONS = (0, "input", "self")


# -- which inputs are cast ---------------------------------------------------------

def mutated_positions(node: fx.Node) -> frozenset:
    """Argument positions ``node`` writes to: ``out=``, its input when the op is in-place, and the weight of an
    embedding with ``max_norm`` (a cast copy would be renormalised instead of the parameter).

    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(lambda x: torch.relu_(x) + torch.nn.functional.relu(x, inplace=True))
    >>> [sorted(map(str, mutated_positions(n))) for n in gm.graph.nodes if n.op == "call_function"][:2]
    [['0', 'input', 'out', 'self'], ['0', 'input', 'out', 'self']]
    """
    written = {"out"}
    if writes_input(node):
        written.update(_INPUT_POSITIONS)
    if renorms_weight(node):
        written.update((1, "weight"))
    return frozenset(written)


def castable(kind: str, position, value, mutated: Iterable = frozenset()) -> bool:
    """Does a plan's precision cast ``value``, passed at ``position`` (an index or keyword) to an op of ``kind``?

    >>> import torch
    >>> castable("linear", 1, torch.ones(2)), castable("layer_norm", 1, torch.ones(2))
    (True, False)
    >>> castable("add", 0, torch.ones(2), mutated={0}), castable("add", 1, torch.ones(2, dtype=torch.float64))
    (False, False)
    >>> castable("layer_norm", 2, torch.ones(2, device="meta")), castable("batch_norm", 1, torch.ones(2, device="meta"))
    (False, False)
    """
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == torch.float64:
        return False
    if position in mutated:
        return False
    if kind in NORM_KINDS and position not in _INPUT_POSITIONS:
        return kind in SAME_DTYPE_PARAMETERS_ON_CUDA and value.device.type == "cuda"
    return True


def castable_inputs(node: fx.Node, value_of: Callable[[fx.Node], Any] = meta_value) -> list[tuple[Any, fx.Node]]:
    """(position, input node) pairs of ``node`` whose value its precision applies to (see :func:`castable`)."""
    kind = node.meta[KEY_META].kind
    mutated = mutated_positions(node)
    pairs = []
    for position, value in [*enumerate(node.args), *node.kwargs.items()]:
        for arg in _nodes_in(value):
            if castable(kind, position, value_of(arg), mutated):
                pairs.append((position, arg))
    return pairs


def precision_dtype(precision: Precision, low_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a precision casts an op's castable inputs to; None for ``follow`` (no dtype of its own).

    An ``fp8`` op takes FP32 inputs: torchao's float8 path scales high-precision
    operands to float8 inside the op and returns the input's dtype, as
    ``convert_to_float8_training`` does without autocast.

    >>> import torch
    >>> precision_dtype(Precision.FP8, torch.bfloat16), precision_dtype(Precision.FOLLOW, torch.bfloat16)
    (torch.float32, None)
    """
    return {Precision.LOW: low_dtype, Precision.FP32: torch.float32, Precision.FP8: torch.float32}.get(precision)


def fp32_by_dtype_argument(node: fx.Node, device_type: str) -> bool:
    """Does FP32 run ``node`` by passing ``dtype=torch.float32`` rather than by casting its input, as CUDA autocast
    runs the ops of :data:`FP32_BY_DTYPE_ARGUMENT_ON_CUDA`? Only a torch function or Tensor method (a module
    takes no ``dtype=``), and only when the model gave no dtype of its own (autocast keeps the model's).

    >>> import torch, compfx
    >>> class Pool(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.softmax(-1) + torch.sum(x, dtype=torch.float64)
    >>> softmax, total = [n for n in compfx.graph_capture.op_nodes(compfx.capture(Pool(), torch.randn(2, 3)))
    ...                   if n.meta[KEY_META].kind in ("softmax", "sum")]
    >>> fp32_by_dtype_argument(softmax, "cuda"), fp32_by_dtype_argument(total, "cuda")
    (True, False)
    >>> fp32_by_dtype_argument(softmax, "cpu")  # CPU autocast casts: its FP32 list holds no such op
    False
    """
    if device_type != "cuda" or node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.OpOverload) or node.meta[KEY_META].kind not in FP32_BY_DTYPE_ARGUMENT_ON_CUDA:
        return False
    given = [*node.args, *node.kwargs.values()]
    return "dtype" not in node.kwargs and not any(isinstance(arg, torch.dtype) for arg in given)


# -- who shares a cast -------------------------------------------------------------

def is_model_tensor(node: fx.Node, value) -> bool:
    """Does ``node`` read a parameter or buffer of the model? A ``get_attr`` node, or a parameter that
    ``torch.compile`` lifted to a placeholder (its fake value is an ``nn.Parameter``)."""
    return node.op == "get_attr" or (node.op == "placeholder" and isinstance(value, nn.Parameter))


def shares_cast(node: fx.Node, value) -> bool:
    """Do all uses of ``node`` (whose value is ``value``) share one cast per dtype (True), or is each use cast on its own?

    Shared: parameters and buffers (:func:`is_model_tensor`). For a trainable
    FP32 parameter cast to the low dtype this is autocast's weight-cast cache,
    which casts such a leaf once per autocast region and hands every use the
    same copy, so a tied weight's gradients meet in that copy exactly as in
    eager AMP. A buffer, or a frozen parameter, gets no gradient, so sharing
    its cast is numerically free.

    Per use: every other tensor (activations, inputs). Autocast casts inside
    each op, so an FP32 activation read by q, k and v is cast three times, and
    backward casts each use's gradient back to FP32 before autograd sums them.
    One shared cast would sum them in the cast's dtype first (bf16 for a low
    cast): a loss of gradient precision, and not autocast's numbers. Per-use
    casts of one tensor are identical in forward, so a compiler's CSE (Inductor's)
    merges them there.

    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    >>> [(n.name, shares_cast(n, None)) for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")]
    [('input_1', False), ('weight', True), ('bias', True)]
    """
    return is_model_tensor(node, value)


def runs_under_autocast(kind: str, *, is_module_call: bool) -> bool:
    """True when "low" runs the op under ``torch.autocast`` rather than casting its inputs."""
    return kind in COMPOSITE_KINDS or is_module_call


def low_runs_under_autocast(node: fx.Node) -> bool:
    """:func:`runs_under_autocast` for a keyed graph node. A ``call_method`` op has no function to wrap in an
    autocast region, so "low" casts its inputs instead. A custom autograd Function's forward runs under the
    caller's autocast in eager AMP (``custom_fwd`` decides what it does there), so its "low" does too."""
    return node.op != "call_method" and (isinstance(node.target, FunctionCall) or runs_under_autocast(
        node.meta[KEY_META].kind, is_module_call=node.op == "call_module"))


def runs_as_is(kind: str, dtypes: Iterable[torch.dtype]) -> bool:
    """Can an op with no casts of its own run on input ``dtypes``? When they agree, or when it type-promotes.

    Fake kernels are too lax to tell (a fake ``linear`` takes bf16 x FP32), so this is a rule, not a probe.

    >>> import torch
    >>> runs_as_is("add", [torch.bfloat16, torch.float32]), runs_as_is("linear", [torch.bfloat16, torch.float32])
    (True, False)
    """
    return len(set(dtypes)) <= 1 or kind in PROMOTING_KINDS


class AutocastRegion(nn.Module):
    """Runs one composite op under ``torch.autocast(device_type, dtype)``: how "low" runs such ops.

    It holds no parameters of its own; a wrapped leaf module stays registered
    where it was, so ``state_dict()`` does not change.

    >>> import torch
    >>> region = AutocastRegion(torch.nn.functional.linear, "cpu", torch.bfloat16)
    >>> region(torch.randn(2, 3), torch.randn(4, 3)).dtype
    torch.bfloat16
    """

    def __init__(self, fn: Callable, device_type: str, dtype: torch.dtype):
        super().__init__()
        object.__setattr__(self, "fn", fn)  # not a child module: its weights belong to their own path
        self.device_type, self.dtype = device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"{name}, device_type={self.device_type!r}, dtype={short_dtype_name(self.dtype)}"


# -- reading a rewritten graph -------------------------------------------------------

def _dtype_of(value) -> torch.dtype | None:
    return value.dtype if isinstance(value, torch.Tensor) else None


def is_cast(node: fx.Node, value_of: Callable[[fx.Node], Any] = meta_value) -> bool:
    """True when ``node`` converts a floating tensor to another floating dtype (the one definition of a cast).

    A ``.to()`` that only moves a tensor between devices is not a cast. A node
    without dtype metadata counts only when compfx inserted it (``CAST_META``).
    """
    if node.op not in ("call_function", "call_method") or KEY_META in node.meta:
        return False
    if normalize_kind(node.op, node.target) not in CAST_KINDS:
        return False
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    before, after = _dtype_of(value_of(node.args[0])), _dtype_of(value_of(node))
    if before is None or after is None:
        return bool(node.meta.get(CAST_META))
    return before.is_floating_point and after.is_floating_point and before != after


def compute_dtype(node: fx.Node, module_of: Callable[[str], nn.Module],
                  value_of: Callable[[fx.Node], Any] = meta_value) -> torch.dtype | None:
    """The dtype a keyed op computes in: its autocast region's, else its cast inputs' (promoted), else None.

    ``module_of(target)`` looks up a ``call_module`` target (``gm.get_submodule``).
    Normalisation ops compute in their activation's dtype, whatever their FP32 weights.
    """
    if node.op == "call_module":
        region = module_of(node.target)
        if isinstance(region, AutocastRegion):
            return region.dtype
    dtypes = [value_of(arg).dtype for _, arg in castable_inputs(node, value_of)]
    if not dtypes:  # only mutated or float64 inputs: the op computes in theirs
        dtypes = [leaf.dtype for arg in node.all_input_nodes for leaf in pytree.tree_leaves(value_of(arg))
                  if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else None


# -- helpers -------------------------------------------------------------------------

def _nodes_in(value) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)
    return found




def weights_dtype(module: nn.Module) -> tuple[torch.Tensor, torch.dtype] | None:
    """The module's first floating parameter and its dtype now, for :func:`check_weights_dtype` at each call of a
    planned module: ``.double()``, ``.half()`` and ``.to(dtype)`` convert every floating parameter together, so one
    tells that they happened after the plan's casts were made."""
    first = next((p for p in module.parameters() if p.is_floating_point()), None)
    return None if first is None else (first, first.dtype)


def check_weights_dtype(probe: tuple[torch.Tensor, torch.dtype] | None) -> None:
    """A :class:`~compfx.errors.BadInputError` when the parameter :func:`weights_dtype` took is of another dtype now:
    the casts were made for the weights' dtype at planning, and would compute something else (``.double()`` failed
    deep in torch; ``.half()`` ran the ops the plan keeps in FP32 in half precision)."""
    if probe is None or probe[0].dtype == probe[1]:
        return
    was, now = dtype_name(probe[1]), dtype_name(probe[0].dtype)
    raise BadInputError(
        f"the model's parameters were converted from {was} to {now} (model.double(), .half(), .to(dtype)) after it "
        f"was planned; its planned graphs' casts were made for {was} weights and would compute something else. "
        f"Convert the model back (.to(torch.{was})), or plan the converted model again.")


def run_as_planned(graph, args: tuple, kwargs: dict, device_type: str):
    """``graph.forward(*args, **kwargs)``, with any ``torch.autocast`` of ``device_type`` the caller opened switched
    off inside it (and a warning, once): the plan sets every op's precision, and autocast on top would run the ops
    it keeps in FP32 (and the casts back to FP32 the plan makes) in low precision."""
    if not torch.is_autocast_enabled(device_type):
        return graph.forward(*args, **kwargs)  # not graph(...): torch.fx would print its code on a failure
    warnings.warn(f"compfx: a planned module ran inside torch.autocast({device_type!r}); the plan sets every op's "
                  "precision, so autocast is switched off inside it (on top of the plan it would run the ops the plan "
                  "keeps in FP32 in low precision). Remove the autocast block around the planned module.",
                  stacklevel=3)
    with torch.autocast(device_type, enabled=False):
        return graph.forward(*args, **kwargs)
