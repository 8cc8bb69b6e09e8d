"""Nothing of the user's is damaged and nothing hangs: plan files have one reading, the user's files, links and
RNG are left alone, a loader's own error reaches the caller, FIFOs and endless loaders are bounded, the guard
checks how it is used, and the CLI refuses bad arguments before any work.

The bad inputs that are plain exceptions are in ``test_hardening.CASES``; these
tests cover what needs more than one call to show (a file's bytes before and
after, a warning and a result, a process that would otherwise block).
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import sys

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.planned_module import PlannedModule, apply
from compfx.cli import main
from compfx.errors import BadInputError, FileWriteError, PlanFileError
from compfx.plan import Plan
from compfx.search import SearchConfig
from compfx.search import sampling
from compfx.search.log import SearchLog
from compfx.state import snapshot_state
from tests.helpers import ce

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

QUICK = dict(progress=False, warmup=0, repeats=1, stage2_check_batches=1, predictor=False, cache_plan=False)


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
    kwargs.setdefault("config", SearchConfig(**QUICK))
    return compfx.optimize(model, batches() if loader is None else loader, loss_fn=ce,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.fixture
def no_hang():
    """Fail a test that blocks (a FIFO opened for reading waits for a writer) instead of hanging the suite."""
    def interrupt(signum, frame):
        raise TimeoutError("blocked for 20 s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# -- plan files have one reading ------------------------------------------------------

@pytest.fixture
def plan_dict():
    model = Net()
    analysis = compfx.analyze(model, torch.randn(2, 4))
    return Plan.amp(analysis).to_dict(), analysis, model


def _raw(d: dict, **replace: str) -> str:
    """``d`` as JSON text with some members' text replaced (to write what json.dumps cannot: duplicate keys)."""
    text = json.dumps(d)
    for old, new in replace.items():
        text = text.replace(old, new, 1)
    return text


@pytest.mark.parametrize("damage, named", [
    ("duplicate op key", "'0'"), ("duplicate fingerprint", "'fingerprint'"), ("duplicate low_dtype", "'low_dtype'"),
    ("zero-padded index", "fc:linear#00"), ("Arabic-Indic digit", "fc:linear#\u0660"),
    ("fullwidth digit", "fc:linear#\uff10"), ("unknown top-level key", "'tuned_by'"),
    ("torch_version not a string", "torch_version 2"), ("device_type unknown", "device_type 'tpu9'"),
    ("searched not a record", "searched"),
])
def test_a_plan_file_with_more_than_one_reading_is_refused_naming_what(tmp_path, plan_dict, damage, named):
    data, analysis, model = plan_dict
    ops = data["ops"]
    if damage == "duplicate op key":
        text = _raw(data, **{'"fc:linear#0": "low"': '"fc:linear#0": "fp32", "fc:linear#0": "low"'})
        named = "'fc:linear#0'"
    elif damage == "duplicate fingerprint":
        text = _raw(data, **{'"fingerprint"': '"fingerprint": "0123456789abcdef", "fingerprint"'})
    elif damage == "duplicate low_dtype":
        text = _raw(data, **{'"low_dtype"': '"low_dtype": "float16", "low_dtype"'})
    elif damage in ("zero-padded index", "Arabic-Indic digit", "fullwidth digit"):
        text = json.dumps({**data, "ops": {**{k: v for k, v in ops.items() if k != "fc:linear#0"}, named: "fp32"}},
                          ensure_ascii=False)
    elif damage == "unknown top-level key":
        text = json.dumps({**data, "tuned_by": "someone"})
    elif damage == "torch_version not a string":
        text = json.dumps({**data, "torch_version": 2})
    elif damage == "device_type unknown":
        text = json.dumps({**data, "device_type": "tpu9"})
    else:
        text = json.dumps({**data, "searched": {"at": 5}})
    path = tmp_path / "plan.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PlanFileError) as caught:
        Plan.load(path)
    assert named in str(caught.value) and str(path) in str(caught.value)


