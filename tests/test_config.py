"""SearchConfig: the settings that decide a search, and resume refusing a log written with any other."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.errors import CompfxError, PlanMismatchError
from compfx.search.config import DECIDES, SearchConfig, decision_settings
from tests.helpers import batches, ce, fp32_op_count, needs_torchao

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

#: the config the logged search ran with: exact (no cost model) and quick
LOGGED = SearchConfig(progress=False, warmup=0, repeats=1, stage2_check_batches=1, predictor="off")

#: for every field that can change a decision, a value other than LOGGED's
CHANGED = {
    "threshold": 1.5,
    "margin": 0.1,
    "confidence": 0.9,
    "rounds": 9,
    "stage1_budget": 3,
    "stage2_budget": 2,
    "seed": 1,
    "warmup": 1,
    "repeats": 2,
    "grad_scaler": True,
    "cost_fn": fp32_op_count,
    "stage2_check_batches": 0,
    "prune": False,
    "per_device": True,
    "memory_budget": 10 ** 9,
    "predictor": "on",
    "predictor_margin": math.inf,
    "early_stop": None,
    "fp8": True,
    "fp8_recipe": "rowwise",
    "search_pinned": True,
    "tie_blocks": True,
}


def test_every_field_but_the_opted_out_ones_decides():
    deciding = {f.name for f in dataclasses.fields(SearchConfig) if f.metadata.get(DECIDES, True)}
    assert deciding == set(CHANGED)  # a new SearchConfig field needs a row here
    assert set(decision_settings(LOGGED)) == deciding
    assert {"progress", "keep_search_training", "cache_plan", "cache_dir", "verify_capture"}.isdisjoint(deciding)


def test_decision_settings_are_json_values():
    settings = decision_settings(dataclasses.replace(LOGGED, cost_fn=fp32_op_count, predictor_margin=math.inf))
    assert settings["cost_fn"] == "tests.helpers.fp32_op_count" and settings["predictor_margin"] == "inf"


@pytest.fixture(scope="module")
def logged_search(tmp_path_factory):
    """A finished search's log, and a fresh copy of its model, optimizer and loader."""
    path = tmp_path_factory.mktemp("resume") / "search.jsonl"

    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1), batches(2, (6, 4))

    model, opt, loader = setup()
    compfx.optimize(model, loader, loss_fn=ce, optimizer=opt, config=LOGGED, log=path)
    return path, setup


@pytest.mark.parametrize("field", [pytest.param(f, marks=needs_torchao) if f == "fp8" else f for f in sorted(CHANGED)])
def test_resume_with_a_changed_deciding_setting_is_refused(logged_search, field):
    path, setup = logged_search
    model, opt, loader = setup()
    changed = {field: CHANGED[field]}
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PlanMismatchError, match=f"{field}: log") as error:
        compfx.optimize(model, loader, loss_fn=ce, optimizer=opt, config=dataclasses.replace(LOGGED, **changed),
                        log=path, resume=True)
    assert isinstance(error.value, CompfxError) and "without resume=True" in str(error.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("field, value", [("progress", True), ("keep_search_training", False), ("cache_plan", False),
                                          ("cache_dir", "elsewhere"), ("verify_capture", False)])
def test_resume_with_a_setting_that_cannot_change_the_decision_is_accepted(logged_search, field, value, tmp_path):
    path, setup = logged_search
    model, opt, loader = setup()
    value = tmp_path / value if field == "cache_dir" else value
    result = compfx.optimize(model, loader, loss_fn=ce, optimizer=opt,
                             config=dataclasses.replace(LOGGED, **{field: value}), log=path, resume=True)
    assert any(r.reason == "resumed" for r in result.log.notes())
