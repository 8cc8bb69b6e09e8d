"""OpKey: one normalisation of op kinds and module paths, stable across tracers and re-captures."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from compfx.graph_capture import capture, op_nodes
from compfx.opkey import OpKey, normalize_kind, normalize_module_path


@pytest.mark.parametrize(
    "op, target, kind",
    [
        ("call_function", F.linear, "linear"),
        ("call_function", torch._C._nn.linear, "linear"),
        ("call_function", torch.matmul, "matmul"),
        ("call_function", operator.matmul, "matmul"),
        ("call_function", operator.imatmul, "matmul"),
        ("call_method", "matmul", "matmul"),
        ("call_function", torch.Tensor.matmul, "matmul"),
        ("call_function", F.softmax, "softmax"),
        ("call_function", torch.softmax, "softmax"),
        ("call_method", "softmax", "softmax"),
        ("call_function", F.relu, "relu"),
        ("call_method", "relu_", "relu"),
        ("call_function", torch.relu_, "relu"),
        ("call_function", operator.add, "add"),
        ("call_function", operator.iadd, "add"),
        ("call_method", "add_", "add"),
        ("call_function", operator.truediv, "div"),
        ("call_function", F.scaled_dot_product_attention, "scaled_dot_product_attention"),
        ("call_function", F.multi_head_attention_forward, "multi_head_attention"),
        ("call_function", torch.ops.aten.mm.default, "mm"),
        ("call_function", F.cross_entropy, "cross_entropy"),
        ("call_function", torch._C._nn.cross_entropy_loss, "cross_entropy_loss"),
        ("call_function", F.max_pool2d, "max_pool2d"),
        ("call_function", F.conv2d, "conv2d"),
        ("call_method", "__matmul__", "matmul"),
    ],
)
def test_normalize_kind(op, target, kind):
    assert normalize_kind(op, target) == kind


@pytest.mark.parametrize(
    "qualname, path",
    [
        ("fc1", "fc1"),
        ("", ""),
        ("L['self'].layers[0].fc", "layers.0.fc"),
        ("L['self']._modules['layers']._modules['0']", "layers.0"),
        ("getattr(L['self'].encoder.layer, '1').attention", "encoder.layer.1.attention"),
        ("L['mod'].head", "head"),
    ],
)
def test_normalize_module_path(qualname, path):
    assert normalize_module_path(qualname) == path


@settings(max_examples=25, deadline=None)
@given(
    st.from_regex(r"([a-z_][a-z0-9_]{0,6}(\.[a-z0-9_]{1,6}){0,3})?", fullmatch=True),
    st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True),
    st.integers(0, 1000),
)
def test_opkey_str_parse_round_trip(module, kind, index):
    key = OpKey(module, kind, index)
    assert OpKey.parse(str(key)) == key


class AllMatmulSpellings(nn.Module):
    # (torch.Tensor.matmul(a, b) cannot take an FX proxy; normalize_kind is tested on it above.)
    def forward(self, a, b):
        return torch.matmul(a, b) + (a @ b) + a.matmul(b) + operator.matmul(a, b)


@pytest.mark.parametrize("method", ["symbolic", "dynamo"])
def test_every_matmul_spelling_is_one_kind_in_a_graph(method):
    gm = capture(AllMatmulSpellings(), (torch.randn(3, 4), torch.randn(4, 5)), method=method)
    kinds = [n.meta["compfx_key"].kind for n in op_nodes(gm)]
    assert kinds.count("matmul") == 4, kinds
    assert [str(k) for k in (n.meta["compfx_key"] for n in op_nodes(gm)) if k.kind == "matmul"] == [
        f":matmul#{i}" for i in range(4)
    ]


def test_keys_are_stable_across_recaptures_and_tracers():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1)))
    x = torch.randn(2, 4)
    first = [n.meta["compfx_key"] for n in op_nodes(capture(model, x))]
    again = [n.meta["compfx_key"] for n in op_nodes(capture(model, x))]
    dynamo = [n.meta["compfx_key"] for n in op_nodes(capture(model, x, method="dynamo"))]
    assert first == again == dynamo
    assert [str(k) for k in first] == ["0:linear#0", "1:relu#0", "2.0:linear#0", "2.1:softmax#0"]
