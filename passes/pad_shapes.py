"""Rewrite pass: zero-pad the dims of the plan's padded ops that miss the Tensor Core rule, then slice back.

Campo pads "unfit" inputs so that their ops run on Tensor Cores. For each op
the plan pads, this pass reads its operand shapes at this graph's inputs and,
for each GEMM dim or conv channel count that is not a multiple of 8
(:func:`compfx.tensor_cores.pad_eligible`), inserts:

* ``F.pad`` of the operands along that dim (a linear's input is folded to 2-D
  first when its batch-by-sequence rows are what misses), with zeros;
* the op itself, on the padded operands;
* ``narrow`` of the result back to the unpadded size, then ``contiguous`` (and
  the linear's leading dims again), so every consumer sees the tensor the
  unpadded op returns, in the same shape and a contiguous layout.

The padding is **on the fly**: the weight is padded inside the forward, from
the model's own Parameter, and autograd's backward of ``F.pad`` (a slice)
hands the gradient back in the Parameter's own shape. Parameters, the
optimizer's state and ``state_dict()`` are unchanged. A padded *shadow* of
each weight would save one copy per step, but it must be rebuilt whenever the
weight changes, which in training is every step: the copy is paid anyway, a
second copy of the weight stays in memory, and the shadow could go stale
(a checkpoint load, an EMA swap). The copy costs a fraction of the GEMM it
unlocks; under ``torch.compile`` Inductor fuses it into neighbouring kernels.

**Numerics.** Padding adds only exact zeros: zero rows and columns give
products that are sliced off, and a zero-padded K (or input channel) adds
``0 * x`` terms to each dot product. What may change is the order in which the
kernel accumulates the K terms (another tile shape or split), so outputs and
gradients equal the unpadded op's within that op's own accumulation-order
tolerance: for a sum of K products in a dtype with machine epsilon ``eps``,
``|padded - unpadded| <= K * eps * sum(|a_i| * |b_i|)`` (the classic bound for
any two summation orders), plus one rounding of the output dtype when it is
fp16/bf16. ``tests/test_pad_shapes.py`` checks linear, matmul and conv against
that bound, forward and backward.

Run it after :func:`~compfx.passes.insert_casts` (it pads the cast operands, in
the low dtype) and before :func:`~compfx.passes.float8_matmuls` (``fp8`` ops are
never padded). Ops at other shapes than the analysis's (a ragged last batch)
are checked again here: one that meets the rule there is left alone, as is one
with a symbolic dim (``torch.compile(dynamic=True)``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

from compfx.graph_capture.nodes import inherit_location
from compfx.errors import PassError
from compfx.opkey import KEY_META, OpKey
from compfx.tensor_cores import CONV_KINDS, conv_channels, gemm_mnk, pad_eligible, padded_size
from compfx.vocabulary import Category

from .propagate_dtypes import DtypePropagator

__all__ = ["pad_shapes", "op_padding", "padding_of_call", "OpPadding", "PAD_META", "PADDED_META"]

PASS_NAME = "pad_shapes"
#: ``node.meta`` entry on every node this pass inserts: ``"operand"`` on the way into the padded op (reshapes,
#: pads), ``"result"`` on the way out (narrows, ``contiguous``, the reshape back).
PAD_META = "compfx_pad"
#: ``gm.meta`` entry: the keys of the ops this pass padded in the graph.
PADDED_META = "compfx_padded"

log = logging.getLogger("compfx")

#: The operand names of each kind, in argument order (the slots a padding can change).
_SLOTS = {"linear": ("input", "weight", "bias"), "matmul": ("input", "other"), "mm": ("input", "mat2"),
          "bmm": ("input", "mat2"), **{kind: ("input", "weight", "bias") for kind in CONV_KINDS}}


@dataclass(frozen=True)
class _Step:
    """One data-movement call on a tensor: ``F.pad(t, widths)``, ``t.narrow(...)``, ``t.reshape(...)``..."""

    op: str  # "call_function" (target(t, *args)) or "call_method" (t.target(*args))
    target: Any
    args: tuple = ()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.op == "call_function":
            return self.target(tensor, *self.args)
        return getattr(tensor, self.target)(*self.args)


def _pad(widths: Sequence[int]) -> _Step:
    """Zeros after the end of the last dims, as ``F.pad`` counts them (last dim first)."""
    return _Step("call_function", F.pad, (tuple(widths),))


@dataclass(frozen=True)
class OpPadding:
    """How one op is padded at given shapes: steps on its operand slots, steps on its result.

    The same object drives the graph rewrite (each step becomes a node) and
    :meth:`run` (each step runs eagerly: the cost model times the padded op
    with it), so both pad alike.
    """

    kind: str
    operands: tuple[tuple[int, tuple[_Step, ...]], ...]  # (slot, steps), slots as in _SLOTS
    output: tuple[_Step, ...]
    reason: str  # what is padded, e.g. "out_features 1001 -> 1008"

    def run(self, fn: Callable, args: tuple, kwargs: dict):
        """``fn(*args, **kwargs)`` with the operands padded and the result sliced back."""
        args, kwargs = list(args), dict(kwargs)
        for slot, steps in self.operands:
            value = _get_slot(self.kind, args, kwargs, slot)
            if value is not None:
                _set_slot(self.kind, args, kwargs, slot, _chain(steps, value))
        return _chain(self.output, fn(*args, **kwargs))


def _chain(steps: Iterable[_Step], value):
    for step in steps:
        value = step(value)
    return value


def _get_slot(kind: str, args, kwargs, slot: int):
    return args[slot] if slot < len(args) else kwargs.get(_SLOTS[kind][slot])


def _set_slot(kind: str, args: list, kwargs: dict, slot: int, value) -> None:
    if slot < len(args):
        args[slot] = value
    else:
        kwargs[_SLOTS[kind][slot]] = value


def op_padding(kind: str, shapes: Sequence[Sequence[int] | None], *, groups: int = 1) -> OpPadding | None:
    """The padding of one op at operand ``shapes`` (input, weight or right operand, bias or None), or None when
    padding cannot help there (:func:`compfx.tensor_cores.pad_eligible`: the op meets the rule, or is not padded).

    >>> p = op_padding("linear", [(4, 16), (10, 16), (10,)])
    >>> p.reason, [step.target for step in p.output]
    ('input rows 4 -> 8, out_features 10 -> 16', ['narrow', 'narrow', 'contiguous'])
    >>> op_padding("linear", [(8, 16), (16, 16), None]) is None
    True
    """
    shapes = list(shapes)
    # Only the shapes are judged here: the plan that asks for padding was checked against the analysis,
    # where the op's category (whitelist) and call type were.
    eligible, reason = pad_eligible(kind, Category.WHITELIST, shapes, groups=groups)
    if not eligible:
        return None
    if kind in CONV_KINDS:
        operands, output = _conv_padding(kind, shapes, groups)
    elif kind == "linear":
        operands, output = _linear_padding(shapes)
    else:
        operands, output = _matmul_padding(shapes)
    return OpPadding(kind, tuple((slot, tuple(steps)) for slot, steps in operands.items() if steps), tuple(output),
                     reason)


def _extra(size: int) -> int:
    return padded_size(size) - size


def _linear_padding(shapes) -> tuple[dict, list]:
    """input (..., K), weight (N, K), bias (N,): rows M are the input's leading dims, folded to pad them."""
    (m, n, k), _ = gemm_mnk("linear", shapes)
    x = shapes[0]
    pm, pn, pk = _extra(m), _extra(n), _extra(k)
    fold = pm and len(x) != 2  # padding rows of a (B, T, K) input: fold to (B*T, K) first
    inputs = [_Step("call_method", "reshape", (m, k))] if fold else []
    if pm or pk:
        inputs.append(_pad((0, pk, 0, pm) if pm else (0, pk)))
    operands = {0: inputs, 1: [_pad((0, pk, 0, pn))] if pk or pn else [],
                2: [_pad((0, pn))] if pn and len(shapes) > 2 and shapes[2] is not None else []}
    output = _narrowed([_Step("call_method", "narrow", (0, 0, m))] if pm else [], pn, n)
    if fold:
        output.append(_Step("call_method", "reshape", (*x[:-1], n)))
    return operands, output


