"""A searched plan runs only for the model it was searched for (the compile backend and the plan cache).

``backend="compfx"`` serves every model of a process from one backend object and
one cache folder. These tests give it models that share op names with a
searched one (a subset of its ops, the same ops at other widths, a piece split
off at a graph break), damaged and foreign cache files, plans of another device
type, and two searches that save different plans for one model: none of them
runs another model's plan, and whatever is not used is said.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import compfx
from compfx import cache
from compfx.compile_backend import backend, registered_backend
from compfx.errors import PlanMismatchError
from compfx.plan import Plan
from compfx.search import SearchConfig
from tests.helpers import ce

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def low_op_count(plan, seconds):
    """A device where FP32 always pays (deterministic): the searched plan is then not AMP's."""
    return float(sum(p == "low" for p in plan.values()))


QUICK = dict(progress=False, warmup=0, repeats=1, stage2_check_batches=1, predictor=False, threshold=2.0,
             cost_fn=low_op_count)


@pytest.fixture
def compfx_backend(tmp_path, monkeypatch):
    """A fresh ``backend="compfx"`` (aot_eager: Inductor compiles slowly here) over an empty cache folder."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(sys.modules["compfx.compile_backend"], "_registered", None)
    registered = registered_backend()
    registered.inner = "aot_eager"
    torch._dynamo.reset()
    yield registered
    torch._dynamo.reset()


def searched(model: nn.Module, inputs: int = 16, classes: int = 4):
    """Search ``model`` (its plan lands in the cache folder of $COMPFX_CACHE_DIR) and return the result."""
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(8, inputs, generator=g), torch.randint(0, classes, (8,), generator=g)) for _ in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = compfx.optimize(model, loader, optimizer=optimizer, loss_fn=ce, config=SearchConfig(**QUICK))
    assert result.plan != Plan.amp(result.analysis), "the test needs a searched plan that is not the default"
    return result


def compiled_record(registered, model: nn.Module, x: torch.Tensor):
    torch.compile(model, backend="compfx")(x)
    return registered.records[-1]


def test_a_model_whose_op_names_are_a_subset_of_anothers_does_not_run_its_cached_plan(compfx_backend, caplog):
    """The issue's case: Sequential(Linear(16, 48))'s only op key, 0:linear#0, is one of the searched model's."""
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    result = searched(big)
    small, x = nn.Sequential(nn.Linear(16, 48)), torch.randn(2, 16)
    assert set(compfx.analyze(small, x).keys) < set(result.plan)
    with caplog.at_level(logging.INFO, logger="compfx"):
        record = compiled_record(compfx_backend, small, x)
    assert record.origin == "default" and record.plan_fingerprint != result.plan.fingerprint
    assert dict(record.precisions) == dict(Plan.amp(compfx.analyze(small, x)))
    assert not any(result.plan.fingerprint in m for m in caplog.messages)


def test_two_models_sharing_their_op_names_do_not_share_a_cached_plan(compfx_backend, caplog):
    """The same layers at another width have the same op keys, so the same fingerprint: the parameter shapes the
    cache records tell them apart, and the plan that is not used is warned about."""
    torch.manual_seed(0)
    narrow = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    result = searched(narrow)
    wide, x = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4)), torch.randn(2, 16)
    assert compfx.analyze(wide, x).fingerprint == result.plan.fingerprint
    with caplog.at_level(logging.WARNING, logger="compfx"):
        record = compiled_record(compfx_backend, wide, x)
    assert record.origin == "default"
    assert any("parameters have other shapes" in m and str(result.plan_path) in m for m in caplog.messages)
    # a copy of the searched model (another object, as in a later process) still runs the searched plan
    record = compiled_record(compfx_backend, copy.deepcopy(narrow), x)
    assert (record.origin, dict(record.precisions)) == ("cache", dict(result.plan))


def test_a_plan_file_applied_to_the_same_layers_at_other_widths_says_so(tmp_path, monkeypatch):
    """A plan file records the parameter shapes it was searched on: apply and PlannedModule warn when a model of the
    same layers at another width gets it (it still applies: op keys name layers), and say nothing for its own."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    torch.manual_seed(0)
    narrow = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    result = searched(narrow)
    result.plan.save(tmp_path / "plan.json")
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.parameter_shapes == ((4,), (4, 32), (32,), (32, 16)) == result.plan.parameter_shapes
    wide, x = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4)), torch.randn(2, 16)
    with pytest.warns(UserWarning, match=r"other shapes \(e.g. \[4, 32\] there, \[4, 48\] here\)"):
        compfx.apply(wide, plan, x)
    with pytest.warns(UserWarning, match="same layers at other widths"):
        compfx.PlannedModule(wide, plan, analysis=compfx.analyze(wide, x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compfx.apply(copy.deepcopy(narrow), plan, x)


def test_a_plan_given_to_the_backend_for_the_same_layers_at_other_widths_runs_and_says_so(compfx_backend, caplog):
    torch.manual_seed(0)
    narrow = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    plan = searched(narrow).plan
    wide, x = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4)), torch.randn(2, 16)
    with caplog.at_level(logging.WARNING, logger="compfx"):
        torch.compile(wide, backend=backend(plan, inner="aot_eager"))(x)
    assert any("searched on a model whose parameters have other shapes" in m for m in caplog.messages)
    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="compfx"):
        torch.compile(copy.deepcopy(narrow), backend=backend(plan, inner="aot_eager"))(x)
    assert not any("other shapes" in m for m in caplog.messages)


class Broken(nn.Module):
    """Three linears with a graph break after the first: dynamo hands over two graphs."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.fc, self.mid, self.head = nn.Linear(16, width), nn.Linear(width, width), nn.Linear(width, 4)

    def forward(self, x):
        x = torch.relu(self.fc(x))
        torch._dynamo.graph_break()
        return self.head(torch.relu(self.mid(x)))


