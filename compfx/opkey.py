"""Operator identity: :class:`OpKey` and the one place where names are normalised.

An operator is keyed by ``(module path, op kind, call index)``: the innermost
``nn.Module`` that issued the call (from ``node.meta["nn_module_stack"]``), a
normalised kind such as ``"linear"`` or ``"matmul"``, and how many ops of that
kind the module issued before it. Node names are never used: they change on
re-trace, and ``torch.compile`` lifts parameters to placeholders.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

__all__ = ["OpKey", "normalize_kind", "normalize_module_path", "module_path_of", "assign_op_keys", "KEY_META"]

#: ``node.meta`` entry that holds a node's :class:`OpKey`.
KEY_META = "compfx_key"


@dataclass(frozen=True, order=True)
class OpKey:
    """Stable identity of one operator call.

    >>> OpKey("encoder.0.attn", "matmul", 1)
    OpKey('encoder.0.attn:matmul#1')
    >>> OpKey.parse("encoder.0.attn:matmul#1") == OpKey("encoder.0.attn", "matmul", 1)
    True
    """

    module: str
    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.module}:{self.kind}#{self.index}"

    def __repr__(self) -> str:
        return f"OpKey({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "OpKey":
        match = re.fullmatch(r"(?P<module>[^:]*):(?P<kind>[^#]+)#(?P<index>\d+)", text)
        if match is None:
            raise ValueError(f"{text!r} is not an op key; expected 'module.path:kind#index'")
        return cls(match["module"], match["kind"], int(match["index"]))


# Different spellings of one operator. Keys are raw names after the generic
# clean-up in normalize_kind (leading '_' and trailing in-place '_' removed).
_KIND_ALIASES = {
    "conv_transpose1d": "conv_transpose1d",
    "linalg_matmul": "matmul",
    "div": "div",
    "truediv": "div",
    "floordiv": "floor_divide",
    "true_divide": "div",
    "sub": "sub",
    "subtract": "sub",
    "multiply": "mul",
    "neg": "neg",
    "negative": "neg",
    "sdpa": "scaled_dot_product_attention",
    "max_pool1d_with_indices": "max_pool1d",
    "max_pool2d_with_indices": "max_pool2d",
    "max_pool3d_with_indices": "max_pool3d",
    "multi_head_attention_forward": "multi_head_attention",
    "native_multi_head_attention": "multi_head_attention",
    "view_as": "view",
    "reshape_as": "reshape",
    "getattr": "getattr",
}


def _raw_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):  # aten.mm.default -> mm
        return target.overloadpacket.__name__
    name = getattr(target, "__name__", None)
    if name is None:  # e.g. an OpOverload
        name = str(target).split(".")[-2] if "." in str(target) else str(target)
    return name


def normalize_kind(op: str, target) -> str:
    """Map an FX node's ``(op, target)`` to one canonical kind name.

    ``F.linear`` and ``torch._C._nn.linear`` give ``"linear"``; ``torch.matmul``,
    ``operator.matmul``, ``Tensor.matmul`` and ``@`` give ``"matmul"``;
    ``F.softmax`` and ``Tensor.softmax`` give ``"softmax"``.

    >>> import operator, torch.nn.functional as F
    >>> normalize_kind("call_function", operator.matmul), normalize_kind("call_method", "matmul")
    ('matmul', 'matmul')
    >>> normalize_kind("call_function", F.relu), normalize_kind("call_method", "relu_")
    ('relu', 'relu')
    """
    if op == "call_module":
        return _module_kind(target)
    name = _raw_name(target)
    if target in _OPERATOR_FUNCS:
        name = _OPERATOR_FUNCS[target]
    name = name.strip("_") if name.startswith("__") else name.lstrip("_")
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]  # in-place variant: relu_ -> relu
    return _KIND_ALIASES.get(name, name)


# torch.nn classes kept as leaves get the kind of the function they call, so
# they classify like their traced-through form (nn.BatchNorm2d -> batch_norm).
_NN_MODULE_KINDS = {
    "batchnorm1d": "batch_norm", "batchnorm2d": "batch_norm", "batchnorm3d": "batch_norm",
    "layernorm": "layer_norm", "groupnorm": "group_norm", "multiheadattention": "multi_head_attention",
    "maxpool1d": "max_pool1d", "maxpool2d": "max_pool2d", "maxpool3d": "max_pool3d",
    "avgpool1d": "avg_pool1d", "avgpool2d": "avg_pool2d", "avgpool3d": "avg_pool3d",
    "adaptiveavgpool2d": "adaptive_avg_pool2d", "convtranspose2d": "conv_transpose2d",
    "rnn": "rnn_tanh", "logsoftmax": "log_softmax", "crossentropyloss": "cross_entropy",
    "mseloss": "mse_loss",
}


def _module_kind(module) -> str:
    """Kind of a leaf module from its class: torch.nn's own get their functional name,
    user classes their name in snake case (``MyBlock`` -> ``my_block``, ``ReLU`` -> ``relu``)."""
    cls = module if isinstance(module, type) else type(module)
    if cls.__module__.startswith("torch.nn."):
        name = cls.__name__.lower()
        return _NN_MODULE_KINDS.get(name, name)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls.__name__).lower()


# The operator module's in-place and dunder names map onto the out-of-place op.
_OPERATOR_FUNCS = {
    operator.add: "add", operator.iadd: "add",
    operator.sub: "sub", operator.isub: "sub",
    operator.mul: "mul", operator.imul: "mul",
    operator.truediv: "div", operator.itruediv: "div",
    operator.floordiv: "floor_divide", operator.ifloordiv: "floor_divide",
    operator.matmul: "matmul", operator.imatmul: "matmul",
    operator.pow: "pow", operator.ipow: "pow",
    operator.neg: "neg",
    operator.getitem: "getitem",
}

_DYNAMO_ROOT = re.compile(r"^L\['[^']+'\]")  # L['self'] / L['mod'] / L['fn']


def normalize_module_path(qualname: str) -> str:
    """Turn a module path from any tracer into a dotted FQN relative to the model.

    >>> normalize_module_path("L['self'].layers[0].fc")
    'layers.0.fc'
    >>> normalize_module_path("L['self']._modules['layers']._modules['0']")
    'layers.0'
    >>> normalize_module_path("getattr(L['self'].encoder.layer, '1').attention")
    'encoder.layer.1.attention'
    """
    path = qualname
    # getattr(X, 'name') -> X.name (dynamo spells numeric children like this)
    while True:
        new = re.sub(r"getattr\(([^()]*?),\s*'([^']*)'\)", r"\1.\2", path)
        if new == path:
            break
        path = new
    path = _DYNAMO_ROOT.sub("", path)
    path = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    return path.strip(".")


def module_path_of(node: fx.Node) -> str:
    """Innermost module path recorded for ``node`` ('' for the root module)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    qualname = list(stack.values())[-1][0]
    return normalize_module_path(qualname)


