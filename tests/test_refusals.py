"""Each misuse is a CompfxError that names the fix, before any work; what was silently accepted is refused.

One test per case (parametrized where cases share a shape). Each says what happened before: a raw error from
inside torch or Python, a search that would not end, or nothing at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx.planned_module import PlannedModule
from compfx.compile_backend import compile_with_plan
from compfx.cli import main
from compfx.errors import BadInputError, CompfxError, PlanFileError, PlanMismatchError

from tests.helpers import batches, ce

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

CHEAP = dict(progress=False, warmup=0, repeats=1, stage1_budget=2, stage2_budget=1, stage2_check_batches=1,
             predictor="off", cache_plan=False)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.fixture
def planned():
    model = mlp()
    analysis = compfx.analyze(model, torch.randn(4, 8))
    return model, PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis)


# -- compile_with_plan: checked before torch.compile ----------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"dynamic": "yes"}, "dynamic='yes'; expected None"),  # before: torch.compile took it without a word
    ({"fullgraph": "no"}, "fullgraph='no'; expected True or False"),  # before: 'no' is truthy: fullgraph=True
    ({"inductor_options": "fast"}, "expected a mapping of Inductor config names"),  # before: TypeError
    ({"inductor_options": {"no_such_option": 1}}, "not Inductor config options"),  # before: at the first call
], ids=["dynamic", "fullgraph", "inductor options not a mapping", "unknown inductor option"])
def test_compile_with_plan_refuses_bad_options_before_compiling(planned, kwargs, words):
    model, module = planned
    with pytest.raises(BadInputError, match=words):
        compile_with_plan(model, module.plan, **kwargs)


def _raises(gm, example_inputs):
    raise RuntimeError("my backend is broken")


def _returns_none(gm, example_inputs):
    return None


@pytest.mark.parametrize("inner, words", [(_raises, "raised RuntimeError: my backend is broken"),
                                          (_returns_none, "returned NoneType, not a callable")],
                         ids=["raises", "returns None"])
def test_an_inner_backend_that_fails_is_a_compfx_error_naming_it(planned, inner, words, fresh_dynamo):
    # before: torch._dynamo's BackendCompilerFailed, from deep inside dynamo
    model, module = planned
    compiled = compile_with_plan(model, module.plan, inner=inner)
    with pytest.raises(BadInputError, match=f"inner backend '{inner.__name__}' {words}.*inner='inductor'"):
        compiled(torch.randn(4, 8))


def test_an_inner_backend_that_cannot_be_called_as_one_is_refused_at_once(planned):
    model, module = planned
    with pytest.raises(BadInputError, match="cannot be called as inner\\(gm, example_inputs\\)"):
        compile_with_plan(model, module.plan, inner=lambda: None)


# -- the guard ------------------------------------------------------------------------------------

def _backward(module):
    loss = module(torch.randn(4, 8)).square().mean()
    loss.backward()
    return loss


def test_guard_step_refuses_an_optimizer_that_needs_a_closure(planned):
    # before: TypeError from inside LBFGS.step
    model, module = planned
    guard = compfx.Guard(module)
    loss = _backward(module)
    with pytest.raises(BadInputError, match="LBFGS, whose step\\(\\) needs a closure"):
        guard.step(torch.optim.LBFGS(model.parameters()), loss)


def test_guard_step_refuses_a_batch_its_loss_fn_cannot_take_and_takes_no_step(planned):
    # before: the loss function's own TypeError, raised inside the shadow comparison
    model, module = planned
    guard = compfx.Guard(module, shadow_every=1, loss_fn=ce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = _backward(module)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BadInputError, match="batch loss_fn cannot take"):
        guard.step(optimizer, loss, batch="garbage")
    assert guard.steps == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert guard.step(optimizer, loss, batch=(None, torch.randint(0, 3, (4,)))) is True  # the same step, retried


def test_guard_refuses_the_grad_scaler_class_for_an_object(planned):
    # before: accepted (the class has the methods), failing at the first step
    with pytest.raises(BadInputError, match="the class GradScaler"):
        compfx.Guard(planned[1], scaler=torch.amp.GradScaler)


def test_a_second_guard_on_one_module_is_refused_until_the_first_is_removed(planned):
    # before: two guards each repaired the plan and stepped the optimizer
    first = compfx.Guard(planned[1])
    with pytest.raises(BadInputError, match="already has a compfx.Guard"):
        compfx.Guard(planned[1])
    first.remove()
    assert compfx.Guard(planned[1]).steps == 0


def test_a_guard_state_repairing_an_op_the_model_lacks_is_refused(planned):
    # before: loaded, its repair record naming an op of another model
    guard = compfx.Guard(planned[1])
    state = guard.state_dict()
    state["repairs"] = [{"key": "9:linear#0", "step": 3, "reason": "non-finite loss", "was": "low"}]
    with pytest.raises(PlanMismatchError, match="9:linear#0"):
        guard.load_state_dict(state)
    assert guard.repairs == []


def test_guard_step_with_one_optimizer_over_the_planned_module_and_an_unplanned_head(planned):
    # before: refused ("parameter(s) that are not the guarded module's"), though it is an ordinary setup
    model, module = planned
    head = nn.Linear(3, 2)
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    guard = compfx.Guard(module)
    before = head.weight.detach().clone()
    loss = head(module(torch.randn(4, 8))).square().mean()
    loss.backward()
    assert guard.step(optimizer, loss) is True
    assert not torch.equal(before, head.weight) and guard.steps == 1
    with pytest.raises(BadInputError, match="only parameters that are not the guarded module's"):
        guard.step(torch.optim.SGD(head.parameters(), lr=0.1), loss)


# -- the command line ------------------------------------------------------------------------------

def meta_inputs():
    """``--inputs`` for the CLI tests: token ids on the meta device (shapes, no values)."""
    return torch.zeros(4, 64, device="meta")


def _cli_exit(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusal
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    (["search", "compfx.examples:mlp", "--inputs", "tests.test_refusals:meta_inputs", "--loss",
      "tests.test_refusals:mean_loss"], "meta device"),  # before: a raw error from inside the search
    (["search", "compfx.examples:mlp", "--input-shape", "4,64", "--classes", "10", "--batches", "1000000000"],
     "more than the 10,000"),  # before: std::bad_alloc after two minutes
    (["search", "compfx.examples:mlp", "--input-shape", "4096,64", "--classes", "10", "--batches", "10000"],
     "synthetic batches may hold"),
], ids=["inputs on meta", "a billion batches", "batches too large together"])
def test_cli_search_refuses_inputs_it_cannot_run_with_one_line(argv, words, capsys):
    assert words in _cli_exit(argv, capsys)


def mean_loss(output, batch):
    return output.float().mean()


def meta_batches():
    """``--data`` for the CLI tests: (inputs, target) batches on the meta device."""
    return [(torch.zeros(4, 64, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))] * 2


def test_cli_search_refuses_batches_on_meta_from_a_data_factory(capsys):
    # before: a raw error from moving the batch ("Cannot copy out of meta tensor")
    err = _cli_exit(["search", "compfx.examples:mlp", "--data", "tests.test_refusals:meta_batches"], capsys)
    assert "meta device" in err and "real tensors" in err


# -- the search's settings and arguments ------------------------------------------------------------

@pytest.mark.parametrize("name", ["rounds", "repeats", "warmup"])
def test_search_config_refuses_step_counts_that_would_not_end(name):
    # before: SearchConfig(rounds=10**9) was accepted, and the search ran for ever
    with pytest.raises(BadInputError, match=f"{name}=1000000000.*\\[.*, 1000\\]"):
        compfx.SearchConfig(**{name: 10 ** 9})


class ReturnsText(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        self.fc(x)
        return "done"


_OTHER = nn.Linear(8, 3)

LOSSES_NOT_TIED = {  # model, loss_fn: each loss requires grad, and none reaches the model's parameters
    "another model's output": (mlp, lambda out, batch: ce(_OTHER(batch[0]), batch)),
    "a leaf tensor made from a float": (mlp, lambda out, batch: torch.tensor(ce(out, batch).item(), requires_grad=True)),
    "a forward returning a string": (ReturnsText, lambda out, batch: _OTHER(batch[0]).sum() * len(out)),
}


@pytest.mark.parametrize("make, loss_fn", LOSSES_NOT_TIED.values(), ids=LOSSES_NOT_TIED.keys())
def test_a_loss_that_does_not_reach_the_models_parameters_is_refused(make, loss_fn):
    # before: accepted; the search trained nothing and compared plans on a loss they cannot change
    model = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BadInputError, match="does not depend on the model's parameters"):
        compfx.optimize(model, batches(2, (4, 8)), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        loss_fn=loss_fn, config=compfx.SearchConfig(**CHEAP))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class SwapsItsLayer(nn.Module):
    """Replaces its layer whenever a batch of ``swap_at`` rows comes (a ragged last batch: mid-search)."""

    def __init__(self, swap_at: int | None):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.swap_at = swap_at

    def forward(self, x):
        if self.swap_at is None or x.shape[0] == self.swap_at:
            self.fc = nn.Linear(8, 3)
        return self.fc(x)


@pytest.mark.parametrize("swap_at, loader", [(None, batches(2, (4, 8))),
                                              (3, batches(2, (4, 8)) + batches(1, (3, 8)))],
                         ids=["at every call", "mid-search, at a ragged batch"])
def test_a_forward_that_replaces_a_layer_is_refused_and_the_layer_put_back(swap_at, loader):
    # before: accepted; the optimizer trained a layer the model no longer held
    model = SwapsItsLayer(swap_at)
    layer = model.fc
    with pytest.raises(CompfxError, match="replace[sd]* submodules"):
        compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=ce,
                        config=compfx.SearchConfig(**CHEAP))
    assert model.fc is layer


# -- plans and analyses -----------------------------------------------------------------------------

def test_an_fp8_bitstring_on_an_analysis_without_fp8_is_refused_at_once():
    # before: Plan.from_bitstring(a, "8f0") built a plan that failed only when applied
    analysis = compfx.analyze(mlp(), torch.randn(4, 8))
    with pytest.raises(PlanMismatchError, match="cannot run FP8.*analyze\\(..., fp8=True\\)"):
        compfx.Plan.from_bitstring(analysis, "8f0")


@pytest.mark.parametrize("fingerprint", ["../outside", "0123", "0123456789ABCDEF", "/tmp/0123456789abcdef"])
def test_a_fingerprint_that_is_not_16_hex_digits_is_refused(fingerprint, tmp_path):
    # before: accepted, and "../outside" named a path outside the cache when the plan was cached
    analysis = compfx.analyze(mlp(), torch.randn(4, 8))
    with pytest.raises(PlanMismatchError, match="16 lowercase hex digits"):
        compfx.Plan(dict(compfx.Plan.amp(analysis)), low_dtype=analysis.low_dtype, fingerprint=fingerprint)
    data = {**compfx.Plan.amp(analysis).to_dict(), "fingerprint": fingerprint}
    path = tmp_path / "plan.json"
    path.write_text(__import__("json").dumps(data))
    with pytest.raises(PlanFileError, match="16 lowercase hex digits"):
        compfx.Plan.load(path)


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a GPU of index 7")
def test_analyze_for_a_cuda_device_this_process_cannot_see_needs_its_capability():
    # before: accepted; the Tensor Core and FP8 rules then read no capability, without a word
    with pytest.raises(BadInputError, match="'cuda:7' is not a device this process can see.*capability="):
        compfx.analyze(mlp(), torch.randn(4, 8), device="cuda:7")
    assert compfx.analyze(mlp(), torch.randn(4, 8), device="cuda:7", capability=(8, 0)).device.index == 7


def test_resume_refuses_a_cost_fn_lambda_swapped_for_another(tmp_path):
    # before: both lambdas were recorded as '<lambda>', so the resumed search replayed the other cost's samples
    log = tmp_path / "search.jsonl"

    def run(cost_fn, resume):
        model = mlp()
        return compfx.optimize(model, batches(2, (4, 8)), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               loss_fn=ce, config=compfx.SearchConfig(**CHEAP, cost_fn=cost_fn), log=log,
                               resume=resume)

    run(lambda plan, seconds: seconds, resume=False)
    assert run(lambda plan, seconds: seconds, resume=True).plan is not None  # the same function resumes
    with pytest.raises(PlanMismatchError, match="cost_fn"):
        run(lambda plan, seconds: 2 * seconds, resume=True)


def test_a_planned_modules_missing_arguments_and_other_checkpoints_are_compfx_errors():
    """PlannedModule(model=None), (analysis=None) and load_state_dict of other shapes: tests/test_model_changes.py."""
    model = mlp()
    analysis = compfx.analyze(model, torch.randn(4, 8))
    with pytest.raises(BadInputError):
        PlannedModule(None, compfx.Plan.amp(analysis), analysis=analysis)
    with pytest.raises(BadInputError):
        PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis).load_state_dict(mlp().state_dict() | {
            "0.weight": torch.zeros(2, 2)})
