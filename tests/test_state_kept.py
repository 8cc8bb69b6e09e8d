"""Nothing of the user's is lost or silently changed: the model, its optimizer, the RNG, the batches and the files.

A fault inside a search sample, an interrupt, a loader's own error and a resume leave the caller's model and
optimizer bitwise as they were and the RNG where it was; a forward that reseeds the RNG or writes its inputs
changes nothing of the caller's; a file compfx writes never replaces, truncates or writes through one of the
user's, and a damaged or stale cache entry is skipped (with one warning), measured again and rewritten, never
fatal. Bad inputs that are plain exceptions are in ``tests/test_refusals.py``.

Faults are injected through ``loss_fn``, whose calls are counted: call 0 is the input check before the search,
then each Stage-1 epoch makes one call per batch (``warmup=0``, ``prune=False``), so sample ``s`` starts at call
``1 + s * BATCHES``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import logging
import os
import random
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx import cache
from compfx.compile_backend import registered_backend
from compfx.costmodel import SearchPredictor, fit_cast_cost, profile_ops
from compfx.errors import BadInputError, CacheKeyError, FileWriteError, NonFiniteGradientError, PlanFileError
from compfx.measure import Conditions
from compfx.optimization import optimize
from compfx.plan import Plan
from compfx.planned_module import PlannedModule, apply
from compfx.search import FunctionEvaluator, SearchSpace, run_stage1
from compfx.search.log import SearchLog
from compfx.state import snapshot_state
from tests.helpers import ce, fp32_op_count, nll
from tests.quick import quick_config

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

backend_module = importlib.import_module("compfx.compile_backend")

BATCHES = 2
#: over tests.quick's: one batch checks the Stage-2 winner, every candidate is measured
SEARCH = dict(stage2_check_batches=1, predictor=False)
#: every Stage-1 sample runs to its end (the loss_fn calls can be counted), and the state is put back after
FAULTS = dict(SEARCH, prune=False, keep_search_training=False)


# -- the models and their searches -------------------------------------------------------

class Tiny(nn.Module):
    """Two linears (whitelist) and a blacklisted log_softmax: four Stage-1 plans besides FP32."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.norm(self.fc1(x)))), dim=-1)


def setup(seed=0):
    """A Tiny with Adam state (it must come back bitwise), and its loader of ``BATCHES`` batches."""
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    loader = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(BATCHES)]
    model(loader[0][0]).sum().backward()
    opt.step()  # Adam state exists before the search: it must come back bitwise
    opt.zero_grad()
    return model, opt, loader


@functools.cache
def tiny_analysis() -> compfx.Analysis:
    """The analysis of a Tiny, made once for the tests that only need its ops (to save and find plans, to
    profile them): none of them applies it to a model. Made on first use, with the RNG put back: a test may be
    measuring the caller's RNG around it."""
    with torch.random.fork_rng(devices=[]):
        model, _, loader = setup()
    return compfx.analyze(model, loader[0][0])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


def batches(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def search(model, loader=None, **kwargs):
    """``optimize`` of ``model`` with SGD and cross-entropy, on ``batches()`` unless given a loader."""
    kwargs.setdefault("config", quick_config(**SEARCH, cache_plan=False))
    return compfx.optimize(model, batches() if loader is None else loader, loss_fn=ce,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def assert_untouched(model, before):
    assert before.matches(), "parameters, gradients, buffers or optimizer state changed"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())


# -- a fault inside a sample is that plan's; the caller's state comes back --------------------

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


SAMPLE = 2  # the second Stage-1 plan after the FP32 baseline


AGAIN = 1


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
                      config=quick_config(cost_fn=fp32_op_count, **FAULTS), log=path)
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
        optimize(model, loader, loss_fn=injecting(1, "nan_grad"), optimizer=opt, config=quick_config(**FAULTS))
    assert "NonFiniteGradientError" in str(error.value)
    assert_untouched(model, before)


