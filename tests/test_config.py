"""SearchConfig: the settings that decide a search, resume refusing a log written with any other, and the spellings
of the release before (the decision rule's fields given flat, ``predictor="on"``) still working, with a warning."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.errors import BadInputError, CompfxError, PlanMismatchError
from compfx.search.compare import DecisionRule
from compfx.search.config import DECIDES, LOGGED_WHEN_SET, SearchConfig, decision_settings
from tests.helpers import batches, ce, fp32_op_count, needs_torchao

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

#: the config the logged search ran with: exact (no cost model) and quick
LOGGED = SearchConfig(progress=False, warmup=0, repeats=1, stage2_check_batches=1, predictor=False)

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
    "predictor": True,
    "predictor_margin": math.inf,
    "early_stop": None,
    "fp8": True,
    "fp8_recipe": "rowwise",
    "search_pinned": True,
    "compile": compfx.CompileOptions(inner="aot_eager"),
    "tie_blocks": True,
}


#: The decision rule's fields: a nested config, logged as its own fields.
RULE_FIELDS = {f.name for f in dataclasses.fields(DecisionRule)}


def changed(config: SearchConfig, name: str, value) -> SearchConfig:
    """``config`` with one logged setting changed (a field of the decision rule, or of the config itself)."""
    if name in RULE_FIELDS:
        return dataclasses.replace(config, decision=dataclasses.replace(config.decision, **{name: value}))
    return dataclasses.replace(config, **{name: value})


def test_every_field_but_the_opted_out_ones_decides():
    deciding = {f.name for f in dataclasses.fields(SearchConfig) if f.metadata.get(DECIDES, True)}
    assert (deciding - {"decision"}) | RULE_FIELDS == set(CHANGED)  # a new SearchConfig field needs a row here
    logged_when_set = {f.name for f in dataclasses.fields(SearchConfig) if f.metadata.get(LOGGED_WHEN_SET)}
    assert set(decision_settings(LOGGED)) == set(CHANGED) - logged_when_set  # LOGGED leaves them at their defaults
    assert "tie_blocks" in logged_when_set  # newer than the old log below, which has no entry for it
    for name in logged_when_set:
        assert name in decision_settings(changed(LOGGED, name, CHANGED[name]))
    assert {"progress", "keep_search_training", "cache_plan", "cache_dir", "verify_capture"}.isdisjoint(deciding)


def test_decision_settings_are_json_values():
    settings = decision_settings(dataclasses.replace(LOGGED, cost_fn=fp32_op_count, predictor_margin=math.inf))
    assert settings["cost_fn"].startswith("tests.helpers.fp32_op_count (code ") and settings["predictor_margin"] == "inf"


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
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PlanMismatchError, match=f"{field}: log") as error:
        compfx.optimize(model, loader, loss_fn=ce, optimizer=opt, config=changed(LOGGED, field, CHANGED[field]),
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


# -- the decision rule, nested; predictor, a bool ------------------------------------------------------------

def test_the_decision_rule_is_one_frozen_setting_logged_as_its_fields():
    config = SearchConfig(decision=DecisionRule(margin=0.05, rounds=9), predictor=False)
    assert SearchConfig().decision == DecisionRule() == DecisionRule(margin=0.03, confidence=0.95, rounds=7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.decision.margin = 0.1
    settings = decision_settings(config)
    assert (settings["margin"], settings["confidence"], settings["rounds"]) == (0.05, 0.95, 9)
    assert "decision" not in settings and settings["predictor"] == "off"
    assert decision_settings(SearchConfig())["predictor"] == "on"
    with pytest.raises(BadInputError, match="expected a compfx.DecisionRule"):
        SearchConfig(decision={"margin": 0.05})
    with pytest.raises(TypeError):
        SearchConfig(1.01)  # keywords only: the fields' order changed


OLD_SPELLINGS = [
    (dict(margin=0.05), dict(decision=DecisionRule(margin=0.05)),
     "SearchConfig(decision=compfx.DecisionRule(margin=0.05))"),
    (dict(confidence=0.9, rounds=9), dict(decision=DecisionRule(confidence=0.9, rounds=9)),
     "SearchConfig(decision=compfx.DecisionRule(confidence=0.9, rounds=9))"),
    (dict(predictor="off"), dict(predictor=False), "SearchConfig(predictor=False)"),
    (dict(predictor="on", rounds=0), dict(predictor=True, decision=DecisionRule(rounds=0)),
     "SearchConfig(predictor=True)"),
]


@pytest.mark.parametrize("old, new, advice", OLD_SPELLINGS, ids=["margin", "confidence-rounds", "off", "on"])
def test_an_old_spelling_builds_the_same_config_and_says_what_to_write(old, new, advice):
    with pytest.warns(DeprecationWarning) as warned:
        config = SearchConfig(progress=False, **old)
    assert config == SearchConfig(progress=False, **new)
    assert any(advice in str(w.message) for w in warned), [str(w.message) for w in warned]


def test_the_rule_read_flat_or_replaced_flat_still_works_with_a_warning():
    config = SearchConfig(decision=DecisionRule(margin=0.05, rounds=9))
    with pytest.warns(DeprecationWarning, match=r"config\.decision\.margin"):
        assert config.margin == 0.05
    with pytest.warns(DeprecationWarning, match=r"read config\.decision\."):
        assert config.rule is config.decision
    with pytest.warns(DeprecationWarning, match="DecisionRule"):
        again = dataclasses.replace(config, confidence=0.9)  # replaces that field of the rule, keeps the others
    assert again.decision == DecisionRule(margin=0.05, confidence=0.9, rounds=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spellings warn about nothing
        SearchConfig(decision=DecisionRule(margin=0.05), predictor=False).decision.margin


# -- a log written before the decision rule was nested still resumes ------------------------------------------

#: A search log compfx 0.1 wrote (SearchConfig's flat fields; predictor the string "off"), for the model and
#: loader of logged_search's setup, with this config:
OLD_LOG = Path(__file__).parent / "data" / "search-0.1.jsonl"
OLD_LOG_CONFIG = SearchConfig(progress=False, warmup=0, repeats=1, stage2_check_batches=1, predictor=False,
                              cache_plan=False, decision=DecisionRule(margin=0.05, rounds=6))


def test_decision_settings_are_what_the_old_log_recorded():
    header = json.loads(OLD_LOG.read_text().splitlines()[0])["extra"]["search"]
    logged = {k: v for k, v in header.items() if k not in ("fingerprint", "low_dtype")}
    settings = decision_settings(OLD_LOG_CONFIG)
    added = {k: settings.pop(k) for k in set(settings) - set(logged)}
    assert added == {"compile": None}  # added since: an old log, which lacks it, reads as None (eager) on resume
    assert logged == settings


def test_a_log_of_the_release_before_resumes(logged_search, tmp_path):
    _, setup = logged_search
    path = tmp_path / "search.jsonl"
    shutil.copyfile(OLD_LOG, path)
    model, opt, loader = setup()
    result = compfx.optimize(model, loader, loss_fn=ce, optimizer=opt, config=OLD_LOG_CONFIG, log=path, resume=True)
    assert any(r.reason == "resumed" for r in result.log.notes())
    assert result.plan.bitstring(result.analysis) == "111"  # the logged search's decision, replayed
    model, opt, loader = setup()
    with pytest.raises(PlanMismatchError, match="margin: log 0.05 vs now 0.03"):
        compfx.optimize(model, loader, loss_fn=ce, optimizer=opt, log=path, resume=True,
                        config=changed(OLD_LOG_CONFIG, "margin", 0.03))
