"""compfx.optimize end to end on small models: the guard, state handling, faults, the log, a real HF model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx import SearchConfig, SearchResult, optimize
from compfx.planned_module import apply
from compfx.errors import BadInputError
from compfx.search.sampling import FairSampler
from compfx.state import restore_state, snapshot_state
from tests.helpers import batches, ce, fp32_op_count

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


FAST = dict(progress=False, warmup=1, repeats=2, stage2_check_batches=2)


class Overflowing(nn.Module):
    """mse_loss (blacklisted) of activations around 300: its squares overflow float16 (max 65504)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        out = self.fc2(F.relu(self.fc1(x))) * 300.0
        return {"loss": F.mse_loss(out, y)}


def test_guard_keeps_the_overflowing_op_fp32_and_everything_else_low():
    torch.manual_seed(0)
    model = Overflowing()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    loader = [{"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(3)]
    config = SearchConfig(cost_fn=fp32_op_count, grad_scaler=False, predictor=False, **FAST)
    result = optimize(model, loader, optimizer=opt, low_dtype=torch.float16, config=config)
    chosen = {str(k): p for k, p in result.plan.items()}
    assert chosen == {"fc1:linear#0": "low", ":relu#0": "follow", "fc2:linear#0": "low", ":mul#0": "follow",
                      ":mse_loss#0": "fp32"}
    overflowed = [r for r in result.log.samples("stage1") if r.plan.endswith("0")]
    assert overflowed and all(r.status == "pruned" and "inf" in r.reason for r in overflowed)
    assert torch.isfinite(result.module(**loader[0])["loss"])


class Inverting(nn.Module):
    """linalg.inv is blacklisted on CPU and raises for bfloat16: those plans fail inside the sample."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)

    def forward(self, x):
        m = self.bn(self.fc(x)).reshape(-1, 2, 2) + 3 * torch.eye(2, device=x.device)
        return self.head(torch.linalg.inv(m).reshape(-1, 4))


def inverting_setup():
    torch.manual_seed(0)
    model = Inverting()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = batches(3, (8, 4))
    warm = FairSampler(model, opt, loader, ce, device="cpu")
    warm.step(model, loader[0])  # Adam state exists before the search: it must come back in the same tensors
    return model, opt, loader


def test_failing_plans_are_rejected_and_state_comes_back_bitwise(tmp_path):
    model, opt, loader = inverting_setup()
    before = snapshot_state(model, opt)
    moments = [opt.state[p]["exp_avg"] for p in model.parameters()]
    rng = torch.get_rng_state()
    config = SearchConfig(cost_fn=fp32_op_count, keep_search_training=False, **FAST)
    result = optimize(model, loader, loss_fn=ce, optimizer=opt, config=config, log=tmp_path / "search.jsonl")
    failed = [r for r in result.log.samples("stage1") if r.status == "error"]
    assert failed and all("Low precision" in r.reason for r in failed)
    assert result.plan[compfx.OpKey("", "linalg_inv", 0)] == "fp32"
    assert before.matches()  # parameters, BatchNorm buffers, gradients, Adam state: bitwise
    assert all(opt.state[p]["exp_avg"] is m for p, m in zip(model.parameters(), moments))
    assert torch.equal(torch.get_rng_state(), rng)  # the user's RNG stream is untouched
    lines = [json.loads(line) for line in (tmp_path / "search.jsonl").read_text().splitlines()]
    assert [line["status"] for line in lines if line["stage"] == "stage1"].count("error") == len(failed)


def test_keep_search_training_leaves_the_chosen_stage1_epoch_state():
    model, opt, loader = inverting_setup()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    config = SearchConfig(cost_fn=fp32_op_count, **FAST)
    result = optimize(model, loader, loss_fn=ce, optimizer=opt, config=config)
    # replay the Stage-1 winner's epoch on the twin: the model must hold exactly that state
    twin_analysis = compfx.analyze(twin, loader[0][:1])
    winner = result.stage1_plan.assignment(result.analysis)
    replay = apply(twin, compfx.Plan.from_assignment(twin_analysis, winner), analysis=twin_analysis)
    sampler = FairSampler(twin, twin_opt, loader, ce, device="cpu", seed=config.seed)
    epoch = sampler.epoch(replay, warmup=config.warmup)
    with pytest.raises(StopIteration) as stop:
        while True:
            next(epoch)
    restore_state(stop.value.value)
    for mine, theirs in zip((*model.parameters(), *model.buffers()), (*twin.parameters(), *twin.buffers())):
        assert torch.equal(mine, theirs)
    # the user's optimizer keeps training the returned module: it shares the Parameters
    assert all(any(p is q for q in result.module.parameters()) for p in model.parameters())
    weight = model.head.weight.detach().clone()
    opt.zero_grad()
    ce(result.module(loader[0][0]), loader[0]).backward()
    opt.step()
    assert not torch.equal(weight, model.head.weight)


def test_keyboard_interrupt_restores_state_flushes_the_log_and_propagates(tmp_path):
    model, opt, loader = inverting_setup()
    before = snapshot_state(model, opt)
    calls = []

    def interrupting_loss(output, batch):
        calls.append(1)
        if len(calls) == 6:  # inside FP32's and AMP's epochs (they take turns): neither has finished
            raise KeyboardInterrupt
        return ce(output, batch)

    with pytest.raises(KeyboardInterrupt):
        optimize(model, loader, loss_fn=interrupting_loss, optimizer=opt, config=SearchConfig(**FAST),
                 log=tmp_path / "search.jsonl")
    assert before.matches()
    lines = [json.loads(line) for line in (tmp_path / "search.jsonl").read_text().splitlines()]
    assert "interrupted" in lines[-1]["reason"]
    assert not [line for line in lines if line["status"] != "note"]  # no sample had finished: none is logged
    # (tests/test_reliability.py interrupts later samples: every finished one is logged)


def test_bert_from_config_end_to_end():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    loader = [{"input_ids": torch.randint(0, 40, (4, 8), generator=g),
               "labels": torch.randint(0, 2, (4,), generator=g)} for _ in range(2)]
    result = optimize(model, loader, optimizer=opt,
                      config=SearchConfig(stage1_budget=4, stage2_budget=3, predictor=False, **FAST))
    assert set(result.plan) == set(result.analysis.keys)
    assert torch.isfinite(result.module(**loader[0]).loss)
    report = result.report()
    assert "chosen plan" in report and "greedy" in report  # 10 adjustable ops: the space was reduced, and said so
    samples = result.log.samples("stage1")
    again = [r for r in samples if r.reason.startswith("the incumbent, its epoch again")]
    candidates = [r.plan for r in samples if r not in again][2:]  # after FP32's and AMP's, which took turns
    # each candidate's epoch took turns with the incumbent's, which ran again for the pairs: not budgeted
    assert [r.reason.split("taking turns with ")[1].split("'s")[0] for r in again] == candidates
    assert len(samples) - len(again) == 5  # the FP32 baseline + stage1_budget
    assert all(r.extra["incumbent_again"] == c for r, c in zip(again, candidates))
    # the report counts them apart from the samples of plans of their own
    assert "stage 1        5 samples" in report and f"the incumbent's epoch ran {len(again)} more time(s)" in report


@pytest.mark.parametrize("field, value", [("threshold", 0.9), ("threshold", float("nan")), ("stage1_budget", 0),
                                          ("repeats", 0), ("warmup", -1), ("cost_fn", "fast"),
                                          ("grad_scaler", "yes"), ("stage2_check_batches", 1.5)])
def test_search_config_rejects_bad_values(field, value):
    with pytest.raises(BadInputError, match=field):
        SearchConfig(**{field: value})


def test_bad_arguments_say_what_to_do():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = batches(2, (8, 4))
    with pytest.raises(BadInputError, match="one-shot"):
        optimize(model, iter(loader), loss_fn=ce, optimizer=opt)
    with pytest.raises(BadInputError, match="not this model's"):
        optimize(model, loader, loss_fn=ce, optimizer=torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1))
    with pytest.raises(BadInputError, match="loss_fn"):
        optimize(model, loader, optimizer=opt, config=SearchConfig(**FAST))


def test_report_lists_every_op_and_the_search_figures():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = optimize(model, batches(3, (8, 4)), loss_fn=ce, optimizer=opt, config=SearchConfig(**FAST))
    assert isinstance(result, SearchResult) and "SearchResult(plan=" in repr(result)
    report = result.report()
    for key in ("0:linear#0", "1:relu#0", "2:linear#0"):
        assert key in report
    for figure in ("stage 1", "stage 2", "FP32 epochs", "pruned", "AMP"):
        assert figure in report
    assert result.samples_run == len(result.log.samples("stage1")) + len(result.log.samples("stage2"))
    assert set(result.step_seconds) == {"fp32", "amp", "chosen"}
    assert result.plan.bitstring(result.analysis) in report
    assert result.stage1_plan.bitstring(result.analysis) in report


def test_demo_runs_the_search_and_post_training():
    from compfx.demo import run_demo

    lines = []
    result = run_demo(epochs=1, sample_batches=3, progress=False, print_fn=lines.append)
    text = "\n".join(lines)
    assert "chosen plan" in text and "epoch 1: train loss" in text and "test accuracy" in text
    assert set(result.plan) == set(result.analysis.keys)


def test_empty_loader_is_a_bad_input():
    model = nn.Linear(4, 3)
    with pytest.raises(BadInputError, match="no batches"):
        optimize(model, [], loss_fn=ce, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
