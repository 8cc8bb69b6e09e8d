"""What the search costs, and the pieces that keep it down.

* the cost breakdown adds up to the whole ``optimize()`` call;
* an incremental rewrite (a plan built after others, reusing their per-op dtype
  propagation) is the same program as a full rewrite from nothing, and runs fewer ops on fakes;
* the report's step comparison times its plans in turns, in one phase, each distinct plan once a round;
* profile-cache entries are not fsynced, plan files are.
"""

from __future__ import annotations

import importlib
import json
import os
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import compfx
from compfx.planned_module import planned_graph
from compfx.graph_capture import meta_value
from compfx.measure import PhaseClock
from compfx.plan import Assignment, Plan
from compfx.errors import PlanFailedError
from compfx.search import FunctionEvaluator, SearchLog, compare_steps
from compfx.vocabulary import Precision
from helpers import batches, ce
from zoo import make

propagation = importlib.import_module("compfx.passes.propagate_dtypes")  # the module; the package exports the function

PARTS = {"capture", "profiling", "rewrites", "samples", "step comparison", "other"}


def test_the_cost_breakdown_adds_up_to_the_whole_optimize_call():
    model, _ = make("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = batches(4, (4, 3, 16, 16), classes=10)
    result = compfx.optimize(model, loader, loss_fn=ce, optimizer=optimizer,
                             config=compfx.SearchConfig(progress=False, warmup=0, repeats=2, cache_plan=False))
    parts = result.cost_breakdown
    assert set(parts) <= PARTS and {"capture", "rewrites", "samples", "other"} <= set(parts)
    assert all(seconds >= 0 for seconds in parts.values())
    assert abs(sum(parts.values()) - result.search_seconds) < 1e-6
    # the FP32 baseline epoch is one of the samples, and the search cannot cost less than its parts
    assert parts["samples"] >= result.fp32_epoch_seconds * 0.5
    assert "by part" in result.report() and "capture" in result.report()


def test_phases_count_each_second_once():
    clock = PhaseClock()
    with clock.phase("outer"):
        with clock.phase("inner"):
            sum(range(200_000))
    inner, outer = clock.seconds["inner"], clock.seconds["outer"]
    assert inner > 0 and outer >= 0
    clock.move(inner * 2, source="inner", target="outer")  # never more than the source holds
    assert clock.seconds["inner"] == 0 and clock.seconds["outer"] == outer + inner


# -- incremental rewrite ----------------------------------------------------------------

_MODEL, _INPUTS = make("encoder_matmul")
_ANALYSIS = compfx.analyze(_MODEL, _INPUTS)
_OPS = len(_ANALYSIS.ops)
_PRECISIONS = st.sampled_from([Precision.LOW, Precision.FP32, Precision.FOLLOW])


def _forget_shared_propagation() -> None:
    """What a process that has rewritten nothing yet holds: no per-op propagation results to reuse."""
    mode = propagation.DtypePropagator(_ANALYSIS.graph_module).mode
    propagation._FAKE_RESULTS.pop(mode, None)


def _rewrite(plan: Assignment):
    """The module of ``plan``, and how many ops its rewrite had to run on fakes."""
    calls = []
    original = propagation.DtypePropagator._run_fake

    def counting(self, run):
        calls.append(1)
        return original(self, run)

    with mock.patch.object(propagation.DtypePropagator, "_run_fake", counting):
        gm = planned_graph(_MODEL, Plan.from_assignment(_ANALYSIS, plan), _ANALYSIS)
    return gm, len(calls)


def _dtypes(gm) -> list:
    return [(node.name, str(getattr(meta_value(node), "dtype", None))) for node in gm.graph.nodes]


@settings(max_examples=12, deadline=None)
@given(first=st.lists(_PRECISIONS, min_size=_OPS, max_size=_OPS),
       changes=st.lists(st.tuples(st.integers(0, _OPS - 1), _PRECISIONS), min_size=1, max_size=3))
@example(first=[Precision.LOW] * _OPS, changes=[(_OPS - 1, Precision.FP32)])
def test_an_incremental_rewrite_is_the_same_program_as_a_full_one(first, changes):
    second = list(first)
    for position, precision in changes:
        second[position] = precision
    _forget_shared_propagation()
    _rewrite(Assignment(first))
    incremental, incremental_runs = _rewrite(Assignment(second))  # after the first plan: reuses its per-op results
    _forget_shared_propagation()
    full, full_runs = _rewrite(Assignment(second))  # from nothing
    assert incremental.code == full.code
    assert _dtypes(incremental) == _dtypes(full)
    assert incremental_runs <= full_runs
    x = _INPUTS[0]
    torch.testing.assert_close(incremental(x), full(x), rtol=0, atol=0)


def test_changing_one_op_reruns_only_what_its_new_dtype_reaches():
    _forget_shared_propagation()
    all_low = [Precision.LOW] * _OPS
    _, first_runs = _rewrite(Assignment(all_low))
    last_changed = list(all_low)
    last_changed[-1] = Precision.FP32  # the last op: nothing after it but the output
    _, incremental_runs = _rewrite(Assignment(last_changed))
    _forget_shared_propagation()
    _, full_runs = _rewrite(Assignment(last_changed))
    assert first_runs > 0 and full_runs > 0
    assert incremental_runs < full_runs
    assert incremental_runs <= 3  # the changed op, its casts, what follows it to the output


# -- the report's comparison --------------------------------------------------------------

def test_the_step_comparison_times_the_plans_in_turns_and_each_plan_once_a_round(tmp_path):
    fp32, amp = Assignment.parse("111"), Assignment.parse("0f1")
    timed = []

    def time_step(plan):
        timed.append(str(plan))
        return {"111": 1.0, "0f1": 0.5}[str(plan)]

    log = SearchLog.open(tmp_path / "log.jsonl", {"fingerprint": "x"})
    evaluator = FunctionEvaluator(time_step=time_step, saved_bytes=lambda plan: 100 * str(plan).count("1"))
    comparison = compare_steps(evaluator.time_steps, evaluator.saved_bytes, {"fp32": fp32, "amp": amp, "chosen": fp32},
                               log, rounds=3, confidence=0.7)
    assert timed == ["111", "0f1", "0f1", "111", "111", "0f1"]  # the chosen plan is FP32's: timed once a round
    assert comparison.seconds == {"fp32": (1.0,) * 3, "amp": (0.5,) * 3, "chosen": (1.0,) * 3}
    assert comparison.speedup("amp") == "speed-up 0.50x (0.50-0.50)" and comparison.speedup("fp32") == \
        "the same plan as FP32"
    assert comparison.saved_bytes == {"fp32": 300, "amp": 100, "chosen": 300}
    assert [r.extra["round_seconds"] for r in log.samples()] == [[1.0] * 3, [0.5] * 3]


def test_a_plan_that_fails_is_left_out_of_the_step_comparison(tmp_path):
    def time_step(plan):
        if str(plan) == "0f1":
            raise PlanFailedError("RuntimeError: no bf16 kernel")
        return 1.0

    log = SearchLog.open(tmp_path / "log.jsonl", {"fingerprint": "x"})
    evaluator = FunctionEvaluator(time_step=time_step)
    plans = {"fp32": Assignment.parse("111"), "amp": Assignment.parse("0f1"), "chosen": Assignment.parse("1f0")}
    comparison = compare_steps(evaluator.time_steps, evaluator.saved_bytes, plans, log, rounds=3, confidence=0.7)
    assert set(comparison.seconds) == {"fp32", "chosen"} and comparison.spread("amp") is None
    assert [(r.plan, r.status) for r in log.samples()][0] == ("0f1", "error")


@pytest.mark.parametrize("burst, blocks", [(False, 1), (True, 2)])
def test_a_burst_in_one_round_makes_the_comparison_take_another_block(tmp_path, burst, blocks):
    # the chosen plan is 1.15x faster than FP32's; a burst of other work in one of its steps makes that round's
    # ratio 0.8, and seven rounds' interval then holds 1: one more block of seven gives the interval its answer
    plans = {"fp32": Assignment.parse("111"), "amp": Assignment.parse("0f1"), "chosen": Assignment.parse("1f0")}
    steps = {"111": iter([1.15] * 21), "0f1": iter([1.0] * 21),
             "1f0": iter([1.0] * 3 + [1.15 / 0.8 if burst else 1.0] + [1.0] * 17)}
    log = SearchLog.open(tmp_path / "log.jsonl", {"fingerprint": "x"})
    evaluator = FunctionEvaluator(time_step=lambda plan: next(steps[str(plan)]))
    comparison = compare_steps(evaluator.time_steps, evaluator.saved_bytes, plans, log, rounds=7, confidence=0.95,
                               margin=0.03)
    assert {len(s) for s in comparison.seconds.values()} == {7 * blocks}
    assert comparison.speedup("fp32") == "speed-up 1.15x (1.15-1.15)"


# -- cache writes ---------------------------------------------------------------------------

def test_profile_cache_entries_are_not_fsynced_but_plan_files_are(tmp_path):
    from compfx.cache import entry_path, write_entry

    with mock.patch("compfx.files.os.fsync", wraps=os.fsync) as fsync:
        key = {"op": "linear"}
        assert write_entry(entry_path(tmp_path, key), key, "profile", 1, {"seconds": 1.0})
        assert fsync.call_count == 0
        model, inputs = make("mlp")
        Plan.amp(compfx.analyze(model, inputs)).save(tmp_path / "plan.json")
        assert fsync.call_count == 1


# -- profiling ---------------------------------------------------------------------------------

def test_ops_of_one_signature_are_profiled_once_per_run():
    from compfx.costmodel import profile_ops

    twins = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)), torch.nn.Linear(8, 4))
    analysis = compfx.analyze(twins, torch.randn(4, 8))
    profiles = profile_ops(analysis, repeats=1, use_cache=False)  # no cache to share through
    assert len(profiles) == 4
    # the second and third linears have one signature (8 -> 8 on a 4x8 input that requires grad; the first's
    # input does not): timed once, at each dtype
    assert profiles.measured == 6 and profiles.reused == 2
    keys = list(profiles)
    assert profiles[keys[1]].fp32_s == profiles[keys[2]].fp32_s and profiles[keys[1]].low_s == profiles[keys[2]].low_s


