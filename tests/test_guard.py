"""compfx.Guard: a plan repaired in training when an op overflows, in place, and kept across a checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx.planned_module import PlannedModule
from compfx.examples import Drifting
from compfx.vocabulary import Precision, Stage

pytestmark = pytest.mark.usefixtures("one_thread")

EXP = compfx.OpKey("", "exp", 0)
GROWS_AT = 5  # the step at which the buffer grows and exp leaves fp16's range
STEPS = 10


def batches(count: int = STEPS, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(count)]


def planned_drifting(plan_of=compfx.Plan.amp, seed: int = 0):
    torch.manual_seed(seed)
    model = Drifting()
    analysis = compfx.analyze(model, batches(1)[0][0], low_dtype=torch.float16)
    return model, PlannedModule(model, plan_of(analysis), analysis=analysis)


def train(model, fast, step, data) -> list[float]:
    """Train ``fast`` on ``data``; the buffer grows at GROWS_AT; ``step(optimizer, loss)`` ends each step."""
    losses = []
    for i, (x, y) in enumerate(data):
        if i == GROWS_AT:
            model.gain.fill_(20.0)
        step.optimizer.zero_grad()
        loss = F.cross_entropy(fast(x), y)
        loss.backward()
        step(loss)
        losses.append(loss.item())
    return losses


class Stepper:
    def __init__(self, optimizer, guard=None):
        self.optimizer, self.guard = optimizer, guard

    def __call__(self, loss):
        return self.guard.step(self.optimizer, loss) if self.guard else self.optimizer.step()


@pytest.mark.parametrize("plan_of", [compfx.Plan.amp, lambda a: compfx.Plan.uniform(a, "low")], ids=["amp", "all-low"])
def test_the_guard_repairs_the_exp_in_place_and_training_stays_finite(plan_of):
    model, fast = planned_drifting(plan_of)
    params = list(model.parameters())
    graph_params = {name: p for name, p in fast.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = compfx.Guard(fast)
    losses = train(model, fast, Stepper(optimizer, guard), batches())

    assert math.isnan(losses[GROWS_AT]) or math.isinf(losses[GROWS_AT])  # the step that found it
    assert all(math.isfinite(loss) for loss in losses[GROWS_AT + 1:])
    assert all(math.isfinite(loss) for loss in losses[:GROWS_AT])
    assert guard.repairs and guard.repairs[0].key == EXP and guard.repairs[0].step == GROWS_AT + 1
    assert guard.repairs[0].reason == "non-finite loss" and guard.skipped == 1
    assert fast.plan[EXP] is Precision.FP32
    assert all(torch.isfinite(p).all() for p in model.parameters())  # no NaN reached the weights
    assert all(a is b for a, b in zip(model.parameters(), params))  # the same Parameter objects ...
    assert all(fast.get_parameter(name) is p for name, p in graph_params.items())  # ... in the module ...
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], params))  # ... and the optimizer
    graph = fast.graph_module
    assert all(graph.get_parameter(name) is p for name, p in model.named_parameters())


def test_without_the_guard_the_loss_goes_nan():
    model, fast = planned_drifting()
    losses = train(model, fast, Stepper(torch.optim.SGD(model.parameters(), lr=0.1)), batches())
    assert all(math.isfinite(loss) for loss in losses[:GROWS_AT])
    assert all(math.isnan(loss) for loss in losses[GROWS_AT + 1:])  # NaN reached the weights


def test_the_repair_survives_a_checkpoint_through_the_plan():
    model, fast = planned_drifting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = compfx.Guard(fast)
    train(model, fast, Stepper(optimizer, guard), batches())
    checkpoint = json.loads(json.dumps(guard.state_dict()))  # plain JSON
    weights = model.state_dict()

    resumed_model, resumed = planned_drifting()  # a fresh process: the search's plan, no repairs
    resumed_model.load_state_dict(weights)
    assert resumed.plan[EXP] is not Precision.FP32
    resumed_guard = compfx.Guard(resumed)
    resumed_guard.load_state_dict(checkpoint)
    assert resumed.plan == fast.plan and resumed_guard.repairs == guard.repairs
    resumed_optimizer = torch.optim.SGD(resumed_model.parameters(), lr=0.1)
    losses = train(resumed_model, resumed, Stepper(resumed_optimizer, resumed_guard), batches(seed=1))
    assert all(math.isfinite(loss) for loss in losses) and resumed_guard.repairs == guard.repairs


def test_gradscaler_overflows_are_not_repairs():
    model, fast = planned_drifting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)  # the scaled loss overflows: the scaler's business
    guard = compfx.Guard(fast, scaler=scaler)
    x, y = batches(1)[0]
    optimizer.zero_grad()
    loss = F.cross_entropy(fast(x), y)
    scaler.scale(loss).backward()
    before = [p.detach().clone() for p in model.parameters()]
    assert guard.step(optimizer, loss) is False
    assert guard.repairs == [] and guard.scaler_skips == 1 and scaler.get_scale() < 2.0 ** 100
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    model.gain.fill_(20.0)  # a real forward overflow is still repaired under the scaler
    optimizer.zero_grad()
    loss = F.cross_entropy(fast(x), y)
    scaler.scale(loss).backward()
    assert guard.step(optimizer, loss) is False and [r.key for r in guard.repairs] == [EXP]


def test_repairs_are_noted_in_the_search_log(tmp_path):
    model, fast = planned_drifting()
    log = compfx.search.SearchLog(tmp_path / "search.jsonl")
    guard = compfx.Guard(fast, log=log)
    train(model, fast, Stepper(torch.optim.SGD(model.parameters(), lr=0.1), guard), batches(GROWS_AT + 2))
    notes = [r for r in compfx.search.SearchLog.read(tmp_path / "search.jsonl").notes() if r.stage == Stage.GUARD]
    assert [(n.extra["op"], n.extra["step"], n.extra["cause"]) for n in notes] == [(str(EXP), GROWS_AT + 1,
                                                                                     "non-finite loss")]


class Shrinking(nn.Module):
    """``fc(x) * 1e-7`` lands among fp16's subnormals (spacing 6e-8): the mul is where the drift from FP32 enters."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 4, bias=False)  # the output is the tiny signal's
        self.register_buffer("scale", torch.tensor(1e-7))

    def forward(self, x):
        return self.head(self.fc(x) * self.scale)


