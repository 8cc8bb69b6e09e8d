"""The cast-insertion pass and cast counting: graph structure, dtype metadata, random plans, dynamo graphs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compfx
from compfx.planned_module import apply, planned_graph
from compfx.graph_capture import key_dynamo_graph
from compfx.errors import PassError
from compfx.opkey import KEY_META
from compfx.graph_capture import meta_value
from compfx.cast_policy import CAST_META, AutocastRegion, shares_cast
from compfx.passes import (apply_precisions, cast_report, casts_in, count_autocast_casts, count_casts, insert_casts,
                           output_dtypes, propagate_dtypes, restore_output_dtypes)
from zoo import ZOO, NativeMHA, make

# ---------------------------------------------------------------------------
# helpers


class _DtypeRecorder(fx.Interpreter):
    """Runs the graph for real and records each node's actual output dtype."""

    def __init__(self, gm):
        super().__init__(gm)
        self.dtypes: dict[fx.Node, torch.dtype] = {}

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            self.dtypes[node] = result.dtype
        return result


def _cast_nodes(gm):
    return [n for n in gm.graph.nodes if n.meta.get(CAST_META)]


def _assert_cast_invariants(gm):
    """No cast to a dtype the tensor already has; meta matches reality; and who shares a cast (cast_policy.shares_cast):
    a parameter or buffer is cast at most once per dtype, every other tensor once per use (each such cast has one use).
    """
    seen = set()
    for cast in _cast_nodes(gm):
        source, target = cast.args
        assert meta_value(source).dtype != target, f"{cast.name} casts {source.name} to the dtype it has"
        assert meta_value(cast).dtype == target
        if shares_cast(source, meta_value(source)):
            identity = _tensor_identity(gm, source)
            assert (identity, target) not in seen, f"{source.name} is cast to {target} twice"
            seen.add((identity, target))
        else:
            uses = [arg for user in cast.users for arg in _flat_args(user) if arg is cast]
            assert len(uses) == 1, f"{cast.name} (a cast of activation {source.name}) has {len(uses)} uses"


def _flat_args(node):
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


def _tensor_identity(gm, node):
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return ("attr", id(obj))
    return node


def _assert_meta_matches_run(gm, inputs):
    recorder = _DtypeRecorder(gm)
    recorder.run(*inputs)
    for node, dtype in recorder.dtypes.items():
        value = meta_value(node)
        if isinstance(value, torch.Tensor):
            assert value.dtype == dtype, f"meta says {node.name} is {value.dtype}, it ran as {dtype}"


# ---------------------------------------------------------------------------
# random plans over the zoo (acceptance)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(ZOO)), low_dtype=st.sampled_from([torch.bfloat16, torch.float16]), data=st.data())
def test_random_plans_run_forward_and_backward_with_sound_casts(name, low_dtype, data):
    model, inputs = make(name)
    analysis = compfx.analyze(model, inputs, low_dtype=low_dtype)
    bits = data.draw(st.text(alphabet="01f", min_size=len(analysis.ops), max_size=len(analysis.ops)), label="bits")
    gm = apply(model, compfx.Plan.from_bitstring(analysis, bits), analysis=analysis).graph_module

    out = gm(*inputs)
    out.float().sum().backward()

    assert out.dtype == torch.float32  # restored to what the model returns
    for pname, param in model.named_parameters():
        assert param.dtype == torch.float32
        assert param.grad is not None and param.grad.dtype == torch.float32, pname
    _assert_cast_invariants(gm)
    _assert_meta_matches_run(gm, inputs)


# ---------------------------------------------------------------------------
# semantics of single ops


def _all(gm, precision):
    return {node.meta[KEY_META]: precision for node in compfx.graph_capture.op_nodes(gm)}