def test_a_plan_of_another_torch_release_loads_with_a_warning(tmp_path, plan_dict):
    data, analysis, model = plan_dict
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**data, "torch_version": "1.13.1"}))
    with pytest.warns(UserWarning, match="written under torch 1.13.1; this is torch"):
        plan = Plan.load(path)
    assert plan == Plan.amp(analysis)


def test_a_plan_file_written_before_these_checks_still_loads_without_a_warning(tmp_path, plan_dict, recwarn):
    data, analysis, model = plan_dict
    old = {k: data[k] for k in ("format", "version", "low_dtype", "fingerprint", "torch_version", "ops")}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(old, indent=2))
    plan = Plan.load(path)
    assert plan == Plan.amp(analysis) and plan.device_type is None
    apply(model, plan, torch.randn(2, 4))
    assert not [w for w in recwarn if issubclass(w.category, UserWarning) and "plan" in str(w.message)]


def test_a_plan_made_for_another_device_type_applies_with_a_warning(tmp_path, plan_dict):
    data, analysis, model = plan_dict
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**data, "device_type": "cuda"}))
    plan = Plan.load(path)
    assert plan.device_type == "cuda" and plan == Plan.amp(analysis)
    with pytest.warns(UserWarning, match="made for cuda and runs on cpu"):
        apply(model, plan, analysis=analysis)


def test_a_search_log_line_naming_a_key_twice_is_refused(tmp_path):
    path = tmp_path / "search.jsonl"
    search(Net(), log=path)
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"status":', '"status": "accepted", "status":', 1)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PlanFileError, match="line 2 is damaged .*duplicate key 'status'"):
        SearchLog.read(path)


# -- the user's files -------------------------------------------------------------------

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


# -- the caller's RNG -----------------------------------------------------------------

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
                    config=SearchConfig(**QUICK))
    assert frozen_during and min(frozen_during) > before + 1000  # the process's objects, not a few
    assert gc.get_freeze_count() <= before
    with pytest.raises(BadInputError):
        compfx.optimize(model, [], loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert gc.get_freeze_count() <= before


# -- the loader's own errors ------------------------------------------------------------

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
                        config=SearchConfig(**QUICK))
    assert loader.passes >= 2 and caught.value.filename == "/data/shard-7"
    assert before.matches() and torch.equal(torch.get_rng_state(), rng)
    logged = SearchLog.read(tmp_path / "search.jsonl")
    assert not [r for r in logged.samples() if r.status == "error"], "the loader's error was logged as a plan's"


def test_an_endless_loader_gives_bounded_epochs(monkeypatch, no_hang):
    def endless():
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)

    class Stream:  # no len(): like a DataLoader over an IterableDataset
        def __iter__(self):
            return endless()

    monkeypatch.setattr(sampling, "MAX_EPOCH_BATCHES", 3)
    with pytest.warns(UserWarning, match="at most its first 3"):
        result = search(Net(), loader=Stream())
    stage1 = [r for r in result.log.samples() if r.stage == "stage1" and r.status == "accepted"]
    assert stage1 and all(r.batches == 3 for r in stage1)


def test_a_loader_longer_than_its_len_gives_len_batches():
    class Lying:
        def __iter__(self):
            return iter(batches(5))

        def __len__(self):
            return 2

    result = search(Net(), loader=Lying())
    assert all(r.batches == 2 for r in result.log.samples() if r.stage == "stage1" and r.status == "accepted")


# -- nothing hangs on a FIFO ------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
@pytest.mark.parametrize("what", ["Plan.load", "SearchLog.read", "optimize(log=)", "compfx report", "compfx plan show",
                                  "Guard(log=)"])
def test_a_fifo_without_a_writer_is_refused_not_waited_on(tmp_path, no_hang, capsys, what):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    model = Net()
    if what.startswith("compfx "):
        assert main([*what.split()[1:], str(fifo)]) == 2
        assert "FIFO" in capsys.readouterr().err
        return
    with pytest.raises((PlanFileError, FileWriteError), match="FIFO"):
        if what == "Plan.load":
            Plan.load(fifo)
        elif what == "SearchLog.read":
            SearchLog.read(fifo)
        elif what == "optimize(log=)":
            search(model, log=fifo)
        else:
            analysis = compfx.analyze(model, torch.randn(2, 4))
            compfx.Guard(PlannedModule(model, Plan.amp(analysis), analysis=analysis), log=fifo)


