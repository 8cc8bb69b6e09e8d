"""Reliability: bad inputs fail early with short compfx errors; faults inside search samples are contained.

Faults are injected through ``loss_fn``, whose calls are counted: call 0 is the
input check before the search, then each Stage-1 epoch makes one call per batch
(``warmup=0``, ``prune=False``), so sample ``s`` starts at call ``1 + s * BATCHES``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx.planned_module import apply
from compfx.graph_capture import capture
from compfx.errors import (BadInputError, CompfxError, NonFiniteGradientError, PlanFileError,
                           PlanMismatchError)
from compfx.optimization import SearchConfig, optimize
from compfx.search.log import SearchLog
from compfx.state import snapshot_state
from tests.helpers import EXACT, fp32_op_count, nll

BATCHES = 2
CONFIG = dict(progress=False, warmup=0, repeats=1, stage2_check_batches=1, prune=False,
              keep_search_training=False, **EXACT)


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


class Tiny(nn.Module):
    """Two linears (whitelist) and a blacklisted log_softmax: four Stage-1 plans besides FP32."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.norm(self.fc1(x)))), dim=-1)


def setup(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    loader = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(BATCHES)]
    model(loader[0][0]).sum().backward()
    opt.step()  # Adam state exists before the search: it must come back bitwise
    opt.zero_grad()
    return model, opt, loader