def test_low_casts_activations_and_parameters_once_and_names_them():
    model, inputs = make("mlp")
    gm = compfx.capture(model, inputs)
    gm = apply_precisions(gm, _all(gm, "low"), low_dtype=torch.bfloat16)
    names = {n.name for n in _cast_nodes(gm)}
    assert {"fc1_weight_bf16", "fc1_bias_bf16", "fc2_weight_bf16", "fc2_bias_bf16", "x_bf16"} <= names
    assert "fc1_weight_bf16 = fc1_weight.to(torch.bfloat16)" in gm.code
    # relu's input is already bf16: no cast in between; one cast back for the output.
    assert count_casts(gm) == 6
    assert gm(*inputs).dtype == torch.float32


def test_inserted_casts_carry_module_stack_and_value_metadata():
    model, inputs = make("cnn")
    gm = compfx.capture(model, inputs)
    gm = apply_precisions(gm, _all(gm, "low"), low_dtype=torch.bfloat16)
    conv_weight_cast = next(n for n in _cast_nodes(gm) if n.name == "conv1_weight_bf16")
    assert "nn_module_stack" in conv_weight_cast.meta
    assert list(conv_weight_cast.meta["nn_module_stack"].values())[-1][0].endswith("conv1")
    assert conv_weight_cast.meta["val"].dtype == torch.bfloat16
    assert conv_weight_cast.meta["val"].shape == model.conv1.weight.shape


def test_norm_ops_cast_only_their_activation_and_running_stats_still_update():
    model, inputs = make("cnn")
    gm = compfx.capture(model, inputs)
    gm = apply_precisions(gm, _all(gm, "low"), low_dtype=torch.bfloat16)
    sources = {n.args[0].target for n in _cast_nodes(gm) if n.args[0].op == "get_attr"}
    assert not any(target.startswith(("bn1.", "bn2.")) for target in sources)
    before = model.bn1.running_mean.clone()
    gm(*inputs)
    assert not torch.equal(model.bn1.running_mean, before), "BatchNorm's running stats were not updated in place"
    assert model.bn1.running_mean.dtype == torch.float32


def test_integer_inputs_are_never_cast():
    model, inputs = make("embed_gru")
    gm = compfx.capture(model, inputs)
    gm = apply_precisions(gm, _all(gm, "low"), low_dtype=torch.bfloat16)
    assert all(meta_value(n.args[0]).is_floating_point() for n in _cast_nodes(gm))
    gm(*inputs).sum().backward()


def test_follow_on_other_ops_inserts_no_casts_but_mixed_inputs_a_kernel_rejects_are_widened():
    model, inputs = make("embed_gru")
    gm = compfx.capture(model, inputs)
    keys = {k.kind: k for k in _all(gm, "low")}
    # embedding low -> bf16 activations meet the GRU's FP32 weights, which torch.gru rejects.
    precisions = {keys["embedding"]: "low", keys["gru"]: "follow", keys["linear"]: "follow"}
    gm = apply_precisions(gm, precisions, low_dtype=torch.bfloat16)
    gru = next(n for n in gm.graph.nodes if n.meta.get(KEY_META) == keys["gru"])
    assert any(a.meta.get(CAST_META) and a.args[1] == torch.float32 for a in gru.all_input_nodes)
    gm(*inputs).sum().backward()

    mlp, x = make("mlp")
    gm = compfx.capture(mlp, x)
    gm = apply_precisions(gm, _all(gm, "follow"), low_dtype=torch.bfloat16)
    assert count_casts(gm) == 0


def test_follow_on_a_listed_op_casts_to_the_widest_input():
    class Mixed(nn.Module):
        def forward(self, a, b):
            return a.to(torch.bfloat16) @ b

    inputs = (torch.randn(3, 4), torch.randn(4, 2))
    gm = compfx.capture(Mixed(), inputs)
    gm = insert_casts(gm, _all(gm, "follow"), low_dtype=torch.bfloat16)
    (cast,) = _cast_nodes(gm)
    assert cast.args[1] == torch.float32 and meta_value(cast.args[0]).dtype == torch.bfloat16
    a, b = inputs
    assert torch.equal(gm(*inputs), a.to(torch.bfloat16).float() @ b)


