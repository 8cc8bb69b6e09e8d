"""compfx.apply: FP32 plans are the model bit for bit, AMP plans are torch.autocast, state is shared."""

from __future__ import annotations

import copy

import pytest
import torch

import compfx
from compfx.planned_module import apply
from compfx.errors import BadInputError, PlanFileError, PlanMismatchError
from compfx.passes import count_autocast_casts, count_casts
from zoo import ZOO, make

ZOO_NAMES = sorted(ZOO)


def _forward_backward(module, inputs, params, autocast_dtype=None):
    """One seeded forward and backward; returns the output and each named parameter's grad."""
    for param in params.values():
        param.grad = None
    torch.manual_seed(1234)  # dropout draws the same mask in both runs
    if autocast_dtype is None:
        out = module(*inputs)
    else:
        with torch.autocast("cpu", dtype=autocast_dtype):
            out = module(*inputs)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out.float() * weights).sum().backward()
    return out, {name: p.grad for name, p in params.items()}


# ---------------------------------------------------------------------------
# acceptance: FP32 plan is the original model, bit for bit


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_fp32_plan_is_bitwise_the_original_model(name):
    model, inputs = make(name)
    reference = copy.deepcopy(model)
    analysis = compfx.analyze(model, inputs)
    gm = apply(model, compfx.Plan.fp32(analysis), analysis=analysis)

    expected, expected_grads = _forward_backward(reference, inputs, dict(reference.named_parameters()))
    out, grads = _forward_backward(gm, inputs, dict(model.named_parameters()))

    assert count_casts(gm) == 0
    assert torch.equal(out, expected)
    for pname, grad in expected_grads.items():
        assert torch.equal(grads[pname], grad), pname
    for bname, buffer in reference.named_buffers():  # running stats updated in place, identically
        if bname.endswith(("running_mean", "running_var")):
            assert torch.equal(model.get_buffer(bname), buffer), bname


# ---------------------------------------------------------------------------
# acceptance: AMP plan is torch.autocast


@pytest.mark.parametrize("low_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_amp_plan_matches_real_autocast(name, low_dtype):
    model, inputs = make(name)
    reference = copy.deepcopy(model)
    analysis = compfx.analyze(model, inputs, low_dtype=low_dtype)
    gm = apply(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False)

    expected, expected_grads = _forward_backward(reference, inputs, dict(reference.named_parameters()), low_dtype)
    out, grads = _forward_backward(gm, inputs, dict(model.named_parameters()))

    assert out.dtype == expected.dtype  # autocast's own output dtype, since we did not restore it
    torch.testing.assert_close(out, expected)
    for pname, grad in expected_grads.items():
        assert grads[pname].dtype == torch.float32
        # grads are FP32 tensors computed from low-precision ops: compare at the low dtype's tolerance
        assert torch.equal(grads[pname], grad), pname


@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder_matmul", "encoder_sdpa", "shape_branch"])
def test_amp_plan_inserts_as_many_casts_as_autocast_performs(name):
    model, inputs = make(name)
    analysis = compfx.analyze(model, inputs)
    gm = apply(model, compfx.Plan.amp(analysis), analysis=analysis, restore_output_dtypes=False)
    assert count_casts(gm) == count_autocast_casts(model, inputs, dtype=torch.bfloat16)


def test_outputs_come_back_in_the_models_dtype_by_default():
    model, inputs = make("mlp")
    analysis = compfx.analyze(model, inputs)
    gm = apply(model, compfx.Plan.uniform(analysis, "low"), analysis=analysis)
    assert gm(*inputs).dtype == torch.float32
    assert "fc1_weight_bf16 = fc1_weight.to(torch.bfloat16)" in gm.graph_module.code


# ---------------------------------------------------------------------------
# shared state: optimizer, state_dict, checkpoints


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_state_dict_keys_and_dtypes_match_and_checkpoints_load_both_ways(name):
    model, inputs = make(name)
    analysis = compfx.analyze(model, inputs)
    gm = apply(model, compfx.Plan.amp(analysis), analysis=analysis)

    original, applied = model.state_dict(), gm.state_dict()
    assert sorted(applied) == sorted(original)
    assert all(applied[k].dtype == original[k].dtype for k in original)
    assert all(p.dtype == torch.float32 for p in gm.parameters())  # master weights stay FP32

    other, _ = make(name, seed=1)
    gm.load_state_dict(other.state_dict())  # checkpoint of the original model -> applied module
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.state_dict().items())
    fresh, _ = make(name, seed=2)
    fresh.load_state_dict(gm.state_dict())  # and back
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in other.state_dict().items())


