"""Rewrite pass: run every op whose plan entry is ``fp8`` through torchao's float8 training matmul.

Each such op (``F.linear``, ``torch.matmul`` / ``@``, ``torch.mm`` with a 2-D
right operand) becomes a call of a :class:`Float8Matmul` submodule, which does
what torchao's ``Float8Linear.forward`` does: ``matmul_with_hp_or_float8_args``
(dynamic scaling of input, weight and, in backward, the output gradient), then
the bias in high precision. The module holds only torchao's config, no tensors:
the weight stays the model's FP32 Parameter, read by the same graph node, so
the optimizer and ``state_dict()`` do not change.

Run it after :func:`~compfx.passes.insert_casts`, which gives an FP8 op FP32
inputs (:func:`compfx.cast_policy.precision_dtype`): torchao's path takes
high-precision operands and returns the input's dtype, so ``meta["val"]`` of
the op is unchanged by this pass.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from compfx.batches import model_device, model_devices
from compfx.errors import PassError
from compfx.float8 import DEFAULT_RECIPE, FP8_KINDS, float8_config, fp8_runs_natively, require_torchao
from compfx.opkey import KEY_META
from compfx.vocabulary import Float8Recipe, Precision

__all__ = ["float8_matmuls", "Float8Matmul", "matmul_operands"]

PASS_NAME = "float8_matmuls"


class Float8Matmul(nn.Module):
    """``a @ b`` (or ``F.linear``'s ``a @ w.t()``) plus bias, through torchao's float8 training matmul.

    >>> import torch
    >>> op = Float8Matmul("tensorwise", transpose_weight=True, emulate=True)
    >>> op(torch.randn(16, 32), torch.randn(48, 32)).shape
    torch.Size([16, 48])
    """

    def __init__(self, recipe: Float8Recipe | str, *, transpose_weight: bool, emulate: bool):
        super().__init__()
        self.recipe, self.transpose_weight = Float8Recipe(recipe), transpose_weight
        self.config = float8_config(self.recipe, emulate=emulate)  # first: says how to install torchao
        from torchao.float8.float8_linear import Float8Linear

        # torchao builds its per-GEMM settings in Float8Linear.__init__; a meta-device one lends us them.
        with torch.device("meta"):
            self.linear_mm_config = Float8Linear(1, 1, bias=False, config=self.config).linear_mm_config

    def forward(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        out = matmul_with_hp_or_float8_args.apply(a, b.t() if self.transpose_weight else b, self.linear_mm_config,
                                                  self.config)
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}, emulate={self.config.emulate}"


def matmul_operands(kind: str, args: tuple, kwargs: dict) -> tuple:
    """(input, weight or right operand, bias or None) of a linear / matmul / mm call, positional or keyword: the
    arguments of the :class:`Float8Matmul` the call becomes (nodes in a graph, or the tensors of a call).

    >>> matmul_operands("linear", ("x", "w"), {"bias": "b"}), matmul_operands("mm", ("a",), {"mat2": "b"})
    (('x', 'w', 'b'), ('a', 'b', None))
    """
    names = ("input", "weight", "bias") if kind == "linear" else ("input", "other" if kind == "matmul" else "mat2")
    values = list(args) + [None] * (3 - len(args))
    found = [kwargs.get(name, values[i]) for i, name in enumerate(names)]
    if kind != "linear":
        found.append(None)
    return tuple(found)


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """(input, weight or right operand, bias) of a linear / matmul / mm node, positional or keyword."""
    return matmul_operands(node.meta[KEY_META].kind, node.args, node.kwargs)


def float8_matmuls(gm: fx.GraphModule, precisions, *, recipe: Float8Recipe | str | None = None,
                   emulate: bool | None = None) -> fx.GraphModule:
    """Turn the ops ``precisions`` marks ``fp8`` into :class:`Float8Matmul` calls; returns ``gm``.

    ``emulate`` defaults to "no native float8 GEMMs on the graph's device"
    (:func:`compfx.float8.fp8_runs_natively`). A graph without FP8 ops is
    returned untouched, and torchao is not imported.

    >>> import torch, compfx
    >>> from compfx.passes import float8_matmuls
    >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(32, 16)), torch.randn(16, 32))
    >>> gm = float8_matmuls(gm, {n.meta["compfx_key"]: "fp8" for n in compfx.graph_capture.op_nodes(gm)})
    >>> gm.get_submodule("0_fp8"), gm(torch.randn(16, 32)).dtype
    (Float8Matmul(recipe=tensorwise, emulate=True), torch.float32)
    """
    targets = [n for n in gm.graph.nodes if KEY_META in n.meta and precisions.get(n.meta[KEY_META]) == Precision.FP8]
    if not targets:
        return gm
    recipe = Float8Recipe.parse(recipe or DEFAULT_RECIPE, f"{PASS_NAME}: recipe")
    require_torchao()  # a missing torchao says how to install it, not which pass failed
    if emulate is None:
        emulate = not fp8_runs_natively(_graph_device(gm))
    for node in targets:  # all checked before the graph changes
        kind = node.meta[KEY_META].kind
        if kind not in FP8_KINDS or node.op not in ("call_function", "call_method"):
            raise PassError(f"{PASS_NAME}: {node.meta[KEY_META]} is a {kind} op ({node.op}); only linear, "
                            "matmul and mm calls can run in FP8. Give it another precision.")
    added = []
    try:
        for node in targets:
            kind = node.meta[KEY_META].kind
            a, b, bias = _operands(node)
            name = _free_name(gm, f"{node.meta[KEY_META].module or node.name}_fp8")
            gm.add_submodule(name, Float8Matmul(recipe, transpose_weight=kind == "linear", emulate=emulate))
            added.append(name)
            node.op, node.target = "call_module", name
            node.args, node.kwargs = (a, b) if bias is None else (a, b, bias), {}
        gm.graph.lint()
    except Exception as error:
        for name in added:
            gm._modules.pop(name, None)
        if isinstance(error, PassError):
            raise
        raise PassError(f"{PASS_NAME} failed ({type(error).__name__}: {error}).") from error
    gm.recompile()
    return gm


def _graph_device(gm: fx.GraphModule) -> torch.device:
    """The device of the graph's parameters and buffers, else of the first tensor value it holds, else the CPU."""
    if model_devices(gm):
        return model_device(gm)
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _free_name(gm: fx.GraphModule, wanted: str) -> str:
    base = wanted.replace(".", "_")
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name
