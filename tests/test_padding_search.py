"""Tensor Core shape padding, "should we": the search's padding decision, and padding under torch.compile.

The search pads where the cost (a cost function's price, or the measured step) says padding pays, and nowhere
else; on this CPU (no Tensor Cores) it finds that out without timing a step. The compile backend applies the
plan's padding once and keeps Inductor's own shape padding off in the graphs it pads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compfx
from compfx import SearchConfig, cache, optimize
from compfx.compile_backend import compile_with_plan
from compfx.costmodel import PaddingProfile
from compfx.errors import PlanFailedError
from compfx.opkey import OpKey
from compfx.passes.pad_shapes import PAD_META
from compfx.report import render_log_report
from compfx.search.evaluator import LocalEvaluator
from compfx.search.padding import decide_padding, padding_candidates, padding_gate
from compfx.vocabulary import Category, SampleStatus, Stage
from tests.helpers import assert_matches_apply, batches, ce

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

CUDA_AVAILABLE = torch.cuda.is_available()


class Unfit(nn.Module):
    """One GEMM that meets the rule (16 -> 16 at 8 rows), two that miss it (out_features 10, then in_features 10)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 16), nn.Linear(16, 10), nn.Linear(10, 3)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _setup():
    torch.manual_seed(0)
    model = Unfit()
    loader = batches(3, (8, 16))
    analysis = compfx.analyze(model, loader[0][:1])
    return model, torch.optim.SGD(model.parameters(), lr=0.01), loader, analysis


def _gpu_like(eligible: set[OpKey]):
    """A device where low precision pays and an unfit GEMM pays more when padded (Tensor Cores), in cost units."""
    def cost(plan, seconds):
        return 1e-3 * seconds + sum(p == "fp32" for p in plan.values()) + 0.5 * len(eligible - plan.padded)
    return cost


FAST = dict(progress=False, threshold=2.0, warmup=1, repeats=2, stage2_check_batches=1)


@pytest.mark.parametrize("predictor", [True, False])
def test_with_a_cost_where_padding_pays_the_search_pads_exactly_the_ops_that_become_eligible(predictor, tmp_path):
    model, optimizer, loader, analysis = _setup()
    eligible = {op.key for op in analysis.ops if op.pad_eligible}
    assert {str(k) for k in eligible} == {"fc2:linear#0", "head:linear#0"}  # fc1 meets the rule already
    result = optimize(model, loader, loss_fn=ce, optimizer=optimizer, config=SearchConfig(
        cost_fn=_gpu_like(eligible), predictor=predictor, cache_dir=tmp_path, **FAST))
    assert all(result.plan[k] == "low" for k in eligible)
    assert result.plan.padded == eligible
    padded_nodes = [n for n in result.module.graph_module.graph.nodes if n.meta.get(PAD_META)]
    assert padded_nodes and result.module.graph_module.meta["compfx_padded"]
    [decided] = [n for n in result.log.notes() if "padding" in n.extra]
    assert decided.extra["padding"]["kept"] is True and decided.reason.startswith("padding on for 2 op(s)")
    saved = cache.find_plan(analysis.fingerprint, low_dtype=analysis.low_dtype, cache_dir=tmp_path)
    assert saved == result.plan  # the plan torch.compile(backend="compfx") will run pads too
    report = result.report()
    header = report.splitlines()[0]
    assert "padding        2 of 2 op(s)" in report and " pad " in header
    pad_column = header.index(" pad ") + 1
    table = report.split("\n\n")[0].splitlines()
    assert sum(line[pad_column:pad_column + 6] == "padded" for line in table) == 2


@pytest.mark.parametrize("predictor", [True, False])
def test_with_the_measured_cpu_cost_the_search_pads_nothing_without_timing_a_step(predictor, monkeypatch):
    def no_padding_timings(self, plan, **kwargs):
        raise AssertionError("a padded plan was timed on a CPU")

    monkeypatch.setattr(LocalEvaluator, "time_plan", no_padding_timings)
    model, optimizer, loader, analysis = _setup()
    # every whitelist op low (fp32_op_count prices nothing about padding), so there is something to pad
    result = optimize(model, loader, loss_fn=ce, optimizer=optimizer, config=SearchConfig(
        cost_fn=lambda plan, s: s + sum(p == "fp32" for p in plan.values()), predictor=predictor, cache_plan=False,
        **FAST))
    assert padding_candidates(analysis, result.plan)  # pad-eligible ops run low...
    assert result.plan.padded == frozenset()  # ... and none is padded
    [decided] = [n for n in result.log.notes() if "padding" in n.extra]
    assert "cpu has no tensor cores" in decided.reason and "no step was timed" in decided.reason
    measured = optimize(model, loader, loss_fn=ce, optimizer=optimizer, config=SearchConfig(
        predictor=predictor, cache_plan=False, **FAST))  # the default cost: measured seconds
    assert measured.plan.padded == frozenset()