def _node_kind(node: fx.Node, gm: fx.GraphModule | None) -> str:
    if node.op == "call_module" and gm is not None:
        return _module_kind(gm.get_submodule(node.target))
    return normalize_kind(node.op, node.target)


def assign_op_keys(
    gm: fx.GraphModule,
    include=lambda node: True,
    counts: dict[tuple[str, str], int] | None = None,
) -> dict[OpKey, fx.Node]:
    """Write an :class:`OpKey` into ``node.meta[KEY_META]`` for every call node.

    ``include(node)`` filters which call nodes get a key; the call index counts
    only included nodes, so both tracers must use the same filter. ``counts``
    ((module, kind) -> next index) is updated in place, so indices can continue
    across several graphs of one model. Returns the keys in graph order.
    """
    counts = {} if counts is None else counts
    keys: dict[OpKey, fx.Node] = {}
    for node in gm.graph.nodes:
        node.meta.pop(KEY_META, None)
        if node.op not in ("call_function", "call_method", "call_module") or not include(node):
            continue
        module, kind = module_path_of(node), _node_kind(node, gm)
        index = counts.get((module, kind), 0)
        counts[(module, kind)] = index + 1
        key = OpKey(module, kind, index)
        node.meta[KEY_META] = key
        keys[key] = node
    return keys
