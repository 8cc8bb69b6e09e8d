"""A planned module never computes with tensors the model no longer holds.

After ``PlannedModule(model, plan)`` (or ``compfx.apply(..., per_module=...)``) the user may replace a Parameter,
load a checkpoint with ``assign=True``, swap a submodule for one of the same or another width, or move the model
to ``meta``. The planned module follows where that is exact (reads the new tensors, or captures the model again),
and refuses otherwise, saying what changed. Each test compares the planned module with the model's own eager
forward and backward, as the model is after the change, bitwise.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.planned_module import PlannedModule
from compfx.errors import BadInputError, PlanMismatchError

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.fc(x)).relu()


def net(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), Block(width), nn.Linear(width, 2))


def planned_net():
    torch.manual_seed(0)
    model, x = net(), torch.randn(5, 4)
    analysis = compfx.analyze(model, x)
    return model, PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis), x


def block_planned_net():
    torch.manual_seed(0)
    model, x = net(), torch.randn(5, 4)
    analysis = compfx.analyze(model, x)
    compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis, per_module=Block)
    return model, x


def eager_as_planned(model: nn.Module, planned_block: bool):
    """The model as it is now, run eagerly as the plan runs it: AMP's plan is autocast; planned per block, only the
    block runs under it (the rest of the model runs eagerly in FP32), and its output comes back in FP32."""
    def run(x):
        if not planned_block:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(x).float()
        h = model[1](model[0](x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = Block.forward(model[2], h).float()  # a PlannedBlock has the block's children, not its forward
        return model[3](h)
    return run


def outputs_and_grads(run, model, x):
    model.zero_grad(set_to_none=True)
    out = run(x)
    out.float().square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def _replace_parameter(model):
    model[2].fc.weight = nn.Parameter(torch.randn(8, 8))
    model[0].bias = nn.Parameter(torch.randn(8))


def _assign_checkpoint(model):
    torch.manual_seed(7)
    model.load_state_dict({k: v + torch.randn_like(v.float()).to(v.dtype) if v.is_floating_point() else v.clone()
                           for k, v in model.state_dict().items()}, assign=True)


def _same_width_submodule(model):
    model[2].fc = nn.Linear(8, 8)
    model[3] = nn.Linear(8, 2)


def _other_width(model):
    model[0], model[1], model[3] = nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)
    model[2].fc, model[2].norm = nn.Linear(16, 16), nn.LayerNorm(16)


CHANGES = {
    "replaced parameter": _replace_parameter,
    "load_state_dict(assign=True)": _assign_checkpoint,
    "replaced submodule, same width": _same_width_submodule,
    "replaced submodules, other width": _other_width,
}


@pytest.mark.parametrize("planned_block", [False, True], ids=["PlannedModule", "PlannedBlock"])
@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_planned_module_computes_with_the_tensors_the_model_holds_after_a_change(change, planned_block):
    # before: the planned module kept computing with the tensors it had captured, and nothing said so
    if planned_block:
        model, x = block_planned_net()
        run = model
    else:
        model, run, x = planned_net()
    run(x)  # a graph built (and, for PlannedModule, holding the tensors) before the change
    change(model)
    planned = outputs_and_grads(run, model, x)
    eager = outputs_and_grads(eager_as_planned(model, planned_block), model, x)
    torch.testing.assert_close(planned, eager, rtol=0, atol=0)


def test_a_planned_modules_graph_reads_the_models_new_parameter_object():
    model, planned, x = planned_net()
    new = nn.Parameter(torch.randn(8, 8))
    model[2].fc.weight = new
    planned(x)
    assert planned.graph_module.get_parameter("2.fc.weight") is new
    assert planned.get_parameter("2.fc.weight") is new  # its own state_dict and parameters() follow too
    shadow = planned.captures.get(planned.signature((x,), {}), (x,), {}, {})[0].graph_module
    assert shadow.get_parameter("2.fc.weight") is new  # the FP32 graph diagnose and the guard compare with, too


@pytest.mark.parametrize("planned_block", [False, True], ids=["PlannedModule", "PlannedBlock"])
def test_a_model_moved_to_meta_is_refused_until_its_weights_are_loaded_again(planned_block):
    # before: the planned module ran with the tensors it held, silently
    if planned_block:
        model, x = block_planned_net()
        run = model
    else:
        model, run, x = planned_net()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model.to("meta")
    with pytest.raises(BadInputError, match="meta device.*to_empty"):
        run(x.to("meta") if planned_block else x)
    model.to_empty(device="cpu")
    model.load_state_dict(weights)
    out = run(x)
    assert out.device.type == "cpu" and torch.isfinite(out).all()


@pytest.mark.parametrize("planned_block", [False, True], ids=["PlannedModule", "PlannedBlock"])
def test_a_submodule_replaced_by_one_with_other_ops_is_refused_naming_them(planned_block, caplog):
    if planned_block:
        model, x = block_planned_net()
        run = model
    else:
        model, run, x = planned_net()
    model[2].fc = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    with caplog.at_level(logging.WARNING, logger="compfx"), pytest.raises(PlanMismatchError, match="fc.1:gelu#0"):
        run(x)
    assert "changed after it was planned" in caplog.text and "fc (Linear -> Sequential)" in caplog.text


def test_load_state_dict_through_the_planned_module_loads_into_the_model():
    model, planned, x = planned_net()
    state = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    planned.load_state_dict(state)
    torch.testing.assert_close(model[0].weight, state["0.weight"], rtol=0, atol=0)
    wide = net(16).state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for assign in (False, True):  # before: torch's RuntimeError, after loading the tensors that fit
        with pytest.raises(BadInputError, match="other shapes than the model's: 0.weight"):
            planned.load_state_dict(wide, assign=assign)
    with pytest.raises(BadInputError, match="1 key\\(s\\) missing"):
        planned.load_state_dict({k: v for k, v in state.items() if k != "0.bias"})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded
    assigned = {k: v.clone() for k, v in state.items()}
    planned.load_state_dict(assigned, assign=True)
    planned(x)
    assert torch.equal(model[0].weight, assigned["0.weight"])
    assert planned.graph_module.get_parameter("0.weight") is model[0].weight  # the graph reads what was loaded


def test_moving_the_planned_module_moves_the_models_buffers_with_its_parameters():
    # before: .to() moved the shared Parameters but left the model's buffers (BatchNorm's statistics) behind
    model, planned, x = planned_net()
    planned.to("meta")
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    assert planned.get_buffer("1.running_mean") is model[1].running_mean


@pytest.mark.parametrize("model_arg, analysis_arg, words", [
    (None, "analysis", "model \\(an nn.Module\\) first"),
    ("model", None, "analysis=compfx.analyze"),
])
def test_planned_module_without_a_model_or_an_analysis_says_what_to_pass(model_arg, analysis_arg, words):
    # before: AttributeError
    model, planned, x = planned_net()
    args = {"model": model, "analysis": planned.analysis}
    with pytest.raises(BadInputError, match=words):
        PlannedModule(args[model_arg] if model_arg else None, planned.plan,
                      analysis=args[analysis_arg] if analysis_arg else None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to move the model to")
def test_a_model_moved_to_another_device_is_captured_again_there():
    # the graphs were captured on the CPU (device constants, the CPU's autocast); on CUDA they are captured again
    model, planned, x = planned_net()
    model.to("cuda")
    out = planned(x.cuda())
    analysis = compfx.analyze(model, x.cuda(), low_dtype=planned.plan.low_dtype)
    again = PlannedModule(model, planned.plan, analysis=analysis)
    assert out.device.type == "cuda" and planned.captures.device.type == "cuda"
    torch.testing.assert_close(out, again(x.cuda()), rtol=0, atol=0)