class NanGradient(torch.autograd.Function):
    """Identity forward (finite loss), NaN backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def injecting(at: int, fault: str):
    calls = []

    def loss_fn(output, batch):
        calls.append(1)
        loss = nll(output, batch)
        if len(calls) - 1 != at:
            return loss
        if fault == "nan":
            return loss * float("nan")
        if fault == "inf":
            return loss * float("inf")
        if fault == "nan_grad":
            return NanGradient.apply(loss)
        if fault == "raise":
            raise RuntimeError("injected op failure")
        if fault == "oom":
            raise torch.cuda.OutOfMemoryError("injected: CUDA out of memory")
        if fault == "not_scalar":
            return loss.expand(2)
        raise KeyboardInterrupt

    return loss_fn


def assert_untouched(model, before):
    assert before.matches(), "parameters, gradients, buffers or optimizer state changed"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())


SAMPLE = 2  # the second Stage-1 plan after the FP32 baseline
#: the incumbent's epoch again, taking turns with the first candidate's: logged just before the candidate's sample
AGAIN = 1
#: the loss_fn call (0 is the input check) of the first candidate's second batch: FP32's and AMP's epochs take turns
#: (2 x BATCHES calls), then the incumbent's and the candidate's, in the order AB BA
FIRST_CANDIDATE_SECOND_BATCH = 1 + 2 * BATCHES + 2


@pytest.mark.parametrize("fault, status, reason", [
    ("nan", "rejected", "nan"),
    ("inf", "rejected", "inf"),
    ("nan_grad", "error", NonFiniteGradientError.__name__),
    ("raise", "error", "injected op failure"),
    ("oom", "error", "OutOfMemoryError"),
])
def test_a_fault_in_one_sample_rejects_that_plan_and_nothing_leaks(tmp_path, monkeypatch, fault, status, reason):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    model, opt, loader = setup()
    before, rng = snapshot_state(model, opt), torch.get_rng_state()
    path = tmp_path / "search.jsonl"
    result = optimize(model, loader, loss_fn=injecting(FIRST_CANDIDATE_SECOND_BATCH, fault), optimizer=opt,
                      config=SearchConfig(cost_fn=fp32_op_count, **CONFIG), log=path)
    stage1 = result.log.samples("stage1")
    faulty = stage1[SAMPLE + AGAIN]
    # the injected value is the faulty batch's loss (the steps after it train on, from the NaN weights it left)
    assert faulty.status == status and reason in (faulty.reason.lower() + faulty.reason + str(faulty.loss)
                                                  + str(faulty.extra.get("batches")))
    assert result.plan.bitstring(result.analysis) != faulty.plan
    assert_untouched(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["plan"] for r in logged if r["stage"] == "stage1" and r["status"] != "note"] == [
        r.plan for r in stage1]
    # FP32 baseline + every combination of the adjustable ops' two groups but the all-FP32 one (the baseline's
    # program, noted and not run again), none lost; and the incumbent's epoch again, once per candidate
    again = [r for r in stage1 if r.reason.startswith("the incumbent, its epoch again")]
    assert len(stage1) == 4 + len(again) and len(again) == 2
    assert any("same program" in note.reason for note in result.log.notes())
    assert (fault == "oom") == bool(emptied)


def test_nan_gradient_in_the_fp32_baseline_stops_the_search_with_a_clear_error():
    model, opt, loader = setup()
    before = snapshot_state(model, opt)
    with pytest.raises(compfx.errors.SearchError, match="FP32 baseline") as error:
        optimize(model, loader, loss_fn=injecting(1, "nan_grad"), optimizer=opt, config=SearchConfig(**CONFIG))
    assert "NonFiniteGradientError" in str(error.value)
    assert_untouched(model, before)


def test_an_error_that_is_not_the_plans_stops_the_search_and_restores_the_state(tmp_path):
    # a loss that is not a scalar is the user's mistake whatever the plan: no further plan is tried
    model, opt, loader = setup()
    before, rng = snapshot_state(model, opt), torch.get_rng_state()
    path = tmp_path / "search.jsonl"
    with pytest.raises(BadInputError, match="scalar"):
        optimize(model, loader, loss_fn=injecting(FIRST_CANDIDATE_SECOND_BATCH, "not_scalar"), optimizer=opt,
                 config=SearchConfig(cost_fn=fp32_op_count, **CONFIG), log=path)
    assert_untouched(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    # the samples before it (FP32's and AMP's), none after: not the incumbent's epoch again, logged with the candidate's
    assert len(SearchLog.read(path).samples("stage1")) == SAMPLE


@pytest.mark.parametrize("sample", [0, 1, 3])
def test_keyboard_interrupt_restores_state_and_the_log_holds_every_finished_sample(tmp_path, sample):
    model, opt, loader = setup()
    before, rng = snapshot_state(model, opt), torch.get_rng_state()
    path = tmp_path / "search.jsonl"
    with pytest.raises(KeyboardInterrupt):
        optimize(model, loader, loss_fn=injecting(2 + sample * BATCHES, "interrupt"), optimizer=opt,
                 config=SearchConfig(cost_fn=fp32_op_count, **CONFIG), log=path)
    assert_untouched(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    log = SearchLog.read(path)
    # the interrupted sample is not logged, every earlier one is. Epochs that take turns are logged together: an
    # interruption in AMP's (sample 1) is one in FP32's too, and one in the first candidate's turns with the
    # incumbent's (call 8) logs neither of those two
    assert len(log.samples("stage1")) == {0: 0, 1: 0, 3: 2}[sample]
    assert "interrupted" in log.notes()[-1].reason


# -- bad inputs --------------------------------------------------------------------

def _model_inputs():
    model, opt, loader = setup()
    return model, opt, loader, (loader[0][0],)


def _plan_file(tmp_path, text):
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


def _optimize(model, opt, loader, **kwargs):
    kwargs.setdefault("loss_fn", nll)
    config = kwargs.pop("config", SearchConfig(**CONFIG))
    return optimize(model, loader, optimizer=opt, config=config, **kwargs)


def _spread(model):
    model.fc2.to("meta")
    return model


BAD_INPUTS = {  # name -> (call(model, opt, loader, inputs, tmp_path), error class, words in the message, chained)
    "capture not a module": (lambda m, o, l, x, t: capture("model", x), BadInputError, "nn.Module", False),
    "capture bad method": (lambda m, o, l, x, t: capture(m, x, method="jit"), BadInputError, "method", False),
    "analyze int8": (lambda m, o, l, x, t: compfx.analyze(m, x, low_dtype=torch.int8), BadInputError,
                     "low_dtype", False),
    "apply not a plan": (lambda m, o, l, x, t: apply(m, "0101"), BadInputError, "Plan", False),
    "apply without inputs": (lambda m, o, l, x, t: apply(m, compfx.Plan.fp32(compfx.analyze(m, x))),
                             BadInputError, "example_inputs", False),
    "bitstring bad letter": (lambda m, o, l, x, t: compfx.Plan.from_bitstring(compfx.analyze(m, x), "x" * 9),
                             PlanMismatchError, "bitstring", False),
    "bitstring wrong length": (lambda m, o, l, x, t: compfx.Plan.from_bitstring(compfx.analyze(m, x), "01"),
                               PlanMismatchError, "", False),
    "plan file missing": (lambda m, o, l, x, t: compfx.Plan.load(t / "nope.json"), PlanFileError,
                          "does not exist", True),
    "plan file corrupt": (lambda m, o, l, x, t: compfx.Plan.load(_plan_file(t, '{"format": ')), PlanFileError,
                          "plan.json", True),
    "plan file not a plan": (lambda m, o, l, x, t: compfx.Plan.load(_plan_file(t, '{"a": 1}')), PlanFileError,
                             "not a compfx plan", False),
    "log file corrupt": (lambda m, o, l, x, t: SearchLog.read(_plan_file(t, '{"x": 1}\n{"stage": 1}\n')),
                         PlanFileError, "line 1", True),
    "optimize empty loader": (lambda m, o, l, x, t: _optimize(m, o, []), BadInputError, "no batches", False),
    "optimize batch of wrong type": (lambda m, o, l, x, t: _optimize(m, o, ["text"] * 2), BadInputError,
                                     "str", False),
    "optimize batch of wrong shape": (lambda m, o, l, x, t: _optimize(m, o, [(torch.randn(6, 5), l[0][1])]),
                                      BadInputError, "first batch", True),
    "optimize non-scalar loss": (lambda m, o, l, x, t: _optimize(m, o, l, loss_fn=lambda out, b: out),
                                 BadInputError, "scalar", False),
    "optimize loss_fn raises": (lambda m, o, l, x, t: _optimize(m, o, l, loss_fn=lambda out, b: out[99]),
                                BadInputError, "loss_fn failed", True),
    "optimize no loss at all": (lambda m, o, l, x, t: _optimize(m, o, l, loss_fn=None), BadInputError,
                                "without a loss", False),
    "optimizer of another model": (lambda m, o, l, x, t: _optimize(m, torch.optim.SGD(Tiny().parameters(), 0.1),
                                                                   l), BadInputError, "not this model's", False),
    "optimizer not an optimizer": (lambda m, o, l, x, t: _optimize(m, "adam", l), BadInputError, "Optimizer",
                                   False),
    "one-shot iterator": (lambda m, o, l, x, t: _optimize(m, o, iter(l)), BadInputError, "iterator", False),
    "model on two devices": (lambda m, o, l, x, t: _optimize(_spread(m), torch.optim.SGD(m.parameters(), 0.1), l),
                             BadInputError, "spread", False),
    "config threshold": (lambda m, o, l, x, t: SearchConfig(threshold=0.5), BadInputError, "threshold", False),
    "resume without log": (lambda m, o, l, x, t: _optimize(m, o, l, resume=True), PlanFileError, "log=", False),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_a_short_compfx_error_and_changes_nothing(tmp_path, name):
    call, error_class, words, chained = BAD_INPUTS[name]
    model, opt, loader, inputs = _model_inputs()
    spread = name == "model on two devices"
    before = None if spread else snapshot_state(model, opt)
    with pytest.raises(error_class) as caught:
        call(model, opt, loader, inputs, tmp_path)
    error = caught.value
    first = str(error).splitlines()[0]
    assert isinstance(error, CompfxError) and words in str(error)
    assert not any(marker in first for marker in ("Traceback", "While executing", 'File "')), first
    assert len(first) < 600
    assert (error.__cause__ is not None) == chained
    if before is not None:
        assert before.matches()