def _narrowed(steps: list, pn: int, n: int) -> list:
    """``steps`` plus a narrow of the last dim to ``n`` when it was padded, then one ``contiguous`` for both."""
    steps = list(steps)
    if pn:
        steps.append(_Step("call_method", "narrow", (-1, 0, n)))
    if steps:
        steps.append(_Step("call_method", "contiguous"))
    return steps


def _matmul_padding(shapes) -> tuple[dict, list]:
    """a (..., M, K) @ b (..., K, N): pad a's rows and columns, b's rows and columns; narrow the result's last two."""
    (m, n, k), _ = gemm_mnk("matmul", shapes)
    pm, pn, pk = _extra(m), _extra(n), _extra(k)
    operands = {0: [_pad((0, pk, 0, pm))] if pm or pk else [], 1: [_pad((0, pn, 0, pk))] if pn or pk else []}
    rows = [_Step("call_method", "narrow", (-2, 0, m))] if pm else []
    return operands, _narrowed(rows, pn, n)


def _conv_padding(kind: str, shapes, groups: int) -> tuple[dict, list]:
    """input (N, C_in, *spatial), weight (C_out, C_in, *kernel), bias (C_out,): pad the channel dims."""
    c_in, c_out = conv_channels(kind, shapes, groups)
    pi, po = _extra(c_in), _extra(c_out)
    spatial = len(shapes[1]) - 2  # F.pad counts dims from the last, so an unbatched input pads alike
    operands = {0: [_pad((0, 0) * spatial + (0, pi))] if pi else [],
                1: [_pad((0, 0) * spatial + (0, pi, 0, po))],
                2: [_pad((0, po))] if po and len(shapes) > 2 and shapes[2] is not None else []}
    output = [_Step("call_method", "narrow", (-(spatial + 1), 0, c_out)), _Step("call_method", "contiguous")] \
        if po else []
    return operands, output