# -- the benchmark ---------------------------------------------------------------------------------

def test_the_fixed_cost_benchmark_measures_each_search_and_its_parts(monkeypatch):
    from benchmarks.search_cost import RUNS, cases_table, run_case
    from compfx.measure import Conditions

    # the machine's conditions fixed: a loaded machine makes real ones differ between the searches, and the warm
    # search would measure its profiles again (as it should then)
    steady = lambda **kw: Conditions(reference_s=1e-3)  # noqa: E731
    monkeypatch.setattr("compfx.costmodel.profile.measure_conditions", steady)
    monkeypatch.setattr("compfx.costmodel.cast_cost.measure_conditions", steady)
    monkeypatch.setattr("compfx.costmodel.predictor.STALE_PROFILE_RATIO", float("inf"))  # nor against the step
    row = run_case("cnn13")
    assert row["fp32_epoch_seconds"] > 0 and row["batches"] == 20
    for run_name, _ in RUNS:
        run = row[run_name]
        assert run["ops"] == 13 and run["capture_method"] == "symbolic"
        assert abs(sum(run["breakdown_seconds"].values()) - run["search_seconds"]) < 1e-6
        assert run["cost_fp32_epochs"] == run["search_seconds"] / row["fp32_epoch_seconds"] > 0
    # the warm search reads the profiles the cold one measured (counted, not timed: timings are the machine's)
    assert row["cold_cache"]["profiles_measured"] > 0 and row["warm_cache"]["profiles_measured"] == 0
    assert row["warm_cache"]["profiles_reused"] == row["cold_cache"]["profiles_measured"]
    assert all(run["fixed_seconds"] == run["search_seconds"] - run["breakdown_seconds"]["samples"]
               for run in (row[name] for name, _ in RUNS))
    assert "| cnn13 |" in cases_table({"cnn13": row})