def test_the_shadow_check_moves_the_op_that_adds_the_drift():
    torch.manual_seed(0)
    model = Shrinking()
    analysis = compfx.analyze(model, torch.randn(16, 8), low_dtype=torch.float16)
    low = {compfx.OpKey("fc", "linear", 0): "low", compfx.OpKey("", "mul", 0): "low"}  # the head runs in FP32
    fast = PlannedModule(model, compfx.Plan.fp32(analysis).with_precisions(low), analysis=analysis)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = compfx.Guard(fast, shadow_every=2, drift_threshold=0.05)
    for x, y in batches(4):
        optimizer.zero_grad()
        loss = F.cross_entropy(fast(x), y)
        loss.backward()
        assert guard.step(optimizer, loss)  # drift is no reason to skip a step
    first = guard.repairs[0]
    assert first.key == compfx.OpKey("", "mul", 0) and first.reason.startswith("drift") and first.step == 2
    assert fast.plan[first.key] is Precision.FP32
    assert len(guard.repairs) == 1 and guard.drift < 0.05  # the check at step 4 found the repaired plan close to FP32


def test_nothing_is_repaired_while_training_is_finite():
    model, fast = planned_drifting()
    plan = fast.plan
    guard = compfx.Guard(fast, shadow_every=3)
    train(model, fast, Stepper(torch.optim.SGD(model.parameters(), lr=0.1), guard), batches(GROWS_AT))
    assert guard.repairs == [] and guard.skipped == 0 and fast.plan == plan


@pytest.mark.parametrize("kwargs, says", [
    ({"check_every": 0}, "check_every=0"),
    ({"shadow_every": 1.5}, "shadow_every=1.5"),
    ({"drift_threshold": -1}, "drift_threshold=-1"),
    ({"scaler": object()}, "GradScaler"),
])
def test_bad_arguments_are_refused(kwargs, says):
    _, fast = planned_drifting()
    with pytest.raises(compfx.BadInputError, match=says):
        compfx.Guard(fast, **kwargs)


def test_a_plain_model_or_a_bad_checkpoint_is_refused():
    model, fast = planned_drifting()
    with pytest.raises(compfx.BadInputError, match="PlannedModule"):
        compfx.Guard(model)
    with pytest.raises(compfx.PlanFileError, match="state_dict"):
        compfx.Guard(fast).load_state_dict({"plan": {}})


def test_with_gradient_accumulation_the_guard_repairs_an_overflow_in_an_earlier_micro_batch():
    # the guard diagnosed only the last forward before the step: an overflow in the first micro-batch was "no op
    # below FP32", so every such step was skipped without a repair
    model, fast = planned_drifting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = compfx.Guard(fast)
    (x, y), (x2, y2) = batches(2)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        first = F.cross_entropy(fast(x * 10), y)  # exp leaves fp16's range here ...
        (first / 2).backward()
        second = F.cross_entropy(fast(x2), y2)  # ... not here
        (second / 2).backward()
        loss = (first.detach() + second.detach()) / 2
        guard.step(optimizer, loss)
        losses.append(loss.item())
    assert not math.isfinite(losses[0]) and math.isfinite(losses[1])
    assert [r.key for r in guard.repairs] == [EXP] and fast.plan[EXP] is Precision.FP32
    assert guard.skipped == 1