def padding_of_call(kind: str, args: Sequence, kwargs: dict, *, groups: int = 1) -> OpPadding | None:
    """:func:`op_padding` of a call with these arguments (tensors, real or fake, in the operand slots), or None
    when an operand is not a tensor of concrete shape (symbolic dims are not padded)."""
    if kind not in _SLOTS:
        return None
    operands = [_get_slot(kind, list(args), dict(kwargs), slot) for slot in range(len(_SLOTS[kind]))]
    if any(not isinstance(o, torch.Tensor) for o in operands[:2]) or \
            any(o is not None and not isinstance(o, torch.Tensor) for o in operands[2:]):
        return None
    shapes = [tuple(o.shape) if o is not None else None for o in operands]
    if not all(type(d) is int for s in shapes if s is not None for d in s):
        return None
    return op_padding(kind, shapes, groups=groups)


# -- the pass ---------------------------------------------------------------------------------------


def pad_shapes(gm: fx.GraphModule, padded: Iterable[OpKey]) -> fx.GraphModule:
    """Pad the ops whose keys are in ``padded`` (see the module docstring); returns ``gm``.

    Which ops it padded goes into ``gm.meta["compfx_padded"]``; every node it
    inserts carries ``meta["compfx_pad"]`` (``"operand"`` or ``"result"``), the op's module stack and source
    location, and its value (``val`` / ``example_value``, ``tensor_meta``).
    A padded key whose op meets the rule at this graph's shapes, or has a
    symbolic dim, is left as it is. Everything is worked out before the graph
    changes, so a failure leaves ``gm`` as it was.

    >>> import torch, compfx
    >>> from compfx.passes import pad_shapes
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 10))
    >>> gm = compfx.capture(model, torch.randn(8, 16))
    >>> gm = pad_shapes(gm, [n.meta["compfx_key"] for n in compfx.graph_capture.op_nodes(gm)])
    >>> [n.target for n in gm.graph.nodes if n.meta.get("compfx_pad")]
    [<function pad at ...>, <function pad at ...>, 'narrow', 'contiguous']
    >>> torch.testing.assert_close(gm(torch.ones(8, 16)), model(torch.ones(8, 16)))
    """
    if not isinstance(gm, fx.GraphModule):
        raise PassError(f"{PASS_NAME} takes a torch.fx.GraphModule; got {type(gm).__name__}.")
    wanted = set(padded)
    targets = [n for n in gm.graph.nodes if n.meta.get(KEY_META) in wanted]
    if not targets:
        gm.meta[PADDED_META] = ()
        return gm
    values = DtypePropagator(gm)
    try:
        rewrites = [r for r in (_planned_rewrite(node, values) for node in targets) if r is not None]
    except PassError:
        raise
    except Exception as error:
        raise PassError(f"{PASS_NAME} could not work out the padded values ({type(error).__name__}: {error}); the "
                        "graph was left unchanged. Please report this with the model that triggers it.") from error
    for rewrite in rewrites:
        rewrite.apply(gm.graph, values)
    gm.graph.lint()
    gm.recompile()
    gm.meta[PADDED_META] = tuple(r.node.meta[KEY_META] for r in rewrites)
    return gm