def test_applied_module_trains_the_models_own_parameters():
    model, inputs = make("cnn")
    analysis = compfx.analyze(model, inputs)
    gm = apply(model, compfx.Plan.amp(analysis), analysis=analysis)
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.head.weight.detach().clone()
    gm(*inputs).square().mean().backward()
    optimizer.step()
    assert not torch.equal(model.head.weight, before)
    assert gm.get_parameter("head.weight") is model.head.weight


def test_apply_captures_when_given_example_inputs_and_leaves_the_analysis_alone():
    model, inputs = make("encoder_matmul")
    analysis = compfx.analyze(model, inputs)
    code = analysis.graph_module.code
    plan = compfx.Plan.amp(analysis)
    from_inputs = apply(model, plan, inputs)
    from_analysis = apply(model, plan, analysis=analysis)
    assert analysis.graph_module.code == code
    assert from_inputs.graph_module.code == from_analysis.graph_module.code
    assert torch.equal(from_inputs(*inputs), from_analysis(*inputs))


@pytest.mark.parametrize("given", ["analysis", "example_inputs"])
def test_apply_always_returns_a_planned_module_that_runs_any_signature(given):
    model, inputs = make("mlp")
    analysis = compfx.analyze(model, inputs)
    plan = compfx.Plan.amp(analysis)
    planned = apply(model, plan, analysis=analysis) if given == "analysis" else apply(model, plan, inputs)
    assert isinstance(planned, compfx.PlannedModule) and planned.plan is plan
    assert isinstance(planned.graph_module, torch.fx.GraphModule)
    wider = tuple(torch.cat([x, x]) for x in inputs)  # another batch size: captured again on first use
    assert planned(*wider).shape[0] == 2 * inputs[0].shape[0] and len(planned.graphs) == 2
    assert not any(isinstance(m, compfx.PlannedModule) for m in model.modules())  # the model is not changed


def test_a_graph_module_attribute_on_a_planned_module_says_where_the_graph_is():
    model, inputs = make("mlp")
    planned = apply(model, compfx.Plan.amp(compfx.analyze(model, inputs)), inputs)
    with pytest.raises(AttributeError, match=r"read \.graph_module\.code"):
        planned.code
    assert not hasattr(planned, "graph") and "graph" in dir(planned.graph_module)  # duck typing sees no graph
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'$"):
        planned.no_such_thing


# ---------------------------------------------------------------------------
# acceptance: plans that do not fit are refused, the model is unchanged


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, snapshot):
    state = model.state_dict()
    return state.keys() == snapshot.keys() and all(torch.equal(state[k], v) for k, v in snapshot.items())


def test_plan_from_another_model_is_refused_before_anything_is_applied():
    model, inputs = make("mlp")
    other, other_inputs = make("cnn")
    plan = compfx.Plan.amp(compfx.analyze(other, other_inputs))
    analysis = compfx.analyze(model, inputs)
    code, snapshot = analysis.graph_module.code, _snapshot(model)
    with pytest.raises(PlanMismatchError, match="does not match the model"):
        apply(model, plan, analysis=analysis)
    with pytest.raises(PlanMismatchError):
        apply(model, plan, inputs)
    assert _unchanged(model, snapshot) and analysis.graph_module.code == code


def test_corrupt_plan_file_and_wrong_bitstring_are_refused(tmp_path):
    model, inputs = make("mlp")
    analysis = compfx.analyze(model, inputs)
    snapshot = _snapshot(model)
    path = tmp_path / "plan.json"
    compfx.Plan.amp(analysis).save(path)
    path.write_text(path.read_text()[:-20])
    with pytest.raises(PlanFileError):
        apply(model, compfx.Plan.load(path), analysis=analysis)
    with pytest.raises(PlanMismatchError, match="length 2, but the model has 3 ops"):
        apply(model, compfx.Plan.from_bitstring(analysis, "01"), analysis=analysis)
    assert _unchanged(model, snapshot)


def test_bad_arguments_are_refused_with_advice():
    model, inputs = make("mlp")
    analysis = compfx.analyze(model, inputs)
    with pytest.raises(BadInputError, match="needs example_inputs"):
        apply(model, compfx.Plan.amp(analysis))
    with pytest.raises(BadInputError, match="compfx.Plan"):
        apply(model, {"fc1:linear#0": "low"}, inputs)
    twin, _ = make("mlp")
    with pytest.raises(BadInputError, match="another model object"):
        apply(twin, compfx.Plan.amp(analysis), analysis=analysis)