def test_a_finished_padded_search_renders_from_its_log(tmp_path):
    model, optimizer, loader, analysis = _setup()
    eligible = {op.key for op in analysis.ops if op.pad_eligible}
    result = optimize(model, loader, loss_fn=ce, optimizer=optimizer, log=tmp_path / "search.jsonl",
                      config=SearchConfig(cost_fn=_gpu_like(eligible), cache_plan=False, **FAST))
    assert render_log_report(tmp_path / "search.jsonl").splitlines()[:8] == result.report().splitlines()[:8]


# -- the decision itself, on stand-ins ------------------------------------------------------------------------

HEAD, FC = OpKey.parse("head:linear#0"), OpKey.parse("fc:linear#0")


def _plan():
    model = nn.Sequential()
    model.fc, model.head = nn.Linear(16, 10), nn.Linear(10, 3)
    analysis = compfx.analyze(model, torch.randn(8, 16))
    return compfx.Plan.amp(analysis), analysis


def _steps(padded_s: list[float], unpadded_s: list[float]):
    """time_plan answering from two queues, and the calls it got."""
    calls = []

    def time_plan(plan):
        calls.append(plan)
        return (padded_s if plan.padded else unpadded_s).pop(0)

    return time_plan, calls


@pytest.mark.parametrize("padded_s, unpadded_s, kept", [
    ([0.8, 0.81, 0.79], [1.0, 1.02, 0.99], True),  # every padded round beats every unpadded one
    ([0.8, 1.05, 0.79], [1.0, 1.02, 0.99], False),  # one padded round as slow as the unpadded: noise could explain it
    ([1.2, 1.21, 1.19], [1.0, 1.02, 0.99], False),  # slower
])
def test_padding_is_kept_only_when_every_measured_round_is_faster(padded_s, unpadded_s, kept):
    plan, _ = _plan()
    time_plan, calls = _steps(list(padded_s), list(unpadded_s))
    reported = []
    decision = decide_padding(plan, [FC, HEAD], can_pay=lambda key: (True, "measured"), time_plan=time_plan,
                              cost=lambda p, s: s, report=reported.append)
    assert decision.kept is kept and decision.plan.padded == (frozenset({FC, HEAD}) if kept else frozenset())
    assert [bool(p.padded) for p in calls] == [False, True] * 3  # in turns
    assert decision.seconds == {"unpadded": unpadded_s, "padded": padded_s}
    [note] = reported
    assert note.stage is Stage.SEARCH and note.status is SampleStatus.NOTE and note.extra["padding"]["kept"] is kept


def test_a_padded_plan_that_fails_stays_unpadded_and_a_closed_gate_times_nothing():
    plan, _ = _plan()

    def failing(p):
        if p.padded:
            raise PlanFailedError("RuntimeError: no kernel")
        return 1.0

    failed = decide_padding(plan, [HEAD], can_pay=lambda key: (True, ""), time_plan=failing, cost=lambda p, s: s)
    assert not failed.kept and failed.plan == plan and "no kernel" in failed.reason
    time_plan, calls = _steps([], [])
    closed = decide_padding(plan, [FC, HEAD], can_pay=lambda key: (key == HEAD and False, "cannot pay"),
                            time_plan=time_plan, cost=lambda p, s: s)
    assert calls == [] and not closed.kept and "no step was timed" in closed.reason