def test_user_casts_are_kept_and_fp32_plan_adds_none():
    class RoundTrip(nn.Module):
        def forward(self, x):
            return torch.sin(x.half().float())  # x -> fp16 -> fp32 is not the identity

    inputs = (torch.randn(8) * 1e-6,)
    gm = compfx.capture(RoundTrip(), inputs)
    gm = apply_precisions(gm, _all(gm, "fp32"), low_dtype=torch.bfloat16)
    assert count_casts(gm) == 2 and not _cast_nodes(gm)
    assert torch.equal(gm(*inputs), RoundTrip()(*inputs))


def test_in_place_ops_keep_their_mutated_input_uncast():
    class InPlace(nn.Module):
        def forward(self, x):
            y = x * 2
            z = F.relu(y, inplace=True)  # y is relu'd too: casting it would lose that
            return z + y

    inputs = (torch.randn(6),)
    gm = compfx.capture(InPlace(), inputs)
    gm = apply_precisions(gm, _all(gm, "low"), low_dtype=torch.bfloat16)
    relu = next(n for n in gm.graph.nodes if n.meta.get(KEY_META) and n.meta[KEY_META].kind == "relu")
    assert not any(a.meta.get(CAST_META) for a in relu.all_input_nodes)
    torch.testing.assert_close(gm(*inputs), InPlace()(*inputs), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", ["fp32", "low", "follow"])
def test_an_in_place_method_whose_result_is_unused_survives_the_rewrite(precision):
    class AddInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            h.add_(x)  # FX takes call_method add_ for pure: dead-code elimination would drop the write
            return h * 2

    model, inputs = AddInPlace(), (torch.randn(3, 4),)
    gm = compfx.capture(model, inputs)
    gm = apply_precisions(gm, _all(gm, precision), low_dtype=torch.bfloat16)
    assert any(n.target == "add_" for n in gm.graph.nodes)
    tolerance = 0 if precision != "low" else 5e-2
    torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=tolerance, atol=tolerance)


def test_shared_parameter_is_cast_once_like_autocasts_weight_cache():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    model, inputs = Tied(), (torch.randn(2, 4),)
    analysis = compfx.analyze(model, inputs)
    gm = apply(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False).graph_module
    weight_casts = [n for n in _cast_nodes(gm) if n.args[0].op == "get_attr" and n.args[0].target.endswith("weight")]
    assert len(weight_casts) == 1
    assert count_casts(gm) == count_autocast_casts(model, inputs, dtype=torch.bfloat16) == 4


def test_insert_casts_leaves_outputs_low_and_restore_output_dtypes_casts_them_back_once():
    model, inputs = make("mlp")
    gm = compfx.capture(model, inputs)
    before = output_dtypes(gm)
    gm = insert_casts(gm, _all(gm, "low"), low_dtype=torch.float16)
    assert before == [torch.float32] and gm(*inputs).dtype == torch.float16
    casts = count_casts(gm)
    gm = restore_output_dtypes(gm, before)
    assert gm(*inputs).dtype == torch.float32 and count_casts(gm) == casts + 1
    assert count_casts(restore_output_dtypes(gm, before)) == casts + 1  # already restored: nothing to add
    with pytest.raises(PassError, match="returns 1 nodes but 2 dtypes"):
        restore_output_dtypes(gm, before * 2)


def test_a_returned_activation_gets_its_own_cast_back_even_where_an_op_reads_one():
    class TwoOutputs(nn.Module):
        def forward(self, x):
            y = torch.relu(x.bfloat16())  # y feeds an op the plan runs in FP32, and is returned too
            return torch.softmax(y, -1), y

    gm = compfx.capture(TwoOutputs(), (torch.randn(3, 4),))
    precisions = {key: "fp32" if key.kind == "softmax" else "follow" for key in _all(gm, "follow")}
    gm = insert_casts(gm, precisions, low_dtype=torch.bfloat16)
    casts = count_casts(gm)
    gm = restore_output_dtypes(gm, [torch.float32, torch.float32])
    assert count_casts(gm) == casts + 1  # being returned is a use: one cast per use (cast_policy.shares_cast)
    _assert_cast_invariants(gm)
    assert [t.dtype for t in gm(torch.randn(3, 4))] == [torch.float32, torch.float32]


