"""Plan: constructors, bitstring view, JSON round trips, and refusing plans that do not fit."""

from __future__ import annotations

import json
import stat

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compfx
from compfx.errors import CompfxError, PlanFileError, PlanMismatchError
from compfx.opkey import OpKey
from zoo import ZOO, make

_ANALYSES: dict = {}


def _analysis(name: str):
    """Analyses are cached: hypothesis draws many plans per model."""
    if name not in _ANALYSES:
        model, inputs = make(name)
        _ANALYSES[name] = compfx.analyze(model, inputs)
    return _ANALYSES[name]


@st.composite
def plans(draw):
    analysis = _analysis(draw(st.sampled_from(sorted(ZOO))))
    bits = draw(st.text(alphabet="01f", min_size=len(analysis.ops), max_size=len(analysis.ops)))
    low_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    plan = compfx.Plan.from_bitstring(analysis, bits)
    return analysis, bits, compfx.Plan(dict(plan), low_dtype=low_dtype, fingerprint=plan.fingerprint)


# ---------------------------------------------------------------------------
# round trips (acceptance)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plans())
def test_bitstring_to_plan_to_bitstring_is_the_identity(case):
    analysis, bits, plan = case
    assert plan.bitstring(analysis) == bits
    assert compfx.Plan.from_bitstring(analysis, plan.bitstring(analysis)) == compfx.Plan.from_bitstring(analysis, bits)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=plans())
def test_json_save_and_load_is_the_identity(case, tmp_path):
    _, _, plan = case
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = compfx.Plan.load(path)
    assert loaded == plan and loaded.low_dtype == plan.low_dtype and loaded.fingerprint == plan.fingerprint
    assert compfx.Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_plan_file_records_low_dtype_fingerprint_and_torch_version(tmp_path):
    analysis = _analysis("mlp")
    path = tmp_path / "plan.json"
    compfx.Plan.amp(analysis).save(path)
    data = json.loads(path.read_text())
    assert data["low_dtype"] == "bfloat16"
    assert data["fingerprint"] == analysis.fingerprint
    assert data["torch_version"] == torch.__version__
    assert data["ops"] == {"fc1:linear#0": "low", ":relu#0": "follow", "fc2:linear#0": "low"}


# ---------------------------------------------------------------------------
# constructors


def test_constructors_follow_autocast_and_comps_bit_convention():
    analysis = _analysis("cnn")
    amp = compfx.Plan.amp(analysis)
    for op in analysis.ops:
        assert amp[op.key] == {"whitelist": "low", "blacklist": "fp32", "other": "follow"}[op.category]
    assert set(compfx.Plan.fp32(analysis).values()) == {"fp32"}
    assert compfx.Plan.fp32(analysis).bitstring(analysis) == "1" * len(analysis.ops)
    assert compfx.Plan.uniform(analysis, "low").bitstring(analysis) == "0" * len(analysis.ops)


def test_plan_is_immutable():
    plan = compfx.Plan.amp(_analysis("mlp"))
    with pytest.raises(AttributeError):
        plan.low_dtype = torch.float16
    with pytest.raises(TypeError):
        plan[OpKey("fc1", "linear", 0)] = "fp32"
    changed = plan.with_precisions({OpKey("fc1", "linear", 0): "fp32"})
    assert changed[OpKey("fc1", "linear", 0)] == "fp32" and plan[OpKey("fc1", "linear", 0)] == "low"


# ---------------------------------------------------------------------------
# plans that do not fit (acceptance)


def test_plan_for_another_model_names_what_is_wrong():
    mlp, cnn = _analysis("mlp"), _analysis("cnn")
    with pytest.raises(PlanMismatchError, match=r"key\(s\) the model does not have.*no precision for"):
        compfx.Plan.amp(cnn).validate(mlp)
    with pytest.raises(PlanMismatchError, match="fingerprint"):
        compfx.Plan.amp(cnn).bitstring(mlp)


@pytest.mark.parametrize("bits, message", [
    ("01", "length 2, but the model has 3 ops"),
    ("0101", "length 4, but the model has 3 ops"),
    ("0x1", r"contains \['x'\]"),
])
def test_bad_bitstrings_are_refused(bits, message):
    with pytest.raises(PlanMismatchError, match=message):
        compfx.Plan.from_bitstring(_analysis("mlp"), bits)


def test_unknown_precision_is_refused():
    analysis = _analysis("mlp")
    with pytest.raises(PlanMismatchError, match="precision 'half'"):
        compfx.Plan({op.key: "half" for op in analysis.ops}, low_dtype=torch.bfloat16,
                    fingerprint=analysis.fingerprint)
    with pytest.raises(PlanMismatchError):
        compfx.Plan.amp(analysis).with_precisions({analysis.ops[0].key: "int8"})


@pytest.mark.parametrize("corrupt", [
    lambda text: text[: len(text) // 2],                       # truncated
    lambda text: "not json at all",
    lambda text: json.dumps({"hello": "world"}),               # not a plan
    lambda text: text.replace('"low"', '"half"'),               # unknown precision
    lambda text: text.replace('"bfloat16"', '"float32"'),       # unknown low dtype
    lambda text: text.replace('"fc1:linear#0"', '"fc1-linear"'),  # not an op key
])
def test_corrupt_plan_files_raise_plan_file_error(tmp_path, corrupt):
    path = tmp_path / "plan.json"
    compfx.Plan.amp(_analysis("mlp")).save(path)
    path.write_text(corrupt(path.read_text()))
    with pytest.raises(PlanFileError) as error:
        compfx.Plan.load(path)
    assert isinstance(error.value, CompfxError) and str(path) in str(error.value)


def test_saved_plan_file_gets_the_mode_a_plain_open_would_give_and_keeps_an_existing_mode(tmp_path):
    a = _analysis("mlp")
    plain = tmp_path / "plain.json"
    plain.write_text("{}")  # what open(path, "w") makes under this process's umask
    saved = tmp_path / "plan.json"
    compfx.Plan.fp32(a).save(saved)
    assert stat.S_IMODE(saved.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)  # not mkstemp's 0600
    saved.chmod(0o640)
    compfx.Plan.amp(a).save(saved)  # replaced atomically, mode kept
    assert stat.S_IMODE(saved.stat().st_mode) == 0o640 and compfx.Plan.load(saved) == compfx.Plan.amp(a)


def test_a_plan_copies_as_itself_and_pickles_to_an_equal_plan(fresh_dynamo):
    """Modules holding a plan are deep-copied (EMA copies; Lightning deep-copies torch.compile's arguments)."""
    import copy
    import pickle

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    analysis = compfx.analyze(model, torch.randn(3, 4))
    plan = compfx.Plan.from_bitstring(analysis, "0f1")
    assert copy.copy(plan) is plan and copy.deepcopy(plan) is plan
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.fingerprint == plan.fingerprint and again.low_dtype == plan.low_dtype
    original = compfx.backend(plan)
    backend = copy.deepcopy(original)  # what lightning.fabric's torch.compile wrapper does
    assert backend is not original and backend.plan == plan and backend.inner == original.inner
    # ... and the copy compiles the model with that plan
    copied = copy.deepcopy(compfx.backend(plan, inner="eager"))
    torch.compile(model, backend=copied)(torch.randn(3, 4))
    [record] = copied.records
    assert (record.origin, record.plan_fingerprint) == ("given", plan.fingerprint)
    assert dict(record.precisions) == dict(plan)
    planned = copy.deepcopy(compfx.apply(model, plan, analysis=analysis))
    assert planned(torch.randn(3, 4)).shape == (3, 2)
