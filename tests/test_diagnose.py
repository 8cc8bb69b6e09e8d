"""compfx.diagnose: per-op overflow, underflow and error against an FP32 shadow, without touching anything."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx.planned_module import PlannedModule
from compfx.cli import main
from compfx.examples import Drifting
from compfx.state import snapshot_state
from compfx.vocabulary import Precision

pytestmark = pytest.mark.usefixtures("one_thread")

EXP = compfx.OpKey("", "exp", 0)


def ce(output, batch):
    return F.cross_entropy(output, batch[-1])


def drifted(gain: float = 20.0):
    torch.manual_seed(0)
    model = Drifting()
    model.gain.fill_(gain)
    return model, (torch.randn(16, 8), torch.randint(0, 4, (16,)))


class WithState(nn.Module):
    """Drifting plus BatchNorm (statistics updated in forward) and dropout (draws from the RNG)."""

    def __init__(self):
        super().__init__()
        self.inner, self.norm, self.drop = Drifting(), nn.BatchNorm1d(8), nn.Dropout(0.2)

    def forward(self, x):
        return self.inner(self.drop(self.norm(x)))


def test_diagnose_flags_the_overflowing_exp_as_the_origin():
    model, batch = drifted()
    diagnosis = compfx.diagnose(model, batch, loss_fn=ce, low_dtype=torch.float16)  # no plan: "under AMP"
    exp = diagnosis.row(EXP)
    assert exp.overflow > 0 and exp.origin and exp.dtype == torch.float16 and exp.precision is Precision.FOLLOW
    assert diagnosis.origins == (EXP,) and not diagnosis.finite and math.isfinite(diagnosis.shadow_loss)
    assert math.isinf(exp.error)
    fc = diagnosis.row(compfx.OpKey("fc", "linear", 0))
    assert fc.overflow == 0 and not fc.origin and 0 < fc.error < 0.01  # upstream of exp: fine
    assert str(diagnosis).splitlines()[2].startswith(":exp#0")  # the riskiest row first


def test_a_planned_module_and_the_model_with_its_plan_give_the_same_rows():
    model, batch = drifted()
    analysis = compfx.analyze(model, batch[0], low_dtype=torch.float16)
    plan = compfx.Plan.uniform(analysis, "low")
    planned = compfx.diagnose(PlannedModule(model, plan, analysis=analysis), batch, loss_fn=ce)
    plain = compfx.diagnose(model, batch, loss_fn=ce, plan=plan)
    assert planned.rows == plain.rows and planned.origins[0] == EXP


def test_diagnose_leaves_model_optimizer_and_rng_bitwise_unchanged():
    torch.manual_seed(0)
    model = WithState()
    model.inner.gain.fill_(20.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    ce(model(x), (x, y)).backward()
    optimizer.step()  # optimizer state and gradients exist
    ce(model(x), (x, y)).backward()
    snapshot = snapshot_state(model, optimizer)
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    rng = torch.get_rng_state()
    modes = [m.training for m in model.modules()]
    params = list(model.parameters())

    diagnosis = compfx.diagnose(model, (x, y), loss_fn=ce, low_dtype=torch.float16)

    assert diagnosis.row(EXP.__class__("inner", "exp", 0)).overflow > 0
    assert snapshot.matches()  # parameters, gradients, buffers (BatchNorm statistics), optimizer state: bitwise
    assert torch.equal(rng, torch.get_rng_state())
    assert str(optimizer.state_dict()) == str(optimizer_state)
    assert [m.training for m in model.modules()] == modes and list(model.parameters()) == params


def test_underflow_and_error_against_the_shadow():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.register_buffer("scale", torch.tensor(1e-9))  # below fp16's smallest subnormal (6e-8)

        def forward(self, x):
            return self.fc(x) * self.scale

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(4, 8)
    analysis = compfx.analyze(model, x, low_dtype=torch.float16)
    low = compfx.diagnose(model, x, plan=compfx.Plan.uniform(analysis, "low"))
    mul = low.row(compfx.OpKey("", "mul", 0))
    assert mul.underflow == 1.0 and mul.overflow == 0 and mul.error == 1.0
    fp32 = compfx.diagnose(model, x, plan=compfx.Plan.fp32(analysis))
    assert all(row.error == 0 and row.underflow == 0 and row.grad_error == 0 for row in fp32.rows)
    assert fp32.finite and fp32.loss == fp32.shadow_loss


def test_a_backward_overflow_names_the_op_whose_backward_overflows():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    x = torch.full((64, 4), 100.0)  # the first weight's gradient sums 64 x 100 x (grads ~1e3): beyond fp16
    with torch.no_grad():
        model[1].weight.fill_(1e3)
        model[0].weight.fill_(1e-4)
    diagnosis = compfx.diagnose(model, x, low_dtype=torch.float16)
    assert diagnosis.origins == (compfx.OpKey("0", "linear", 0),)
    assert all(row.overflow == 0 for row in diagnosis.rows) and not diagnosis.finite


def test_diagnose_refuses_a_planned_graph_alone_and_a_second_plan():
    model, batch = drifted()
    analysis = compfx.analyze(model, batch[0])
    with pytest.raises(compfx.BadInputError, match="Pass the PlannedModule itself"):
        compfx.diagnose(compfx.apply(model, compfx.Plan.amp(analysis), analysis=analysis).graph_module, batch)
    with pytest.raises(compfx.BadInputError, match="its own plan"):
        compfx.diagnose(PlannedModule(model, compfx.Plan.amp(analysis), analysis=analysis), batch,
                        plan=compfx.Plan.fp32(analysis))


def test_cli_diagnose_prints_the_table(capsys, tmp_path):
    assert main(["diagnose", "compfx.examples:mlp", "--input-shape", "4,64", "--low-dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "0:linear#0" in out and "origin" in out and "FP32 shadow" in out
    model = compfx.examples.mlp()
    analysis = compfx.analyze(model, torch.randn(4, 64), low_dtype=torch.float16)
    compfx.Plan.fp32(analysis).save(tmp_path / "plan.json")
    assert main(["diagnose", "compfx.examples:mlp", "--input-shape", "4,64", "--plan", str(tmp_path / "plan.json")]) == 0
    assert "fp32" in capsys.readouterr().out
    assert main(["diagnose", "compfx.examples:cnn", "--input-shape", "4,1,8,8", "--plan",
                 str(tmp_path / "plan.json")]) == 2
    assert "compfx: error:" in capsys.readouterr().err


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()  # eval: no dropout, so the shadow's loss is the model's


def test_diagnose_takes_a_plain_hugging_face_model_with_a_dict_batch_and_a_plan():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    analysis = compfx.analyze(model, batch)
    plan = compfx.Plan.amp(analysis)
    with torch.no_grad():
        own_loss = float(model(**batch).loss)

    diagnosis = compfx.diagnose(model, batch, plan=plan)  # a recorded graph, called with keyword inputs

    assert diagnosis.plan == plan and [row.key for row in diagnosis.rows] == list(analysis.keys)
    assert diagnosis.finite and diagnosis.shadow_loss == pytest.approx(own_loss, rel=1e-5)
    assert diagnosis.row(compfx.OpKey("lm_head", "linear", 0)).dtype == plan.low_dtype
    assert diagnosis.rows == compfx.diagnose(PlannedModule(model, plan, analysis=analysis), batch).rows
    # without a plan (Plan.amp), and a tuple batch (inputs..., target) with a loss_fn: what optimize takes too
    assert compfx.diagnose(model, batch).plan == plan
    lm_loss = lambda output, b: F.cross_entropy(output.logits.flatten(0, 1), b[-1].flatten())  # noqa: E731
    assert compfx.diagnose(model, (ids, ids), loss_fn=lm_loss, plan=None).finite