def test_the_trainer_benchmark_reports_each_run_and_their_median_and_range_and_keeps_the_other_keys(
        monkeypatch, tmp_path, capsys):
    from benchmarks import search_cost

    costs = iter([9.5, 30.0, 8.0])
    logs = []

    def fake_run(seed, log, threads):  # a fresh process's figures
        logs.append(log)
        return {"model": "tiny", "search_cost_fp32_epochs": next(costs), "samples": 2, "chosen_plan": "f0"}

    monkeypatch.setattr(search_cost, "_trainer_run_in_fresh_process", fake_run)
    out = tmp_path / "search_cost.json"
    out.write_text('{"device": "cpu", "fixed_cost_cases": {"readme": 1}}')
    assert search_cost.main(["--trainer", "--repeat", "3", "--out", str(out), "--log", str(tmp_path / "t.jsonl")]) == 0
    written = json.loads(out.read_text())
    assert written["fixed_cost_cases"] == {"readme": 1} and written["device"] == "cpu"
    trainer = written["trainer"]
    assert [run["search_cost_fp32_epochs"] for run in trainer["runs"]] == [9.5, 30.0, 8.0]
    assert trainer["search_cost_fp32_epochs_median"] == 9.5 and trainer["search_cost_fp32_epochs_range"] == [8.0, 30.0]
    assert trainer["runs_within_target"] == 2 and trainer["repeat"] == 3
    assert logs == [str(tmp_path / f"t-{i}.jsonl") for i in range(3)]
    assert "run 1: 30 FP32 epochs" in capsys.readouterr().out


