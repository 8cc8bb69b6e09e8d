"""compfx overwrites no file of the user's, writes nothing through a link inside its cache, and captures safely
from several threads at once, leaving ``nn.Module`` as it found it."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.cli import main
from compfx.costmodel import profile_ops
from compfx.errors import CaptureError, FileWriteError

from tests.helpers import batches, ce

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

CHEAP = dict(progress=False, warmup=0, repeats=1, stage1_budget=2, stage2_budget=1, stage2_check_batches=1,
             predictor="off", cache_plan=False)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def search(model, log=None, **config):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return compfx.optimize(model, batches(2, (4, 8)), optimizer=optimizer, loss_fn=ce,
                           config=compfx.SearchConfig(**{**CHEAP, **config}), log=log)


@pytest.fixture(scope="module")
def search_log(tmp_path_factory):
    """A finished search's log (its lines quote plans, and the format name of plan files)."""
    path = tmp_path_factory.mktemp("log") / "search.jsonl"
    result = search(mlp(), log=path)
    return path, result.plan


def test_plan_save_never_replaces_a_search_log(search_log, tmp_path):
    # before: Plan.save found the plan format's name among the log's first bytes and replaced the log
    log, plan = search_log
    copy = tmp_path / "search.jsonl"
    copy.write_bytes(log.read_bytes())
    with pytest.raises(FileWriteError, match="is not a plan file compfx wrote; compfx does not overwrite it"):
        plan.save(copy)
    assert copy.read_bytes() == log.read_bytes()
    checkpoint = tmp_path / "model.pt"
    torch.save({"plan": plan.to_dict(), "state": mlp().state_dict()}, checkpoint)
    before = checkpoint.read_bytes()
    with pytest.raises(FileWriteError, match="does not overwrite it"):
        plan.save(checkpoint)
    assert checkpoint.read_bytes() == before
    plan.save(tmp_path / "plan.json")
    plan.save(tmp_path / "plan.json")  # a plan file is replaced by a plan
    assert compfx.Plan.load(tmp_path / "plan.json") == plan


def _cli_search(*extra) -> tuple[int, str]:
    return main(["search", "compfx.examples:mlp", "--input-shape", "4,64", "--classes", "10", "--batches", "2",
                 "--no-progress", *extra])


def test_cli_search_refuses_a_plan_path_that_is_a_search_log_or_the_log_itself(search_log, tmp_path, capsys):
    log, _ = search_log
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_bytes(log.read_bytes())
    assert _cli_search("--plan", str(earlier)) == 2
    assert "does not overwrite it" in capsys.readouterr().err and earlier.read_bytes() == log.read_bytes()
    same = tmp_path / "out.jsonl"
    assert _cli_search("--plan", str(same), "--log", str(tmp_path / "." / "out.jsonl")) == 2
    assert "name the same file" in capsys.readouterr().err and not same.exists()  # refused before the search


def test_nothing_is_written_through_a_link_inside_the_cache(tmp_path, caplog):
    # before: a linked profiles/ folder was written through, outside the cache
    cache, outside = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    outside.mkdir()
    (outside / "mine.txt").write_text("mine")
    os.symlink(outside, cache / "profiles")
    analysis = compfx.analyze(mlp(), torch.randn(4, 8))
    with caplog.at_level(logging.WARNING, logger="compfx"):
        profiles = profile_ops(analysis, repeats=1, cache_dir=cache)
    assert sorted(p.name for p in outside.iterdir()) == ["mine.txt"]
    assert len(profiles) == 3 and caplog.text.count("is a symbolic link") == 1
    (cache / "profiles").unlink()
    profile_ops(analysis, repeats=1, cache_dir=cache)  # a real folder: written, as before
    assert any(p.suffix == ".json" for p in (cache / "profiles").iterdir())


def _run_in_threads(*calls):
    errors, results = [], []
    barrier = threading.Barrier(len(calls))

    def run(call):
        try:
            barrier.wait()
            results.append(call())
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return results, errors


def test_two_threads_optimizing_at_once_both_succeed_and_leave_nn_module_as_it_was():
    # before: both failed ("fails even without compfx"), and every later eager call of any model raised
    # "NameError: module is not installed as a submodule": torch.fx's patches of nn.Module were left in place
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    apply = torch.autograd.Function.__dict__["apply"]
    results, errors = _run_in_threads(lambda: search(mlp(0)), lambda: search(mlp(1)))
    assert not errors, errors
    assert len(results) == 2 and all(len(r.plan) == 3 for r in results)
    assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_
    assert torch.autograd.Function.__dict__["apply"] is apply
    assert mlp()(torch.randn(2, 8)).shape == (2, 3)  # eager calls work afterwards


class BranchesOnAValue(nn.Module):
    """No tracer can capture it: forward branches on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


def test_a_failing_capture_beside_a_training_thread_leaves_nn_module_as_it_found_it():
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():  # eager steps while the other thread traces: they must run as plain eager calls
        for _ in range(200):
            optimizer.zero_grad()
            ce(model(torch.randn(4, 8)), (None, torch.randint(0, 3, (4,)))).backward()
            optimizer.step()
        return True

    def fail():
        for _ in range(3):
            with pytest.raises(CaptureError):
                compfx.capture(BranchesOnAValue(), torch.randn(4, 8), method="symbolic")
        return True

    results, errors = _run_in_threads(train, fail)
    assert not errors, errors
    assert results == [True, True]
    assert nn.Module.__call__ is call and nn.Module.__getattr__ is getattr_