@dataclass
class _Rewrite:
    """One op's padding, with every inserted node's value worked out on fakes before the graph changes."""

    node: fx.Node
    padding: OpPadding
    operand_values: dict  # slot -> values after each step
    op_value: Any
    output_values: list

    def apply(self, graph: fx.Graph, values: DtypePropagator) -> None:
        node, kind = self.node, self.padding.kind
        args, kwargs = list(node.args), dict(node.kwargs)
        with graph.inserting_before(node):
            for slot, steps in self.padding.operands:
                current = _get_slot(kind, args, kwargs, slot)
                for step, value in zip(steps, self.operand_values[slot]):
                    current = self._insert(graph, step, current, value, values, "operand")
                _set_slot(kind, args, kwargs, slot, current)
        node.args, node.kwargs = tuple(args), kwargs
        values.record(node, self.op_value, like=node)
        users = list(node.users)
        current = node
        for step, value in zip(self.padding.output, self.output_values):
            with graph.inserting_after(current):
                current = self._insert(graph, step, current, value, values, "result")
        for user in users:
            user.replace_input_with(node, current)

    def _insert(self, graph: fx.Graph, step: _Step, source: fx.Node, value, values: DtypePropagator,
                side: str) -> fx.Node:
        name = f"{self.node.name}_{getattr(step.target, '__name__', step.target)}"
        new = graph.create_node(step.op, step.target, (source, *step.args), {}, name=name)
        inherit_location(new, self.node)  # padded and sliced back inside the op's checkpointed region too
        new.meta[PAD_META] = side
        values.record(new, value, like=self.node)
        return new


def _planned_rewrite(node: fx.Node, values: DtypePropagator) -> _Rewrite | None:
    kind = node.meta[KEY_META].kind
    if kind not in _SLOTS or node.op not in ("call_function", "call_method"):
        return None  # a leaf module call holds its weight: pad_eligible never marks one
    operands = [_get_slot(kind, list(node.args), dict(node.kwargs), slot) for slot in range(len(_SLOTS[kind]))]
    if any(o is not None and not isinstance(o, fx.Node) for o in operands[:2]):
        return None
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.value)
    args, kwargs = list(args), dict(kwargs)
    padding = padding_of_call(kind, args, kwargs, groups=_conv_groups(node) if kind in CONV_KINDS else 1)
    if padding is None:  # meets the rule at these shapes, or a dim is symbolic, or a value is unknown
        log.debug("compfx %s: %s is not padded at these inputs", PASS_NAME, node.meta[KEY_META])
        return None
    with values.mode:
        operand_values = {slot: _trace(steps, _get_slot(kind, args, kwargs, slot)) for slot, steps in padding.operands}
        for slot, steps in padding.operands:
            _set_slot(kind, args, kwargs, slot, operand_values[slot][-1])
        op_value = (node.target(*args, **kwargs) if node.op == "call_function"
                    else getattr(args[0], node.target)(*args[1:], **kwargs))
        output_values = _trace(padding.output, op_value)
    if output_values and tuple(output_values[-1].shape) != tuple(values.value(node).shape):
        raise PassError(f"{PASS_NAME}: {node.meta[KEY_META]} padded and sliced back has shape "
                        f"{tuple(output_values[-1].shape)}, not {tuple(values.value(node).shape)}; please report this.")
    return _Rewrite(node, padding, operand_values, op_value, output_values)


def _trace(steps: Sequence[_Step], value) -> list:
    """The value after each step."""
    out = []
    for step in steps:
        value = step(value)
        out.append(value)
    return out


def _conv_groups(node: fx.Node) -> int:
    groups = node.kwargs.get("groups", node.args[6] if len(node.args) > 6 else 1)
    return groups if isinstance(groups, int) else math.nan  # a symbolic groups count: pad_eligible refuses it
