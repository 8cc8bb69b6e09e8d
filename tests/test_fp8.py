"""FP8 as a third precision: eligibility, plans, the torchao rewrite, the search, the compile backend.

Float8 GEMMs are emulated on this CPU (torchao's ``emulate=True``): same numbers, no speed. The search test
uses a ``cost_fn`` that prices FP8 as a device with float8 GEMMs would, never the CPU's seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import compfx
from compfx.planned_module import PlannedModule, apply
from compfx.compile_backend import backend
from compfx.errors import BadInputError, PlanFileError, PlanMismatchError
from compfx.float8 import fp8_eligible
from compfx.passes import Float8Matmul
from compfx.vocabulary import Float8Recipe, Precision, SampleStatus, Stage

from helpers import forward_and_grads

float8 = pytest.importorskip("torchao.float8")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))


# ---------------------------------------------------------------------------
# can it: eligibility


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("kind, shapes, device, capability, eligible, reason", [
    ("linear", [(64, 32), (48, 32)], CPU, None, True, "emulated on cpu"),
    ("linear", [(2, 8, 32), (48, 32)], CUDA, (9, 0), True, "native"),
    ("linear", [(64, 32), (40, 32)], CPU, None, False, "out_features=40"),
    ("linear", [(64, 24), (48, 24)], CPU, None, False, "in_features=24"),
    ("linear", [(10, 32), (48, 32)], CPU, None, False, "input rows=10"),  # grad_weight's inner dim
    ("linear", [(64, 32), (48, 32)], CUDA, (8, 0), False, "8.0 < 8.9"),
    ("matmul", [(4, 16, 32), (32, 48)], CPU, None, True, "emulated"),
    ("matmul", [(4, 16, 32), (4, 32, 48)], CPU, None, False, "2-D right operand"),
    ("bmm", [(4, 16, 32), (4, 32, 48)], CPU, None, False, "no float8 path for bmm"),
    ("conv2d", [(1, 16, 8, 8), (16, 16, 3, 3)], CPU, None, False, "no float8 path"),
])
def test_fp8_eligibility_by_kind_shape_and_device(kind, shapes, device, capability, eligible, reason):
    can, why = fp8_eligible(kind, shapes, device=device, capability=capability)
    assert can is eligible and reason in why


def test_analyze_marks_fp8_eligibility_only_when_asked():
    model = mlp()
    x = torch.randn(32, 32)
    assert not any(op.fp8_eligible for op in compfx.analyze(model, x).ops)
    ops = compfx.analyze(model, x, fp8=True).ops
    assert [op.fp8_eligible for op in ops] == [True, False, True, False, True]
    assert "gelu" in ops[1].fp8_reason


# ---------------------------------------------------------------------------
# the rewrite matches torchao's own float8 training


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_all_fp8_mlp_matches_torchao_convert_to_float8_training(recipe):
    model = mlp()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    reference = float8.convert_to_float8_training(copy.deepcopy(model), config=config)
    x = torch.randn(4, 16, 32)
    analysis = compfx.analyze(model, x, fp8=True)
    plan = compfx.Plan.from_bitstring(analysis, "8f8f8", fp8_recipe=recipe)
    planned = apply(model, plan, analysis=analysis)
    out, grads = forward_and_grads(planned, model, (x,))
    ref_out, ref_grads = forward_and_grads(reference, reference, (x,))
    # torchao's own tests compare its emulated float8 linear with the same config; so do we (same kernels).
    torch.testing.assert_close(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=lambda m: f"grad of {name}: {m}")
    # FP8 is not FP32 here: the test would pass trivially otherwise
    fp32_out, _ = forward_and_grads(apply(model, compfx.Plan.fp32(analysis), analysis=analysis), model, (x,))
    assert not torch.equal(out, fp32_out)


def test_fp8_keeps_fp32_master_weights_optimizer_and_state_dict():
    model = mlp()
    x = torch.randn(32, 32)
    analysis = compfx.analyze(model, x, fp8=True)
    before = {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
    planned = apply(model, compfx.Plan.from_bitstring(analysis, "8f8f0"), analysis=analysis)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model[0].weight.detach().clone()
    planned(x).square().mean().backward()
    optimizer.step()
    assert {k: (v.dtype, v.shape) for k, v in planned.state_dict().items()} == before
    assert planned.get_parameter("0.weight") is model[0].weight and model[0].weight.dtype == torch.float32
    assert not torch.equal(model[0].weight, weight)  # the optimizer trained the model's own FP32 weight
    assert sum(isinstance(m, compfx.passes.Float8Matmul) for m in planned.graph_module.modules()) == 2


# ---------------------------------------------------------------------------
# plans: files carry the recipe; fp8 on an ineligible op is refused


def test_fp8_plan_saves_loads_and_applies(tmp_path):
    model = mlp()
    x = torch.randn(32, 32)
    analysis = compfx.analyze(model, x, fp8=True)
    plan = compfx.Plan.from_bitstring(analysis, "8f0f8", fp8_recipe="rowwise")
    plan.save(tmp_path / "plan.json")
    loaded = compfx.Plan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.fp8_recipe is Float8Recipe.ROWWISE
    assert loaded.bitstring(analysis) == "8f0f8"
    torch.testing.assert_close(apply(model, loaded, x)(x), apply(model, plan, analysis=analysis)(x), rtol=0, atol=0)
    assert compfx.Plan.amp(analysis).fp8_recipe is None and "fp8_recipe" not in compfx.Plan.amp(analysis).to_dict()


def test_a_plan_file_with_an_unknown_recipe_is_refused(tmp_path):
    analysis = compfx.analyze(mlp(), torch.randn(32, 32), fp8=True)
    data = compfx.Plan.from_bitstring(analysis, "8f0f0").to_dict()
    with pytest.raises(PlanFileError, match="fp8_recipe 'blockwise'"):
        compfx.Plan.from_dict({**data, "fp8_recipe": "blockwise"})


def test_fp8_on_an_ineligible_op_is_refused_before_anything_is_applied():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))  # 10 outputs: not a multiple of 16
    x = torch.randn(32, 32)
    analysis = compfx.analyze(model, x, fp8=True)
    with pytest.raises(PlanMismatchError, match=r"2:linear#0: out_features=10 is not a multiple of 16"):
        apply(model, compfx.Plan.from_bitstring(analysis, "8f8"), analysis=analysis)
    with pytest.raises(PlanMismatchError, match="1:relu#0: no float8 path for relu"):
        apply(model, compfx.Plan.from_bitstring(analysis, "880"), analysis=analysis)
    plain = compfx.analyze(model, x)  # not analysed for FP8: the error says how to analyse it
    with pytest.raises(PlanMismatchError, match=r"analyze\(\.\.\., fp8=True\)"):
        apply(model, compfx.Plan.from_bitstring(plain, "8f0"), analysis=plain)
    apply(model, compfx.Plan.from_bitstring(analysis, "8f0"), analysis=analysis)  # the eligible one applies


def test_compfx_works_without_torchao_and_fp8_asks_for_the_extra():
    script = """