def test_the_gate_asks_the_cost_function_then_the_tensor_cores_then_the_op_profiles():
    plan, analysis = _plan()
    seconds = lambda plan, s: s  # noqa: E731 - the measured seconds price no padding
    priced = lambda plan, s: s - 0.1 * (HEAD in plan.padded)  # noqa: E731 - a simulated device: padding the head pays
    cpu = padding_gate(plan, cost=priced, seconds=1.0, analysis=analysis)
    assert cpu(HEAD) == (True, "the cost function prices it lower")
    assert cpu(FC) == (False, "cpu has no tensor cores: padding only pays on Tensor Cores")

    class OnAGpu:  # the same ops, analysed for an A100: Tensor Cores for fp16
        ops, device, low_dtype = analysis.ops, torch.device("cuda"), torch.float16

    profiles = {HEAD: PaddingProfile(HEAD, low_s=2e-3, padded_s=1e-3), FC: PaddingProfile(FC, low_s=1e-3,
                                                                                           padded_s=1.5e-3)}
    asked = []
    gpu = padding_gate(plan, cost=seconds, seconds=1.0, analysis=OnAGpu(), capability=(8, 0), candidates=[FC, HEAD],
                       profiles=lambda keys: asked.append(list(keys)) or profiles)
    assert asked == [[FC, HEAD]]  # one profiling call for all candidates
    assert gpu(HEAD) == (True, "op alone 1 ms padded vs 2 ms unpadded") and gpu(FC)[0] is False
    exact = padding_gate(plan, cost=seconds, seconds=1.0, analysis=OnAGpu(), capability=(8, 0))
    assert exact(FC) == (True, "no cost model: the measured step decides")
    old_gpu = padding_gate(plan, cost=seconds, seconds=1.0, analysis=OnAGpu(), capability=(6, 1),
                           profiles=lambda keys: pytest.fail("no Tensor Cores: nothing to profile"))
    assert old_gpu(HEAD)[0] is False and "6.1" in old_gpu(HEAD)[1]


def test_only_pad_eligible_ops_the_plan_runs_low_are_candidates():
    plan, analysis = _plan()
    assert padding_candidates(analysis, plan) == (FC, HEAD)
    assert padding_candidates(analysis, plan.with_precisions({HEAD: "fp32"})) == (FC,)
    assert [op.category for op in analysis.ops if op.key in (FC, HEAD)] == [Category.WHITELIST] * 2


# -- under torch.compile: the plan's padding, once ------------------------------------------------------------

def _padded_plan():
    model, _, loader, analysis = _setup()
    keys = [op.key for op in analysis.ops if op.pad_eligible]
    return model, loader[0][0], analysis, compfx.Plan.amp(analysis).with_padding(keys, analysis=analysis)


def test_the_compiled_padded_plan_matches_compfx_apply(fresh_dynamo):
    model, x, analysis, plan = _padded_plan()
    compiled = compile_with_plan(model, plan, inner="aot_eager")
    assert_matches_apply(compiled, model, plan, analysis, (x,), dict(rtol=1.6e-2, atol=1e-4))
    [record] = compiled.compfx_backend.records
    assert set(record.padded) == plan.padded and "2 padded" in compiled.compfx_backend.report()


def test_the_backend_pads_once_and_turns_inductors_own_shape_padding_off_where_it_pads(fresh_dynamo, monkeypatch):
    import torch._inductor.compile_fx as inductor

    seen = []

    def recording_compile_fx(gm, example_inputs, config_patches=None, **kwargs):  # what Inductor would be handed
        seen.append((gm, dict(config_patches or {})))
        return gm.forward

    monkeypatch.setattr(inductor, "compile_fx", recording_compile_fx)
    model, x, analysis, plan = _padded_plan()
    # Inductor's pad_mm on, and forced: the graph compfx pads must still reach Inductor with it off
    with torch._inductor.config.patch(shape_padding=True, force_shape_pad=True):
        compile_with_plan(model, plan, inner="inductor", inductor_options={"shape_padding": True})(x)
        torch._dynamo.reset()
        compile_with_plan(model, plan.with_padding(()), inner="inductor")(x)
    (padded_graph, padded_patches), (plain_graph, plain_patches) = seen
    assert padded_patches["shape_padding"] is False
    assert "shape_padding" not in plain_patches  # a graph the plan does not pad: Inductor's own setting stands
    pads = [n for n in padded_graph.graph.nodes if n.target is F.pad]
    # fc2: weight and bias (out_features 10 -> 16); head: input, weight and bias (in_features 10 -> 16,
    # out_features 3 -> 8); each operand padded once
    assert len(pads) == 5 and len({n.args[0] for n in pads}) == 5
    assert not any(n.target is F.pad for n in plain_graph.graph.nodes)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_cuda_inductor_runs_the_padded_plan_with_pad_mm_forced(fresh_dynamo):
    model, x, _, _ = _padded_plan()
    model, x = model.cuda(), x.cuda()
    analysis = compfx.analyze(model, x, low_dtype=torch.float16)
    plan = compfx.Plan.amp(analysis).with_padding([o.key for o in analysis.ops if o.pad_eligible], analysis=analysis)
    with torch._inductor.config.patch(shape_padding=True, force_shape_pad=True):
        compiled = compile_with_plan(model, plan, inner="inductor")
        assert_matches_apply(compiled, model, plan, analysis, (x,), dict(rtol=1e-2, atol=1e-2))
    assert set(compiled.compfx_backend.records[0].padded) == plan.padded