@pytest.mark.parametrize("plan", ["amp", "low"])
def test_native_multi_head_attentions_tuple_comes_back_in_the_models_dtype(plan):
    model, x = NativeMHA().eval(), torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = model(x)
        analysis = compfx.analyze(model, (x,))
        assert output_dtypes(analysis.graph_module) == [(torch.float32, torch.float32)]
        plan = compfx.Plan.amp(analysis) if plan == "amp" else compfx.Plan.uniform(analysis, "low")
        gm = apply(model, plan, analysis=analysis).graph_module
        out = gm(x)
    assert cast_report(gm).autocast_regions == 1  # the op ran low, under autocast
    assert type(out) is tuple and [t.dtype for t in out] == [torch.float32, torch.float32]
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
    assert output_dtypes(gm) == [torch.float32, torch.float32]  # now two returned nodes, both restored
    assert count_casts(restore_output_dtypes(gm, output_dtypes(gm))) == count_casts(gm)


def test_propagate_dtypes_refreshes_values_downstream_of_a_changed_dtype():
    model, inputs = make("cnn")
    gm = compfx.capture(model, inputs)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    x.meta["val"] = x.meta["val"].to(torch.bfloat16)
    conv = next(n for n in compfx.graph_capture.op_nodes(gm) if n.meta[KEY_META].kind == "conv2d")
    assert meta_value(conv).dtype == torch.float32  # stale until propagated
    propagate_dtypes(gm)
    assert meta_value(conv).dtype == torch.float32  # bf16 input, FP32 weight: promoted on fakes
    assert meta_value(conv).shape == conv.meta["tensor_meta"].shape


def test_composite_low_runs_under_autocast_and_is_reported():
    model, inputs = make("mha")
    gm = compfx.capture(model, inputs)
    gm = apply_precisions(gm, _all(gm, "low"), low_dtype=torch.bfloat16)
    regions = [m for m in gm.modules() if isinstance(m, AutocastRegion)]
    assert len(regions) == 1 and regions[0].dtype == torch.bfloat16
    assert cast_report(gm).autocast_regions == 1
    assert not any("autocast" in k for k in gm.state_dict())  # the region owns no weights
    gm(*inputs).sum().backward()


# ---------------------------------------------------------------------------
# errors


def test_missing_precision_raises_pass_error_and_leaves_graph_unchanged():
    model, inputs = make("mlp")
    gm = compfx.capture(model, inputs)
    code = gm.code
    partial = dict(list(_all(gm, "low").items())[:1])
    with pytest.raises(PassError, match="insert_casts: no precision for 2 op"):
        apply_precisions(gm, partial, low_dtype=torch.bfloat16)
    assert gm.code == code
    apply_precisions(gm, partial, low_dtype=torch.bfloat16, default_precision="follow")  # the backend's way


@pytest.mark.parametrize("precision, low_dtype, message", [
    ("half", torch.bfloat16, "unknown precision"),
    ("low", torch.float32, "low_dtype"),
])
def test_bad_arguments_raise_pass_error(precision, low_dtype, message):
    model, inputs = make("mlp")
    gm = compfx.capture(model, inputs)
    with pytest.raises(PassError, match=message):
        insert_casts(gm, _all(gm, precision), low_dtype=low_dtype)


# ---------------------------------------------------------------------------
# dynamo graphs (what the torch.compile backend hands the pass)