# -- the guard checks its use ---------------------------------------------------------------

def test_a_guard_refuses_a_second_step_on_one_backward_and_steps_after_the_next():
    torch.manual_seed(0)
    model = Net()
    analysis = compfx.analyze(model, torch.randn(2, 4))
    fast = PlannedModule(model, Plan.amp(analysis), analysis=analysis)
    guard, optimizer = compfx.Guard(fast), torch.optim.SGD(model.parameters(), lr=0.1)
    loss = fast(torch.randn(2, 4)).sum()
    loss.backward()
    assert guard.step(optimizer, loss) is True
    stepped = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(BadInputError, match="without a backward since the last step"):
        guard.step(optimizer, loss)
    assert guard.steps == 1 and all(torch.equal(a, b) for a, b in zip(stepped, model.parameters()))
    optimizer.zero_grad()
    loss = fast(torch.randn(2, 4)).sum()
    loss.backward()
    assert guard.step(optimizer, loss) is True and guard.steps == 2
    emptied = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    emptied.param_groups[0]["params"] = []
    with pytest.raises(BadInputError, match="holding no parameters"):
        guard.step(emptied, loss)


# -- the CLI: one line, exit code 2, before any work ---------------------------------------------

def _no_traceback_exit_2(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's refusal of a malformed option
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


def exits_7():
    """A model factory that calls sys.exit(7) (the CLI must report it, not exit 7 silently)."""
    sys.exit(7)


@pytest.mark.parametrize("extra, says", [
    (["--input-shape", "100000,100000,100000", "--classes", "3"], "elements"),
    (["--input-shape", "8,1,8,8", "--classes", "0"], "positive whole number"),
    (["--input-shape", "8,1,8,8", "--classes", "3", "--lr=-1"], "positive finite number"),
    (["--input-shape", "8,1,8,8", "--classes", "3", "--seed", str(2 ** 70)], "torch.manual_seed"),
    (["--input-shape", "8,1,8,8", "--classes", "3", "--threshold", "nan"], "threshold=nan"),
])
def test_cli_search_refuses_bad_numbers_with_one_line(capsys, extra, says):
    assert says in _no_traceback_exit_2(["search", "compfx.examples:cnn", *extra], capsys)


def test_cli_refuses_a_factory_calling_sys_exit_and_an_absurd_capability(capsys):
    err = _no_traceback_exit_2(["analyze", "tests.test_safety:exits_7", "--input-shape", "2,4"], capsys)
    assert "sys.exit(7)" in err
    assert "major 1-20" in _no_traceback_exit_2(
        ["analyze", "compfx.examples:cnn", "--input-shape", "8,1,8,8", "--capability", "99,99"], capsys)


@pytest.mark.parametrize("flag", ["--plan", "--log"])
def test_cli_search_refuses_an_unwritable_output_before_the_search(tmp_path, capsys, flag):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    other = "--log" if flag == "--plan" else "--plan"
    written = tmp_path / ("search.jsonl" if other == "--log" else "plan.json")
    err = _no_traceback_exit_2(["search", "compfx.examples:cnn", "--input-shape", "8,1,8,8", "--classes", "3",
                                "--no-progress", flag, str(blocker / "out"), other, str(written)], capsys)
    assert str(blocker / "out") in err and not written.exists(), "the search ran before the path was checked"


def test_cli_search_refuses_a_plan_path_holding_a_file_of_the_users(tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    err = _no_traceback_exit_2(["search", "compfx.examples:cnn", "--input-shape", "8,1,8,8", "--classes", "3",
                                "--no-progress", "--plan", str(notes)], capsys)
    assert "does not overwrite it" in err and notes.read_text() == '{"mine": true}'


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
    result = search(ScalesItsInput(), loader, config=SearchConfig(**{**QUICK, "keep_search_training": False}))
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
