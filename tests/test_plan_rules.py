"""Plan rules: plans built from rules with written precedence, plans summarised as few rules, rules in plan files."""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compfx
from compfx.analysis import Analysis, OpInfo
from compfx.cli import main
from compfx.errors import BadInputError, PlanFileError, PlanMismatchError
from compfx.opkey import OpKey
from compfx.plan_rules import LEVELS, Rule, resolve_rules
from compfx.vocabulary import Category, Float8Recipe, Precision
from tiny_gpt import tiny_gpt

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def analysis_of(keys, low_dtype=torch.bfloat16) -> Analysis:
    """An analysis of these op keys alone (the rules read only keys; no model is captured)."""
    ops = tuple(OpInfo(key, Category.OTHER, False, "", (), ()) for key in keys)
    return Analysis(ops, torch.device("cpu"), low_dtype, fx.GraphModule(nn.Module(), fx.Graph()))


# ---------------------------------------------------------------------------
# random analyses and plans: Plan.from_rules(analysis, plan.rules()) == plan (acceptance)

NAMES = ["blocks", "layers", "attn", "mlp", "proj", "ln", "0", "1", "2", "head", "q_proj"]
KINDS = ["linear", "matmul", "add", "layer_norm", "softmax", "gelu"]


@st.composite
def analyses_and_plans(draw):
    paths = draw(st.lists(st.lists(st.sampled_from(NAMES), max_size=4).map(".".join), min_size=1, max_size=8))
    blocks = draw(st.integers(1, 4))  # some paths repeat per block, as a decoder's do
    modules = [f"stack.{b}.{p}" if p and draw(st.booleans()) else p for p in paths for b in range(blocks)]
    keys = list(dict.fromkeys(OpKey(m, draw(st.sampled_from(KINDS)), draw(st.integers(0, 2))) for m in modules))
    analysis = analysis_of(keys, draw(st.sampled_from([torch.float16, torch.bfloat16])))
    tied = draw(st.booleans())  # a plan tied by block, or one drawn op by op
    by_slot = {}
    precisions = []
    for key in keys:
        slot = (key.module.split(".", 2)[-1], key.kind, key.index) if tied else key
        precisions.append(by_slot.setdefault(slot, draw(st.sampled_from(list(Precision)))))
    recipe = draw(st.sampled_from(list(Float8Recipe)))
    return analysis, compfx.Plan.from_assignment(analysis, precisions, fp8_recipe=recipe)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=analyses_and_plans())
def test_a_plans_rules_rebuild_the_plan_exactly(case):
    analysis, plan = case
    rules = plan.rules()
    assert compfx.Plan.from_rules(analysis, rules) == plan
    assert len(rules) <= len(plan)  # never more than one rule per op


def test_a_gpt_plan_tied_by_block_is_a_handful_of_rules_at_any_depth():
    """An 8-layer GPT-2-style decoder (85 ops) whose plan is the same in every block: the MLP's linears in FP8,
    the attention output and every norm in FP32, the head in FP32, the rest as autocast does it."""
    counts = {}
    for layers in (2, 8):
        model = tiny_gpt(layers)
        analysis = compfx.analyze(model, torch.randint(0, 64, (2, 16)), fp8=True)
        chosen = {op.key: Precision.FP8 for op in analysis.ops if ".mlp." in op.key.module and op.kind == "linear"}
        chosen |= {op.key: Precision.FP32 for op in analysis.ops
                   if op.key.module.endswith("attn.proj") or op.kind == "layer_norm" or op.key.module == "lm_head"}
        plan = compfx.Plan.amp(analysis).with_precisions(chosen)
        rules = plan.rules()
        assert compfx.Plan.from_rules(analysis, rules) == plan
        counts[layers] = len(rules)
        if layers == 8:
            assert len(analysis.ops) == 85
            text = [str(rule) for rule in rules]
            assert "module blocks.*.mlp.*, kind linear -> fp8 (tensorwise)" in text, text
    assert counts[8] == counts[2] <= 6, counts  # as many rules for 8 blocks as for 2


# ---------------------------------------------------------------------------
# precedence: global < kind < module < module+kind < module+kind+index < op key