@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder_matmul"])
def test_pass_works_on_dynamo_graphs_with_lifted_parameters(name):
    model, inputs = make(name)
    seen = {}

    def backend(gm, example_inputs):
        keys = key_dynamo_graph(gm)
        gm = apply_precisions(gm, {k: "low" for k in keys}, low_dtype=torch.bfloat16)
        seen["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    out = compiled(*inputs)
    gm = seen["gm"]
    assert out.dtype == torch.float32
    assert _cast_nodes(gm) and all("example_value" in n.meta for n in _cast_nodes(gm))
    _assert_cast_invariants(gm)
    reference = apply(model, compfx.Plan.uniform(compfx.analyze(model, inputs), "low"), inputs)
    torch.testing.assert_close(out, reference(*inputs), rtol=0, atol=0)


# the rewrite's own readings of node values: fast, and the same as pytree's ---------------------------

_meta_values = st.recursive(
    st.one_of(st.none(), st.integers(-3, 3), st.floats(allow_nan=False, width=16), st.booleans(),
              st.sampled_from([torch.float32, torch.bfloat16]),
              st.builds(lambda n, dtype: torch.empty(n, 2, dtype=dtype), st.integers(1, 3),
                        st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
                            st.dictionaries(st.sampled_from("abc"), inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(_meta_values)
def test_the_leaves_of_a_value_are_pytrees_leaves(value):
    from compfx.passes.propagate_dtypes import _leaves

    assert [id(leaf) for leaf in _leaves(value)] == [id(leaf) for leaf in pytree.tree_leaves(value)]


@settings(max_examples=200, deadline=None)
@given(_meta_values, _meta_values)
def test_two_calls_share_a_fake_result_only_when_they_are_alike(first, second):
    # a shared key must mean the same op on the same metadata: the rewrite reuses that call's fake result
    from compfx.passes.propagate_dtypes import _fake_call_key

    def alike(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (type(a) is type(b) and a.shape == b.shape and a.stride() == b.stride()
                    and a.dtype == b.dtype and a.requires_grad == b.requires_grad)
        if type(a) is not type(b):
            return False
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(map(alike, a, b))
        if isinstance(a, dict):
            return list(a) == list(b) and all(alike(a[k], b[k]) for k in a)
        return a == b

    keys = _fake_call_key("aten.op", first), _fake_call_key("aten.op", second)
    assert None not in keys
    assert (keys[0] == keys[1]) == alike(first, second)


def test_a_call_with_an_unhashable_argument_shares_nothing_and_alike_scalars_stay_apart():
    from compfx.passes.propagate_dtypes import _fake_call_key

    assert _fake_call_key("op", torch.empty(3), {1, 2}) is None
    assert _fake_call_key("op", torch.empty(2), 1) != _fake_call_key("op", torch.empty(2), 1.0)
    assert _fake_call_key("op", torch.empty(2), 1) != _fake_call_key("op", torch.empty(2), True)
    assert _fake_call_key("op", [torch.empty(2)]) != _fake_call_key("op", (torch.empty(2),))


def test_a_rewrite_under_no_grad_prices_the_same_casts_as_one_with_grad():
    # a planned block builds its graph inside a forward, under no_grad; what needs a gradient (and so whether a
    # cast has a backward to pay for) must read as the capture recorded it, whatever the rewrite's grad mode
    model, inputs = make("mlp")
    analysis = compfx.analyze(model, inputs)
    plan = compfx.Plan.amp(analysis)
    with torch.no_grad():
        quiet = planned_graph(analysis.graph_module, plan, analysis)
    with torch.enable_grad():
        loud = planned_graph(analysis.graph_module, plan, analysis)
    assert casts_in(quiet) == casts_in(loud)
    assert any(cast.backward and not cast.parameter for cast in casts_in(loud))  # activations' casts have one


def test_layer_and_group_norm_parameters_are_cast_with_their_input_on_cuda_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compfx.cast_policy import castable

    with FakeTensorMode(allow_non_fake_inputs=True):
        on_cuda = torch.empty(4, device="cuda")
    on_cpu = torch.ones(4)
    # CUDA's layer and group norm kernels read weight and bias in the input's dtype; batch norm's read FP32
    assert castable("layer_norm", 2, on_cuda) and castable("group_norm", "weight", on_cuda)
    assert not castable("batch_norm", 1, on_cuda) and not castable("instance_norm", "weight", on_cuda)
    assert not castable("layer_norm", 2, on_cpu) and not castable("group_norm", 2, on_cpu)
    assert castable("layer_norm", 0, on_cpu)  # the input itself always is
