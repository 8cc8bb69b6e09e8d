"""A plan's FP8 linears exported to torchao's float8 conversion and torchtitan's float8 settings, and what they cannot
express. Float8 GEMMs are emulated on this CPU (``Float8LinearConfig(emulate=True)``): same numbers, no speed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.errors import PlanExportError
from compfx.float8 import float8_config
from compfx.opkey import OpKey
from compfx.plan_export import _torchtitan_converts, torchtitan_float8
from compfx.plan_rules import Rule
from compfx.vocabulary import Precision
from tiny_gpt import lm_loss, tiny_gpt, token_batches

float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402 - only where torchao is
pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def mlp_fp8_plan(model, recipe="tensorwise"):
    """FP32 everywhere but the blocks' MLP linears, which run FP8: what torchao's conversion can express whole."""
    analysis = compfx.analyze(model, token_batches(1)[0][0], fp8=True)
    rules = [Rule("fp32"), Rule("fp8", module="blocks.*.mlp.*", kind="linear", fp8_recipe=recipe)]
    return analysis, compfx.Plan.from_rules(analysis, rules)


def train(module, parameters, batches) -> list[float]:
    optimizer = torch.optim.SGD(parameters, lr=0.5)
    losses = []
    for batch in batches:
        loss = lm_loss(module(batch[0]), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_converts_exactly_the_plans_fp8_linears_and_trains_as_compfxs_own_rewrite(recipe):
    model = tiny_gpt(2)
    analysis, plan = mlp_fp8_plan(model, recipe)
    converted = float8.convert_to_float8_training(copy.deepcopy(model), module_filter_fn=plan.torchao_filter(),
                                                  config=float8_config(plan.fp8_recipe, emulate=True))
    swapped = {name for name, m in converted.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == {"blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.1.mlp.0", "blocks.1.mlp.2"}
    assert swapped == {key.module for key, p in plan.items() if p is Precision.FP8}

    batches = token_batches(6, seed=1)
    reference = copy.deepcopy(model)
    fp32 = train(reference, reference.parameters(), batches)
    theirs = train(converted, converted.parameters(), batches)
    ours = train(compfx.apply(model, plan, analysis=analysis), model.parameters(), batches)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ours != fp32  # FP8 is not FP32 here: the comparison would hold trivially otherwise


def test_what_torchaos_conversion_cannot_express_is_refused_or_said():
    class WeightMatmul(nn.Module):  # an FP8-eligible matmul that is not an nn.Linear call
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 32))
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return self.fc(self.fc(x) @ self.weight)  # fc is called twice

    model = WeightMatmul()
    analysis = compfx.analyze(model, torch.randn(32, 32), fp8=True)
    assert [str(k) for k in analysis.keys] == ["fc:linear#0", ":matmul#0", "fc:linear#1"]
    matmul = compfx.Plan.from_bitstring(analysis, "181")
    with pytest.raises(PlanExportError, match="matmul, not an nn.Linear module's call"):
        matmul.torchao_filter()
    one_call = compfx.Plan.from_bitstring(analysis, "811")
    with pytest.raises(PlanExportError, match="the module converts whole"):
        one_call.torchao_filter()
    lenient = one_call.torchao_filter(strict=False)
    assert lenient.fqns == frozenset() and any("converts whole" in note for note in lenient.not_expressed)
    both = compfx.Plan.from_bitstring(analysis, "808").torchao_filter()
    assert both.fqns == {"fc"} and both.not_expressed == (
        "the plan's other 1 op(s) (low, fp32, follow) stay compfx's: the target runs them in one precision of its own",)


def test_a_filter_checks_the_model_it_converts():
    plan = {OpKey("blocks.0.mlp.0", "linear", 0): Precision.FP8}
    keep = compfx.plan_export.torchao_filter(plan, "tensorwise")
    keep.check(tiny_gpt(1))
    with pytest.raises(PlanExportError, match="no nn.Linear there"):
        keep.check(nn.Sequential(nn.Linear(32, 32)))


def test_torchtitans_exclude_list_converts_exactly_the_plans_fp8_linears():
    model = tiny_gpt(4)
    _, plan = mlp_fp8_plan(model, "rowwise")
    settings = torchtitan_float8(plan, plan.fp8_recipe, model)
    assert settings.recipe_name == "rowwise"
    assert settings.filter_fqns == ("attn.proj", "attn.qkv", "lm_head")  # one name ending for every block's
    converted = {fqn for fqn, m in model.named_modules() if _torchtitan_converts(fqn, m, settings.filter_fqns)}
    assert converted == {f"blocks.{b}.mlp.{i}" for b in range(4) for i in (0, 2)}
    assert 'filter_fqns = ["attn.proj", "attn.qkv", "lm_head"]' in settings.toml()
    assert 'recipe_name = "rowwise"' in settings.toml()


def test_an_fp8_linear_whose_name_holds_an_excluded_one_cannot_be_a_torchtitan_exclusion():
    model = nn.ModuleDict({"fc": nn.Linear(32, 32), "fc2": nn.Linear(32, 32)})
    plan = {OpKey("fc", "linear", 0): Precision.LOW, OpKey("fc2", "linear", 0): Precision.FP8}
    with pytest.raises(PlanExportError, match="by substring"):
        torchtitan_float8(plan, "tensorwise", model)