KEYS = [OpKey(f"blocks.{b}.attn{proj}", kind, index) for b in (0, 1)
        for proj, kind, index in (("", "matmul", 0), ("", "matmul", 1), (".proj", "linear", 0))]
KEYS += [OpKey("head", "linear", 0), OpKey("", "add", 0)]


def precisions(rules, keys=KEYS) -> list[str]:
    return [str(p) for p in resolve_rules(keys, rules)[0].values()]


@pytest.mark.parametrize("rules, expected", [
    ([Rule("low")], ["low"] * 8),
    ([Rule("low"), Rule("fp32", kind="matmul")], ["fp32", "fp32", "low", "fp32", "fp32", "low", "low", "low"]),
    ([Rule("fp32", kind="matmul"), Rule("low", module="blocks.*.attn.**"), Rule("follow")],  # order does not matter
     ["low", "low", "low", "low", "low", "low", "follow", "follow"]),
    ([Rule("low"), Rule("fp32", module="blocks.*.attn.**"), Rule("low", module="blocks.*.attn.**", kind="linear")],
     ["fp32", "fp32", "low", "fp32", "fp32", "low", "low", "low"]),
    ([Rule("low"), Rule("fp32", module="blocks.*.attn", kind="matmul"), Rule("low", module="blocks.*.attn",
                                                                              kind="matmul", index=1)],
     ["fp32", "low", "low", "fp32", "low", "low", "low", "low"]),
    ([Rule("low"), Rule("fp32", module="blocks.*.attn", kind="matmul", index=1),
      Rule.for_key("blocks.1.attn:matmul#1", "follow")],
     ["low", "fp32", "low", "low", "follow", "low", "low", "low"]),
    ([Rule("low"), Rule("fp32", module_regex=r"blocks\.1\..*|head")], ["low"] * 3 + ["fp32"] * 4 + ["low"]),
    ([Rule("low"), Rule("fp32", module="")], ["low"] * 7 + ["fp32"]),  # "" is the model itself
])
def test_the_highest_level_that_selects_an_op_decides_it(rules, expected):
    assert precisions(rules) == expected


def test_the_levels_are_the_written_precedence():
    rules = [Rule("low"), Rule("low", kind="add"), Rule("low", module="m"), Rule("low", module="m", kind="add"),
             Rule("low", module="m*", kind="add", index=0), Rule.for_key("m:add#0", "low")]
    assert [rule.level_name for rule in rules] == list(LEVELS)
    assert [rule.level for rule in rules] == sorted(rule.level for rule in rules)


@pytest.mark.parametrize("rules, error, words", [
    ([Rule("low"), Rule("fp32", module="blocks.*.mpl")], PlanMismatchError, "select no op"),
    ([Rule("low"), Rule("fp32", kind="conv2d")], PlanMismatchError, "select no op"),
    ([Rule("low"), Rule("fp32", module="blocks.*.attn.**"), Rule("follow", module="blocks.1.**")], BadInputError,
     "both at level module"),
    ([Rule("fp32", kind="matmul")], PlanMismatchError, "no rule selects 4 op"),
    ([Rule("fp8", fp8_recipe="rowwise"), Rule("fp8", kind="matmul", fp8_recipe="tensorwise")], BadInputError,
     "one FP8 recipe"),
    (["low"], BadInputError, "expected compfx Rules"),
])
def test_rules_that_select_nothing_conflict_or_leave_ops_out_are_refused(rules, error, words):
    with pytest.raises(error, match=words):
        resolve_rules(KEYS, rules)


def test_two_rules_of_one_level_that_agree_are_no_conflict_and_a_base_fills_the_rest():
    assert precisions([Rule("low"), Rule("fp32", module="blocks.**"), Rule("fp32", module="blocks.1.**")]) == \
        ["fp32"] * 6 + ["low", "low"]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    a = compfx.analyze(model, torch.randn(3, 4))
    plan = compfx.Plan.from_rules(a, [Rule("fp32", module="2")], base=compfx.Plan.amp(a))
    assert plan.bitstring(a) == "0f1" and plan.fingerprint == a.fingerprint and plan.low_dtype == a.low_dtype