def test_an_error_that_is_not_the_plans_stops_the_search_and_restores_the_state(tmp_path):
    # a loss that is not a scalar is the user's mistake whatever the plan: no further plan is tried
    model, opt, loader = setup()
    before, rng = snapshot_state(model, opt), torch.get_rng_state()
    path = tmp_path / "search.jsonl"
    with pytest.raises(BadInputError, match="scalar"):
        optimize(model, loader, loss_fn=injecting(FIRST_CANDIDATE_SECOND_BATCH, "not_scalar"), optimizer=opt,
                 config=quick_config(cost_fn=fp32_op_count, **FAULTS), log=path)
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
                 config=quick_config(cost_fn=fp32_op_count, **FAULTS), log=path)
    assert_untouched(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    log = SearchLog.read(path)
    # the interrupted sample is not logged, every earlier one is. Epochs that take turns are logged together: an
    # interruption in AMP's (sample 1) is one in FP32's too, and one in the first candidate's turns with the
    # incumbent's (call 8) logs neither of those two
    assert len(log.samples("stage1")) == {0: 0, 1: 0, 3: 2}[sample]
    assert "interrupted" in log.notes()[-1].reason


class Inverting(nn.Module):
    """linalg.inv raises for bfloat16, inside the rewritten graph: those plans fail in the sample."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        m = self.fc(x).reshape(-1, 2, 2) + 3 * torch.eye(2)
        return self.head(torch.linalg.inv(m).reshape(-1, 4))


def test_failing_samples_print_no_torch_fx_traceback_and_the_log_keeps_the_reason(capfd):
    torch.manual_seed(0)
    model = Inverting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    result = compfx.optimize(model, loader, optimizer=opt, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                             config=quick_config(**SEARCH, cache_plan=False))
    failed = [r for r in result.log.samples() if r.status == "error"]
    assert failed and all("linalg.inv" in r.reason for r in failed)
    err = capfd.readouterr().err
    assert "eval_with_key" not in err and "Traceback" not in err and "linalg" not in err


# -- the loader's own errors, and batches the model writes ------------------------------------

class FailsPartWay:
    """A loader whose first walk past its first batch (the search's first epochs: the input check and warm-ups
    read one batch) fails there (a file that went missing): the error is the loader's, not a plan's."""

    def __init__(self, data):
        self.data, self.passes = data, 0

    def __iter__(self):
        self.passes += 1
        for i, batch in enumerate(self.data):
            if i == 1:
                raise OSError(5, "Input/output error", "/data/shard-7")
            yield batch

    def __len__(self):
        return len(self.data)


def test_a_loader_that_fails_part_way_through_an_epoch_reaches_the_caller_with_state_restored(tmp_path):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    before = snapshot_state(model, optimizer)
    loader = FailsPartWay(batches(3))
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with pytest.raises(OSError, match="Input/output error") as caught:
        compfx.optimize(model, loader, optimizer=optimizer, loss_fn=ce, log=tmp_path / "search.jsonl",
                        config=quick_config(**SEARCH, cache_plan=False))
    assert loader.passes >= 2 and caught.value.filename == "/data/shard-7"
    assert before.matches() and torch.equal(torch.get_rng_state(), rng)
    logged = SearchLog.read(tmp_path / "search.jsonl")
    assert not [r for r in logged.samples() if r.status == "error"], "the loader's error was logged as a plan's"


class ScalesItsInput(nn.Module):
    """Normalises its input in place, as some models do to save memory: ``x.mul_(...)`` writes the caller's tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.mul_(0.5))


def test_a_model_that_writes_its_inputs_leaves_the_loaders_batches_as_they_were():
    loader = batches(3)
    before = [(x.clone(), y.clone()) for x, y in loader]
    result = search(ScalesItsInput(), loader, config=quick_config(**SEARCH, cache_plan=False,
                                                                  keep_search_training=False))
    for (x, y), (x0, y0) in zip(loader, before):
        torch.testing.assert_close(x, x0, rtol=0, atol=0)
        torch.testing.assert_close(y, y0, rtol=0, atol=0)
    assert any("writes its inputs" in r.reason for r in result.log.records)


def test_every_sample_of_a_model_that_writes_its_inputs_trains_on_the_loaders_data():
    # each plan's epoch sees the batches as the loader gives them: FP32's losses in the search are eager FP32's
    torch.manual_seed(0)
    model, loader = ScalesItsInput(), batches(3)
    eager = copy.deepcopy(model)
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    losses = []
    for x, y in batches(3):
        optimizer.zero_grad()
        loss = ce(eager(x), (x, y))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    result = search(model, loader)
    fp32 = next(r for r in result.log.samples("stage1") if r.plan == "1" * len(result.analysis.ops))
    assert fp32.loss == pytest.approx(sum(losses) / len(losses), rel=1e-6)


def test_diagnose_leaves_the_batch_of_a_model_that_writes_its_inputs_as_it_was():
    x, y = batches(1)[0]
    x0 = x.clone()
    compfx.diagnose(ScalesItsInput(), (x, y), loss_fn=ce)
    torch.testing.assert_close(x, x0, rtol=0, atol=0)


# -- the caller's RNG ----------------------------------------------------------------------

class Reseeding(nn.Module):
    """A forward that reseeds torch, Python and NumPy (some training code does, for 'reproducible' dropout)."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(4, 3), nn.Dropout(0.5)

    def forward(self, x):
        torch.manual_seed(123)
        random.seed(123)
        import numpy
        numpy.random.seed(123)
        return self.drop(self.fc(x))


def _rng():
    import numpy
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    queued = list(tracker.get_calls()) if tracker is not None else []
    return torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].tobytes(), queued


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("call", ["analyze", "apply", "optimize"])
def test_a_reseeding_forward_leaves_the_callers_rng_as_it_was(call):
    model, x = Reseeding(), torch.randn(6, 4)
    loader = [(x, torch.randint(0, 3, (6,)))]
    torch.manual_seed(7)
    random.seed(7)
    before = _rng()
    if call == "analyze":
        compfx.analyze(model, x)
    elif call == "apply":
        apply(model, Plan.fp32(compfx.analyze(model, x)), x)  # apply captures again, from example inputs
    else:
        search(model, loader=loader)
    assert _same(_rng(), before)


def _search_tiny(**kwargs):
    """A search of a fresh Tiny (with Adam state) on its loader: the same model, optimizer and batches every call."""
    model, opt, loader = setup()
    kwargs.setdefault("loss_fn", nll)
    return optimize(model, loader, optimizer=opt, config=quick_config(**SEARCH, cache_plan=False), **kwargs)


def test_resume_leaves_the_callers_rng_untouched(tmp_path):
    path = tmp_path / "search.jsonl"
    _search_tiny(log=path)  # the winner's epoch is retrained
    model, opt, loader = setup()
    torch.manual_seed(99)
    rng = _rng()
    result = optimize(model, loader, optimizer=opt, loss_fn=nll, log=path, resume=True,
                      config=quick_config(**SEARCH, cache_plan=False))
    assert any(r.reason == "resumed" for r in result.log.notes())
    assert _same(_rng(), rng)


@pytest.mark.parametrize("at", [1, 3, 6])  # in a replayed sample's retraining, a live sample, the comparison
def test_an_interrupted_resume_restores_model_optimizer_and_rng(tmp_path, at):
    path = tmp_path / "search.jsonl"
    _search_tiny(log=path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:3]) + "\n")  # as if killed after two samples
    model, opt, loader = setup()
    before = snapshot_state(model, opt)
    calls = []

    def interrupting(output, batch):
        calls.append(1)
        if len(calls) == 1 + at:  # call 1 is the input check
            raise KeyboardInterrupt
        return nll(output, batch)

    torch.manual_seed(7)
    rng = _rng()
    with pytest.raises(KeyboardInterrupt):
        optimize(model, loader, optimizer=opt, loss_fn=interrupting, log=path, resume=True,
                 config=quick_config(**SEARCH, cache_plan=False))
    assert len(calls) == 1 + at
    assert before.matches() and _same(_rng(), rng)


@pytest.mark.skipif(not hasattr(torch.cuda, "_lazy_seed_tracker") or torch.cuda.is_initialized(),
                    reason="needs torch's lazy CUDA seeding (CUDA not initialised yet)")
def test_a_search_on_the_cpu_queues_no_cuda_seed():
    """torch.manual_seed, called inside the search, would queue a seed for every CUDA device that fork_rng
    cannot undo: a caller who seeded CUDA (lazily) would find that seed replaced once CUDA starts."""
    tracker = torch.cuda._lazy_seed_tracker
    model, opt, loader = setup()
    torch.manual_seed(31)  # the caller's seed, queued for CUDA
    queued = tracker.get_calls()
    optimize(model, loader, optimizer=opt, loss_fn=nll, config=quick_config(**SEARCH, cache_plan=False))
    assert tracker.get_calls() == queued


def test_the_search_freezes_the_processs_objects_for_the_garbage_collector_and_gives_them_back():
    # a full collection during the search walks only the search's objects; the process's are given back after,
    # also when the search fails (Python 3.12 keeps a few hundred objects of its own frozen: the count's floor)
    import gc

    frozen_during = []

    def loss(output, batch):
        frozen_during.append(gc.get_freeze_count())
        return ce(output, batch)

    model = Net()
    before = gc.get_freeze_count()
    compfx.optimize(model, batches(), loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    config=quick_config(**SEARCH, cache_plan=False))
    assert frozen_during and min(frozen_during) > before + 1000  # the process's objects, not a few
    assert gc.get_freeze_count() <= before
    with pytest.raises(BadInputError):
        compfx.optimize(model, [], loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert gc.get_freeze_count() <= before


# -- the user's files: never replaced, truncated or written through ---------------------------

class Overflowing(nn.Module):
    """The guard's docstring model: its second linear overflows fp16 once its weights are scaled up."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.a(x))


def test_a_guard_adds_to_an_existing_search_log_and_never_truncates_it(tmp_path):
    torch.manual_seed(0)
    model = Overflowing()
    path = tmp_path / "search.jsonl"
    search(model, loader=[(torch.randn(6, 4), torch.randint(0, 2, (6,))) for _ in range(2)], log=path)
    before = path.read_bytes()
    analysis = compfx.analyze(model, torch.randn(3, 4), low_dtype=torch.float16)
    fast = PlannedModule(model, Plan.amp(analysis), analysis=analysis)
    guard = compfx.Guard(fast, log=path)
    with torch.no_grad():
        model.b.weight.mul_(1e6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = fast(torch.full((3, 4), 10.0)).sum()
    loss.backward()
    assert guard.step(optimizer, loss) is False and guard.repairs
    after = path.read_bytes()
    assert after.startswith(before) and len(after) > len(before)
    log = SearchLog.read(path)  # the chain goes on through the guard's lines
    assert log.verified and [r.reason for r in log.notes()][-1] == "repaired"


def test_a_guard_refuses_a_log_path_holding_a_file_of_the_users(tmp_path):
    model = Net()
    analysis = compfx.analyze(model, torch.randn(2, 4))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(PlanFileError, match="not a search log"):
        compfx.Guard(PlannedModule(model, Plan.amp(analysis), analysis=analysis), log=notes)
    assert notes.read_text() == "my notes\n"


def test_plan_save_never_replaces_a_link_nor_writes_through_it(tmp_path):
    model = Net()
    plan = Plan.amp(compfx.analyze(model, torch.randn(2, 4)))
    target = tmp_path / "target.json"
    plan.save(target)
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    with pytest.raises(FileWriteError, match="symbolic link"):
        Plan.fp32(compfx.analyze(model, torch.randn(2, 4))).save(link)
    assert link.is_symlink() and Plan.load(link) == plan  # reading through a link is fine


def test_one_search_log_has_one_writer(tmp_path):
    path = tmp_path / "search.jsonl"
    first = SearchLog(path)
    try:
        with pytest.raises(FileWriteError, match="being written by another"):
            SearchLog(path)
        with pytest.raises(FileWriteError, match="being written by another"):
            search(Net(), log=path)
    finally:
        first.close()
    search(Net(), log=path)  # once the first writer closed it


# -- the plan cache end to end: the searched plan is what torch.compile runs ----------------------

class Other(nn.Module):
    """Another model: none of its op keys is Tiny's."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 3), nn.ReLU())

    def forward(self, x):
        return self.encoder(x)


class Prodding(nn.Module):
    """A blacklisted op (prod), so a search that favours low precision picks a plan AMP would not."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.fc(x)
        return self.head(h * torch.prod(torch.sigmoid(h) + 0.5, dim=-1, keepdim=True))


def fewer_fp32_ops(plan, seconds):
    """A device where low precision always pays (deterministic)."""
    return float(sum(p == "fp32" for p in plan.values()))


def test_torch_compile_after_optimize_runs_the_searched_plan(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(backend_module, "_registered", None)  # a fresh backend="compfx" for this test
    torch.manual_seed(0)
    model = Prodding()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]
    result = compfx.optimize(model, loader, optimizer=opt, loss_fn=lambda out, b: F.cross_entropy(out, b[-1]),
                             config=quick_config(**SEARCH, threshold=2.0, cost_fn=fewer_fp32_ops))
    assert result.plan != Plan.amp(result.analysis), "the test needs a searched plan that is not the default"
    assert result.plan_path == cache.plan_path(result.analysis.fingerprint, result.analysis.low_dtype)
    assert f"saved to {result.plan_path}" in result.report()
    assert any(f"saved to {result.plan_path}" in note.reason for note in result.log.notes())

    torch._dynamo.reset()
    registered = registered_backend()
    monkeypatch.setattr(registered, "inner", "aot_eager")  # Inductor compiles slowly on this CPU
    torch.compile(Other(), backend="compfx")(torch.randn(2, 4))  # another model first, as in a real process
    copied = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="compfx"):
        out = torch.compile(copied, backend="compfx")(loader[0][0])
    record = registered.records[-1]
    assert (record.origin, record.plan_fingerprint, record.plan_path) == (
        "cache", result.analysis.fingerprint, str(result.plan_path))
    assert dict(record.precisions) == dict(result.plan) and not record.unplanned
    expected = {"low": result.analysis.low_dtype, "fp32": torch.float32}
    assert all(record.compute_dtypes[k] == expected[p] for k, p in result.plan.items() if p in expected)
    assert f"cache plan {result.analysis.fingerprint} from {result.plan_path}" in registered.report()
    ran = [m for m in caplog.messages if f"runs plan {result.analysis.fingerprint} from the plan cache" in m]
    assert len(ran) == 1 and f"({result.plan_path}, searched " in ran[0]  # once, at INFO: file, when, device, torch
    assert f"on cpu, under torch {torch.__version__}" in ran[0]
    torch.testing.assert_close(out, result.module(loader[0][0]), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()


def test_opting_out_leaves_the_cache_alone(tmp_path):
    model, opt, loader = setup()
    result = optimize(model, loader, optimizer=opt, loss_fn=nll,
                      config=quick_config(**SEARCH, cache_plan=False, cache_dir=tmp_path / "cache"))
    assert result.plan_path is None and "cache_plan=False" in result.report()
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.json"))


def test_an_unwritable_cache_warns_and_the_search_still_returns_its_plan(tmp_path, caplog):
    model, opt, loader = setup()
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="compfx"):
        result = optimize(model, loader, optimizer=opt, loss_fn=nll, config=quick_config(**SEARCH, cache_dir=blocked))
    assert result.plan_path is None and "not saved" in result.report()
    assert any("not saved to the plan cache" in m for m in caplog.messages)


# -- damaged, racing and hostile cache files ---------------------------------------------

def _saved(tmp_path) -> tuple[compfx.Analysis, Path, Path]:
    analysis, folder = tiny_analysis(), tmp_path / "cache"
    return analysis, folder, cache.save_plan(Plan.amp(analysis), cache_dir=folder)


@pytest.mark.parametrize("damage", ["binary", "nested", "truncated", "oversized", "another plan", "a folder"])
def test_a_damaged_cached_plan_is_skipped_with_one_warning_and_rewritten(tmp_path, caplog, damage):
    analysis, folder, path = _saved(tmp_path)
    if damage == "binary":
        path.write_bytes(b"\x00\xff" * 64)
    elif damage == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "truncated":
        path.write_text('{"format": "compfx-pl')
    elif damage == "oversized":
        path.unlink()
        with open(path, "wb") as handle:
            handle.truncate(40 << 20)
    elif damage == "another plan":  # a valid plan under the wrong name: not this model's
        path.write_text(json.dumps({**Plan.amp(analysis).to_dict(), "fingerprint": "fedcba9876543210"}))
    else:
        path.unlink()
        path.mkdir()
    with caplog.at_level(logging.WARNING, logger="compfx"):
        for _ in range(3):
            assert cache.find_plan(analysis.fingerprint, low_dtype=analysis.low_dtype, cache_dir=folder) is None
            assert cache.find_plan(analysis.fingerprint, cache_dir=folder) is None
    assert sum("ignoring damaged cached plan" in m for m in caplog.messages) == 1
    if damage == "a folder":
        path.rmdir()
    cache.save_plan(Plan.amp(analysis), cache_dir=folder)  # searched again: rewritten
    assert cache.find_plan(analysis.fingerprint, low_dtype=analysis.low_dtype, cache_dir=folder) \
        == Plan.amp(analysis)


def test_a_link_out_of_the_cache_folder_is_not_followed(tmp_path, caplog):
    analysis, folder, path = _saved(tmp_path)
    outside = tmp_path / "outside.json"
    outside.write_text(path.read_text())
    path.unlink()
    path.symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert cache.find_plan(analysis.fingerprint, low_dtype=analysis.low_dtype, cache_dir=folder) is None
        assert cache.find_plan(analysis.fingerprint, cache_dir=folder) is None
    assert sum("outside the cache folder" in m for m in caplog.messages) == 1
    with pytest.raises(CacheKeyError, match="outside the cache folder"):
        cache.plan_path(analysis.fingerprint, analysis.low_dtype, cache_dir=folder)


def test_files_deleted_between_listing_and_reading_are_skipped_silently(tmp_path, monkeypatch, caplog):
    analysis, folder, path = _saved(tmp_path)
    gone = f"{analysis.fingerprint}-float16.json"  # listed, then deleted by another process before it is read
    listdir = os.listdir
    monkeypatch.setattr(cache.os, "listdir", lambda where: [gone, *listdir(where)])
    real_stat = Path.stat

    def stat_then_vanish(self, *args, **kwargs):  # the other file vanishes after its stat, before its read
        result = real_stat(self, *args, **kwargs)
        if self.name == path.name and vanish:
            self.unlink()
        return result

    vanish = False
    with caplog.at_level(logging.WARNING, logger="compfx"):
        assert cache.find_plan(analysis.fingerprint, cache_dir=folder) == Plan.amp(analysis)
        vanish = True
        monkeypatch.setattr(Path, "stat", stat_then_vanish)
        assert cache.find_plan(analysis.fingerprint, cache_dir=folder) is None
    assert not caplog.messages


def test_lookups_while_another_thread_saves_and_deletes_never_raise(tmp_path):
    analysis, folder, _ = _saved(tmp_path)
    plans = [Plan(dict(Plan.amp(analysis)), low_dtype=analysis.low_dtype, fingerprint=f"{i:016x}")
             for i in range(8)]
    stop, errors = threading.Event(), []

    def churn():
        while not stop.is_set():
            for plan in plans:
                cache.plan_path(plan.fingerprint, plan.low_dtype, cache_dir=folder).unlink(missing_ok=True)
                cache.save_plan(plan, cache_dir=folder)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(200):
            try:
                cache.find_plan(analysis.fingerprint, cache_dir=folder)
                cache.find_plan(plans[0].fingerprint, cache_dir=folder)
            except Exception as error:  # noqa: BLE001 - the test collects what escaped
                errors.append(error)
    finally:
        stop.set()
        thread.join()
    assert not errors


def test_temp_files_of_killed_writers_are_removed_and_only_those(tmp_path):
    folder = tmp_path / "cache"
    (folder / "profiles").mkdir(parents=True)
    old_plan = folder / ".0123456789abcdef-bfloat16.json.k1ll3d_x.tmp"
    old_entry = folder / "profiles" / f".{'a' * 32}.json.abcd1234.tmp"
    fresh = folder / ".0123456789abcdef-float16.json.abcd1234.tmp"  # a writer may still be renaming it
    foreign = [folder / ".notes.json.abcd1234.tmp", folder / "mine.tmp", folder / "profiles" / ".x.json.abcd1234.tmp"]
    for path in (old_plan, old_entry, fresh, *foreign):
        path.write_text("{")
    for path in (old_plan, old_entry, *foreign):
        os.utime(path, (0, 0))
    analysis = tiny_analysis()
    cache.save_plan(Plan.amp(analysis), cache_dir=folder)
    profile_ops(analysis, cache_dir=folder, repeats=1, conditions=Conditions(1e-3))
    assert not old_plan.exists() and not old_entry.exists()
    assert fresh.exists() and all(path.exists() for path in foreign)


# -- profiles measured under other conditions ----------------------------------------------

def _entries(folder: Path, fmt: str = "compfx-op-profile") -> list[Path]:
    return [p for p in (folder / "profiles").glob("*.json") if json.loads(p.read_text())["format"] == fmt]


def test_profiles_cached_on_a_loaded_machine_are_measured_again(tmp_path):
    """The issue's case: profiles taken while other jobs loaded the machine, 20x too slow, and the reference
    kernel timed with them just as slow; the next search, on a quiet machine, must not trust them."""
    analysis = tiny_analysis()
    quiet = Conditions(reference_s=1e-3, load=0.1)
    first = profile_ops(analysis, cache_dir=tmp_path, repeats=1, conditions=quiet)
    loaded = []
    for path in _entries(tmp_path):  # rewrite them as a loaded machine would have written them
        data = json.loads(path.read_text())
        data.update(seconds=data["seconds"] * 20 + 1.0, conditions={"reference_s": 0.02, "load": 3.0})
        loaded.append(data["seconds"])
        path.write_text(json.dumps(data))
    again = profile_ops(analysis, cache_dir=tmp_path, repeats=1, conditions=quiet)
    assert (again.reused, again.stale, again.measured) == (0, len(loaded), len(loaded))
    assert "20x" in again.stale_reason and "load 3.00 per CPU then" in again.stale_reason
    assert all(p.fp32_s < 1.0 and p.low_s < 1.0 for p in again.values()), "a loaded timing was used"
    rewritten = [json.loads(p.read_text()) for p in _entries(tmp_path)]
    assert all(e["conditions"]["reference_s"] == 1e-3 and e["seconds"] < 1.0 for e in rewritten)
    assert set(first) == set(again)


@pytest.mark.parametrize("recorded, trusted", [
    ({"reference_s": 1.2e-3, "load": 0.5}, True),  # the same machine, a little noise: reused
    ({"reference_s": 0.4e-3, "load": 0.0}, False),  # taken on a faster (or quieter) machine than now
    (None, False),  # written before compfx recorded conditions
    ({"reference_s": "fast"}, False),  # damaged
])
def test_cached_profiles_are_trusted_only_under_like_conditions(tmp_path, recorded, trusted):
    analysis = tiny_analysis()
    now = Conditions(reference_s=1e-3)
    profile_ops(analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    for path in _entries(tmp_path):
        data = json.loads(path.read_text())
        if recorded is None:
            data.pop("conditions")
        else:
            data["conditions"] = recorded
        path.write_text(json.dumps(data))
    again = profile_ops(analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    n = 2 * len(analysis.ops)
    assert (again.reused, again.stale) == ((n, 0) if trusted else (0, n))


def test_a_damaged_profile_entry_is_measured_again_not_fatal(tmp_path, caplog):
    analysis = tiny_analysis()
    now = Conditions(reference_s=1e-3)
    profile_ops(analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    victims = _entries(tmp_path)[:3]
    data = json.loads(victims[0].read_text())
    victims[0].write_text(json.dumps({**data, "seconds": "fast"}))  # valid JSON, wrong content
    victims[1].write_bytes(b"\x00\xff\xfe")
    victims[2].write_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level(logging.WARNING, logger="compfx"):
        again = SearchPredictor.build(analysis, cache_dir=tmp_path, repeats=1, conditions=now)
    assert again.profiles.measured == 3 and again.profiles.reused == 2 * len(analysis.ops) - 3
    assert sum("ignoring damaged cache entry" in m for m in caplog.messages) == 3
    assert all(isinstance(json.loads(v.read_text())["seconds"], float) for v in victims)  # rewritten


def test_cast_fits_follow_the_same_rule(tmp_path):
    pairs = [(torch.float32, torch.bfloat16)]
    sizes = (256, 4096)
    fit_cast_cost(device="cpu", pairs=pairs, sizes=sizes, cache_dir=tmp_path, conditions=Conditions(1e-3))
    [entry] = _entries(tmp_path, "compfx-cast-cost")
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "alpha": 5.0, "conditions": {"reference_s": 0.05}}))
    cost = fit_cast_cost(device="cpu", pairs=pairs, sizes=sizes, cache_dir=tmp_path, conditions=Conditions(1e-3))
    assert cost.coefficients[pairs[0]][0] != 5.0 and json.loads(entry.read_text())["alpha"] != 5.0


# -- what the log keeps ------------------------------------------------------------------

def test_skipped_plans_are_priced_in_the_cost_functions_units():
    space = SearchSpace(("whitelist",) * 2, (False,) * 2, (0, 1))

    def run_epoch(plan):
        for _ in range(2):
            yield 1.0, 0.5

    def units(plan, seconds):  # e.g. dollars: 10 a second, plus 1 per FP32 op
        return 10 * seconds + str(plan).count("1")

    records = []
    predicted = {"11": 1.0, "00": 0.5, "01": 9.0, "10": 0.3}  # "01" cannot beat AMP's "00"; "10" might
    run_stage1(space, FunctionEvaluator(run_epoch=run_epoch, cost=units), predict=lambda p: predicted[str(p)],
               report=records.append)
    skipped = [r.reason for r in records if r.status == "skipped"]
    assert skipped and all("in cost_fn's units" in r and " s " not in r for r in skipped)