class LossAfterBreak(nn.Module):
    """A graph break before the loss: the second graph reads no parameter (like a Hugging Face loss graph)."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        x = self.head(torch.relu(self.fc(x)))
        torch._dynamo.graph_break()
        return torch.log_softmax(x, -1) * 1.0


@pytest.mark.parametrize("make", [Broken, LossAfterBreak])
def test_each_graph_of_a_searched_model_split_at_a_graph_break_runs_its_plan(compfx_backend, make):
    torch.manual_seed(0)
    model = make()
    result = searched(model)
    torch.compile(model, backend="compfx")(torch.randn(2, 16))
    records = compfx_backend.records
    assert len(records) >= 2 and all(r.origin == "searched" for r in records), [r.origin for r in records]
    ran = {key: precision for r in records for key, precision in r.precisions.items()}
    assert ran == dict(result.plan) and not any(r.unplanned for r in records)


def test_a_piece_of_another_model_split_at_a_graph_break_runs_no_cached_plan(compfx_backend):
    """Every op of each graph of ``Broken(48)`` is named as one of the cached ``Broken(32)``'s: a lookup by op
    names would run the other model's plan on them."""
    torch.manual_seed(0)
    result = searched(Broken(32))
    other = Broken(48)
    torch.compile(other, backend="compfx")(torch.randn(2, 16))
    pieces = compfx_backend.records[-2:]
    assert all(set(r.precisions) <= set(result.plan) for r in pieces)  # the names alone would match
    assert [r.origin for r in pieces] == ["default", "default"]


def _craft(result, **changes) -> None:
    """Rewrite the searched plan's cache file (as a user, another tool or another compfx might)."""
    data = json.loads(result.plan_path.read_text())
    data.update(changes)
    result.plan_path.write_text(json.dumps(data))


def test_a_cache_file_holding_another_models_ops_under_this_name_is_not_used(compfx_backend, caplog):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(2, 16)
    result = searched(model)
    _craft(result, ops={"encoder.0:linear#0": "fp32", "encoder.1:relu#0": "fp32"})
    with caplog.at_level(logging.WARNING, logger="compfx"):
        record = compiled_record(compfx_backend, copy.deepcopy(model), x)
    assert record.origin == "default" and not record.unplanned
    assert any("names other ops" in m for m in caplog.messages)


def test_a_plan_searched_on_another_device_type_is_not_used_and_said(compfx_backend, caplog):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(2, 16)
    result = searched(model)
    _craft(result, device_type="cuda")
    with caplog.at_level(logging.WARNING, logger="compfx"):
        record = compiled_record(compfx_backend, copy.deepcopy(model), x)
    assert record.origin == "default"
    assert any("was searched on cuda, and this graph runs on cpu" in m for m in caplog.messages)


def test_the_process_that_searched_runs_its_own_plan_when_another_search_replaced_the_file(compfx_backend, caplog):
    """Two processes searched one architecture on different data: the file holds the newest; each process runs
    its own plan for its own model, and both the replacement and the file's provenance are said."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(2, 16)
    result = searched(model)
    theirs = Plan.amp(result.analysis)  # not the searched plan (see searched())
    _craft(result, ops={str(k): str(v) for k, v in theirs.items()},
           searched={"at": "2030-01-01T00:00:00+00:00", "host": "elsewhere", "pid": 4242})
    with caplog.at_level(logging.INFO, logger="compfx"):
        mine = compiled_record(compfx_backend, model, x)
        torch._dynamo.reset()
        copied = compiled_record(compfx_backend, copy.deepcopy(model), x)
    assert (mine.origin, dict(mine.precisions)) == ("searched", dict(result.plan))
    assert any("now holds another search's plan" in m and "4242" in m for m in caplog.messages)
    assert (copied.origin, dict(copied.precisions)) == ("cache", dict(theirs))
    assert any("searched 2030-01-01T00:00:00+00:00 by process 4242 on elsewhere, on cpu" in m for m in caplog.messages)


_SAVER = textwrap.dedent("""
    import sys, torch, compfx
    from compfx import cache
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    analysis = compfx.analyze(model, torch.randn(2, 16))
    plan = compfx.Plan.fp32(analysis) if sys.argv[1] == "fp32" else compfx.Plan.amp(analysis)
    print(cache.save_plan(plan, cache_dir=sys.argv[2]))
""")


def test_two_processes_saving_different_plans_of_one_model_do_not_overwrite_each_other_silently(tmp_path):
    runs = [subprocess.run([sys.executable, "-c", _SAVER, kind, str(tmp_path)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()}) for kind in ("fp32", "amp")]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr
    with open(runs[1].stdout.strip().splitlines()[-1]) as handle:
        data = json.load(handle)
    first_pid = data["replaced"]["pid"]  # the first process's search, which the second replaced
    assert "held a different plan for this model" in runs[1].stderr and f"by process {first_pid}" in runs[1].stderr
    assert data["replaced"]["differing_ops"] > 0 and data["searched"]["pid"] != first_pid
    assert set(data["ops"].values()) != {"fp32"}  # the newest search's plan is the file's


def test_an_explicit_plan_of_another_model_reaches_the_caller_as_a_plan_mismatch_error():
    """Not dynamo's BackendCompilerFailed around it: the compfx error itself, under torch.compile."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    other = Plan.amp(compfx.analyze(nn.Sequential(nn.Identity(), nn.Identity(), nn.Linear(16, 4)),
                                    torch.randn(2, 16)))
    with pytest.raises(PlanMismatchError, match="made for another model"):
        torch.compile(model, backend=backend(other, inner="eager"))(torch.randn(2, 16))
    torch._dynamo.reset()