@pytest.mark.parametrize("make, words", [
    (lambda: Rule("half"), "precision"),
    (lambda: Rule("low", module="blocks.[0-3]"), "module_regex"),
    (lambda: Rule("low", module="blocks.x**"), "component of its own"),
    (lambda: Rule("low", module_regex="blocks.(", kind="add"), "not a regular expression"),
    (lambda: Rule("low", module="a", module_regex="a"), "not both"),
    (lambda: Rule("low", kind="add", index=0), "give module="),
    (lambda: Rule("low", fp8_recipe="rowwise"), "only to rules whose precision is 'fp8'"),
    (lambda: Rule.for_key("not a key", "low"), "not an op key"),
])
def test_malformed_rules_are_refused_when_written(make, words):
    with pytest.raises(BadInputError, match=words):
        make()


# ---------------------------------------------------------------------------
# plan files hold rules


def small_case():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    a = compfx.analyze(model, torch.randn(3, 4))
    return model, a, compfx.Plan.from_bitstring(a, "0f1")


def test_a_saved_plan_file_holds_its_rules_and_loads_back(tmp_path):
    _, a, plan = small_case()
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["version"] == 2 and [Rule.from_dict(r) for r in data["rules"]] == list(plan.rules())
    assert compfx.Plan.load(tmp_path / "plan.json") == plan
    plan.save(tmp_path / "plain.json", rules=False)  # what an older compfx reads: version 1, no rules
    assert json.loads((tmp_path / "plain.json").read_text())["version"] == 1
    assert compfx.Plan.load(tmp_path / "plain.json") == plan


def test_a_version_1_file_from_before_rules_still_loads(tmp_path):
    _, a, plan = small_case()
    old = {"format": "compfx-plan", "version": 1, "low_dtype": "bfloat16", "fingerprint": a.fingerprint,
           "torch_version": str(torch.__version__), "ops": {str(k): str(v) for k, v in plan.items()}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert compfx.Plan.load(tmp_path / "old.json") == plan
    for bad in ({**old, "rules": []}, {**old, "version": 4}):  # rules are version 2's; 4 is not written yet
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(PlanFileError, match="rules|version 4"):
            compfx.Plan.load(tmp_path / "bad.json")


def test_rules_edited_so_that_they_no_longer_give_the_ops_are_refused(tmp_path):
    _, a, plan = small_case()
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["rules"] = [{"precision": "low"}]  # every op low: the file's ops say otherwise
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="do not reproduce its ops"):
        compfx.Plan.load(tmp_path / "plan.json")
    data["rules"][-1] = {"precision": "low", "module": "3"}
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="select no op"):
        compfx.Plan.load(tmp_path / "plan.json")


def test_a_file_of_rules_alone_is_a_plan_for_the_model_it_is_loaded_for(tmp_path):
    model, a, _ = small_case()
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"format": "compfx-plan", "version": 2, "low_dtype": "bfloat16", "rules": [
        {"precision": "follow"}, {"precision": "low", "kind": "linear"}, {"precision": "fp32", "module": "2"}]}))
    assert compfx.Plan.load(path, analysis=a).bitstring(a) == "0f1"
    with pytest.raises(PlanFileError, match="rules only"):
        compfx.Plan.load(path)
    fp16 = compfx.analyze(model, torch.randn(3, 4), low_dtype=torch.float16)
    with pytest.raises(PlanMismatchError, match="bfloat16"):
        compfx.Plan.load(path, analysis=fp16)


def test_compfx_plan_show_prints_the_rules(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models.py").write_text("import torch.nn as nn\n\ndef small():\n    return nn.Sequential("
                                        "nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n")
    _, _, plan = small_case()
    plan.save("plan.json")
    assert main(["plan", "show", "plan.json"]) == 0
    out = capsys.readouterr().out
    assert f"as {len(plan.rules())} rule(s)" in out and "global" in out and "op 2:linear#0" in out
    (tmp_path / "rules.json").write_text(json.dumps({"format": "compfx-plan", "version": 2, "rules": [
        {"precision": "follow"}, {"precision": "low", "kind": "linear"}]}))
    assert main(["plan", "show", "rules.json", "--model", "models:small", "--input-shape", "3,4"]) == 0
    assert "2 low" in capsys.readouterr().out
    assert main(["plan", "show", "rules.json"]) == 2
    assert "rules only" in capsys.readouterr().err