import sys
sys.modules["torchao"] = None  # as if torchao were not installed
import torch, compfx
model = torch.nn.Sequential(torch.nn.Linear(32, 16))
x = torch.randn(16, 32)
a = compfx.analyze(model, x, fp8=True)
compfx.apply(model, compfx.Plan.amp(a), analysis=a)(x)
try:
    compfx.apply(model, compfx.Plan.from_bitstring(a, "8"), analysis=a)
except compfx.errors.BadInputError as error:
    print("refused:", error)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "compfx[fp8]" in result.stdout


def test_search_config_refuses_an_unknown_recipe():
    with pytest.raises(BadInputError, match="fp8_recipe"):
        compfx.SearchConfig(fp8=True, fp8_recipe="per-block")


# ---------------------------------------------------------------------------
# the search: FP8 where harmless, not where the loss guard says no


D = 32


class MassiveActivation(nn.Module):
    """``sensitive`` sees rows of massive activations (as attention-sink tokens have); ``harmless`` sees them
    after a LayerNorm. Tensorwise FP8 scales a tensor by its largest value, so ``sensitive``'s ordinary rows
    flush to zero in FP8, while bf16 (per-element exponent) keeps them."""

    def __init__(self):
        super().__init__()
        self.sensitive, self.norm, self.harmless = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x):
        return self.harmless(self.norm(self.sensitive(x)))


def massive_activation_batches(teacher, n=4, rows=64):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(rows, D, generator=g)
        x[0] = 1e6  # 448 / 1e6 * |x| < half the smallest e4m3 subnormal for the other rows
        with torch.no_grad():
            out.append((x, teacher(x) + 0.5 * torch.randn(rows, D, generator=g)))
    return out


def scored_rows(output, batch):
    return nn.functional.mse_loss(output[1:], batch[-1][1:])  # row 0 is the massive one, not scored