def test_a_trainer_run_keeps_its_search_log(tmp_path):
    from benchmarks.search_cost import run_trainer

    log = tmp_path / "logs" / "trainer.jsonl"
    figures = run_trainer(steps=2, search_batches=3, log=log)
    assert figures["search_cost_fp32_epochs"] > 0 and figures["log"] == str(log)
    assert 2 <= figures["measured_samples"] <= figures["samples"]  # FP32's and AMP's epochs at least
    records = SearchLog.read(log)
    assert records.samples("stage1")[0].reason.startswith("FP32 baseline")


def test_the_step_comparison_warms_every_plan_up_even_those_that_trained_in_the_search(monkeypatch):
    # FP32's plan last trained in the search's first epochs: its first step after the later samples ran 1.5-1.8x
    # its others, which widened every interval and once hid a 1.14x speed-up as "no measurable difference"
    from compfx.search.evaluator import LocalEvaluator

    def first_linear_low_only(plan, seconds):  # a device where only the first linear pays in low precision
        return 0.0 if [str(p) for p in plan.values()][::2] == ["low", "fp32"] else 1.0

    warmups, time_steps = [], LocalEvaluator.time_steps

    def recording(self, plans, rounds, *, warmup=None):
        warmups.append(warmup)
        return time_steps(self, plans, rounds, warmup=warmup)

    monkeypatch.setattr(LocalEvaluator, "time_steps", recording)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    result = compfx.optimize(model, batches(4, (8, 8)), loss_fn=ce, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                             config=compfx.SearchConfig(cost_fn=first_linear_low_only, predictor=False, progress=False,
                                                        warmup=0, repeats=1, stage2_check_batches=0, cache_plan=False))
    plans = result.step_comparison.plans
    assert plans["chosen"] not in (plans["fp32"], plans["amp"])  # the comparison ran after the search
    assert warmups[-1] == 1  # one untimed round first, though warmup=0 and every plan had trained