_PRICE = {Precision.FP8: 0.0, Precision.LOW: 1.0, Precision.FP32: 2.0}


def fp8_cheapest(plan, seconds):
    """A device where FP8 GEMMs pay most, then bf16 (this CPU's emulated FP8 is slow: its seconds hardly count)."""
    return sum(_PRICE.get(p, 0.0) for p in plan.values()) + 1e-3 * seconds


def test_search_chooses_fp8_where_harmless_and_keeps_bf16_where_fp8_breaks_the_loss():
    torch.manual_seed(0)
    model = MassiveActivation()
    loader = massive_activation_batches(copy.deepcopy(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    result = compfx.optimize(model, loader, optimizer=optimizer, loss_fn=scored_rows, config=compfx.SearchConfig(
        fp8=True, cost_fn=fp8_cheapest, progress=False, warmup=0, repeats=1, stage2_check_batches=2,
        cache_plan=False))
    a, plan = result.analysis, result.plan
    sensitive, harmless = (a.ops[i].key for i in (0, 2))
    assert plan[harmless] is Precision.FP8 and plan[sensitive] in (Precision.LOW, Precision.FP32)
    assert plan.fp8_recipe is Float8Recipe.TENSORWISE
    # the loss gap that made the guard refuse FP8 for `sensitive`: every such plan was rejected
    stage1 = result.log.samples(Stage.STAGE1)
    sensitive_fp8 = [r for r in stage1 if r.plan[0] == "8" and r.loss is not None]
    assert sensitive_fp8 and all(r.status is SampleStatus.REJECTED for r in sensitive_fp8)
    assert min(r.loss for r in sensitive_fp8) > 2 * result.loss0  # e.g. 0.63 against loss_0 0.25
    table = result.report()
    assert "fp8" in table and "tensorwise" in table


def test_stage1_tries_fp8_only_for_eligible_ops_and_groups_when_over_budget():
    from compfx.search import SearchSpace, stage1_candidates, stage1_plan_space
    from compfx.vocabulary import Category as C

    space = SearchSpace((C.WHITELIST,) * 3, (False,) * 3, ("a", "a", "b"), fp8_eligible=(True, True, False))
    assert [len(space.levels(i)) for i in range(3)] == [3, 3, 2]
    assert len(stage1_candidates(space)) == 18 and str(stage1_candidates(space)[0]) == "880"
    assert stage1_plan_space(space, 18) == "exhaustive" and stage1_plan_space(space, 17) == "grouped"
    assert stage1_plan_space(space, 5) == "greedy"


# ---------------------------------------------------------------------------
# torch.compile(backend="compfx") with Inductor


def test_fp8_plan_under_the_compfx_backend_with_inductor_matches_apply():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(16, 32)
    analysis = compfx.analyze(model, x, fp8=True)
    plan = compfx.Plan.from_bitstring(analysis, "8f0", fp8_recipe="rowwise")
    compiled_backend = backend(plan)  # inner: Inductor
    out, grads = forward_and_grads(torch.compile(model, backend=compiled_backend), model, (x,))
    ref, ref_grads = forward_and_grads(apply(model, plan, analysis=analysis), model, (x,))
    torch.testing.assert_close(out, ref)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name])
    (record,) = compiled_backend.records
    assert record.precisions[analysis.ops[0].key] is Precision.FP8


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_compfx_backend_runs_an_fp8_op_at_amps_precision_where_a_graphs_shapes_break_the_rule(dynamic):
    """A ragged batch recompiles the model; torch's scaled matmul would refuse 10 rows, or sizes only known at run
    time (dynamic shapes): that graph runs the op low, and says so, as PlannedModule does at a new signature."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    analysis = compfx.analyze(model, torch.randn(16, 32), fp8=True)
    plan = compfx.Plan.from_bitstring(analysis, "8f0")
    compiled_backend = backend(plan, inner="aot_eager")
    compiled = torch.compile(model, backend=compiled_backend, dynamic=dynamic)
    key = analysis.ops[0].key
    fp8, low = apply(model, plan, analysis=analysis), apply(model, plan.with_precisions({key: Precision.LOW}),
                                                             analysis=analysis)
    for rows in (16, 10):
        x = torch.randn(rows, 32)
        runs_fp8 = rows == 16 and not dynamic
        torch.testing.assert_close(compiled(x), (fp8 if runs_fp8 else low)(x), rtol=0, atol=0)
    first, *later = compiled_backend.records
    if dynamic:  # one graph for every batch size: its rows are symbolic from the start
        assert not later and first.precisions[key] is Precision.LOW
        assert "dynamic" in dict(first.fp8_fallbacks)[key]
    else:
        assert first.precisions[key] is Precision.FP8 and not first.fp8_fallbacks
        assert later[-1].precisions[key] is Precision.LOW
        assert dict(later[-1].fp8_fallbacks)[key] == "input rows=10 is not a multiple of 16"


# ---------------------------------------------------------------------------
# native float8 GEMMs (a GPU of capability 8.9+: the GPU suite's `pytest -m cuda` runs these)

_NATIVE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.cuda
@pytest.mark.skipif(not _NATIVE, reason="needs a CUDA GPU with float8 GEMMs (capability 8.9+, e.g. H100)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_native_fp8_mlp_matches_torchao_on_the_gpu(recipe):
    model = mlp().cuda()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)  # not emulated: torch._scaled_mm
    reference = float8.convert_to_float8_training(copy.deepcopy(model), config=config)
    x = torch.randn(4, 16, 32, device="cuda")
    analysis = compfx.analyze(model, x, fp8=True)
    assert all("native" in op.fp8_reason for op in analysis.ops if op.fp8_eligible)
    planned = apply(model, compfx.Plan.from_bitstring(analysis, "8f8f8", fp8_recipe=recipe), analysis=analysis)
    out, grads = forward_and_grads(planned, model, (x,))
    ref_out, ref_grads = forward_and_grads(reference, reference, (x,))
    torch.testing.assert_close(out, ref_out)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], msg=lambda m: f"grad of {name}: {m}")


# ---------------------------------------------------------------------------
# FP8 eligibility at every input signature, not only the analysed one


def test_an_fp8_op_runs_low_at_inputs_whose_shapes_cannot_run_fp8(caplog):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    analysis = compfx.analyze(model, torch.randn(16, 32), fp8=True)
    planned = PlannedModule(model, compfx.Plan.from_bitstring(analysis, "8f8"), analysis=analysis)
    ragged = torch.randn(10, 32)  # 10 rows: torch's scaled matmul refuses them on a GPU
    with caplog.at_level("WARNING", logger="compfx"):
        out = planned(ragged)
    [spec] = planned.specializations
    assert [(str(key), why) for key, why in spec.fp8_fallbacks] == [
        ("0:linear#0", "input rows=10 is not a multiple of 16"), ("2:linear#0", "input rows=10 is not a multiple of 16")]
    assert "cannot run FP8" in caplog.text
    fp8_modules = lambda gm: [m for m in gm.modules() if isinstance(m, Float8Matmul)]  # noqa: E731
    [ragged_graph] = [g for s, g in planned.graphs.items() if s != analysis.example_signature]
    assert not fp8_modules(ragged_graph) and len(fp8_modules(planned.graph_module)) == 2  # the first still runs FP8
    low = PlannedModule(model, compfx.Plan.from_bitstring(analysis, "0f0"), analysis=analysis)
    assert torch.equal(out, low(ragged))  # AMP's precision for a linear: low
    planned.replan(compfx.Plan.from_bitstring(analysis, "8f1"))  # a repaired plan keeps the fallback
    [ragged_graph] = [g for s, g in planned.graphs.items() if s != analysis.example_signature]
    assert not fp8_modules(ragged_graph) and len(fp8_modules(planned.graph_module)) == 1


def test_the_search_report_says_which_fp8_ops_ran_low_at_a_ragged_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    g = torch.Generator().manual_seed(0)
    loader = [(torch.randn(rows, 32, generator=g), torch.randn(rows, 16, generator=g)) for rows in (16, 16, 10)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    result = compfx.optimize(model, loader, optimizer=optimizer, loss_fn=lambda out, b: nn.functional.mse_loss(out, b[-1]),
                             config=compfx.SearchConfig(fp8=True, cost_fn=fp8_cheapest, progress=False, warmup=0,
                                                        repeats=1, stage2_check_batches=1, cache_plan=False))
    assert result.plan[result.analysis.ops[0].key] is Precision.FP8
    assert "cannot run FP8 at a signature ran at AMP's precision there: 0:linear#0 at" in result.report()
    fallbacks = [s for s in result.module.specializations if s.fp8_fallbacks]
    assert all(why == "input rows=10 is not a multiple of 16" for s in fallbacks for _, why in s.fp8_fallbacks)
