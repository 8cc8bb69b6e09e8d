"""SearchPredictor: the cost model as the search calls it (calibration, epochs, bounds, log annotations).

Hand-made profiles and cast costs keep every sum exact; no test asserts on timings.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import compfx
from compfx.measure import Conditions
from compfx.planned_module import planned_graph
from compfx.costmodel import (MEASURED_STEP, PREDICTED_STEP, STALE_PROFILE_RATIO, STALE_PROFILES, CastCost, OpProfile,
                              OpProfiles, Predictor, SearchPredictor)
from compfx.costmodel.predictor import (CONTRADICTED_PROFILES, EVIDENCE_SCALE, PREDICTION_SCALE, SCALE_EVIDENCE,
                                       SPOT_CHECK_OPS,
                                       STALE_RATIO_KEPT)
from compfx.plan import Assignment
from compfx.vocabulary import Precision, SampleStatus, Stage
from tests.zoo import make

# Cached profiles are trusted only under the conditions they were taken in (a reference kernel timed
# alike); at two threads on a shared 2-core machine that kernel swings 100x, one thread keeps it steady.
pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

LOW = torch.bfloat16
ACCEPTED, PRUNED = SampleStatus.ACCEPTED, SampleStatus.PRUNED
#: conditions fixed (see test_costmodel.py: a loaded machine makes real ones differ between two builds)
FAST = dict(repeats=1, warmup=0, block_s=1e-4, budget_s=1e-3, conditions=Conditions(reference_s=1e-3))


class _Writes(nn.Module):
    """An in-place op whose only input is written: its precision does not decide its dtype."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x), inplace=True))


@functools.lru_cache(maxsize=None)
def _analysis(name: str):
    model, inputs = (_Writes(), (torch.randn(4, 8),)) if name == "writes" else make(name)
    return compfx.analyze(model, inputs, low_dtype=LOW)


def _predictor(a, fp32=None, low=None, reused: int = 0, alpha=1e-6, beta=1e-3, rewrites=None) -> Predictor:
    """Op i costs fp32[i] (default i+1) at FP32 and low[i] (default 100*(i+1)) low; the cast pass rewrites."""
    fp32 = fp32 or [float(i + 1) for i in range(len(a.ops))]
    low = low or [100.0 * (i + 1) for i in range(len(a.ops))]
    ops = {op.key: OpProfile(op.key, f, lo) for op, f, lo in zip(a.ops, fp32, low)}
    cost = CastCost({(torch.float32, LOW): (alpha, beta), (LOW, torch.float32): (alpha, beta)})

    def rewrite(plan):
        if rewrites is not None:
            rewrites.append(plan)
        return planned_graph(a.graph_module, plan, a)

    return Predictor(OpProfiles(ops, LOW, a.device, reused=reused), cost, analysis=a, rewrite=rewrite)


def _fp32(a) -> Assignment:
    return Assignment([Precision.FP32] * len(a.ops))


def _calibrated(a, step=1000.0, batches=4, **kw) -> SearchPredictor:
    p = SearchPredictor(_predictor(a, **kw))
    p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, step * batches, batches)
    return p


def test_calibrates_on_the_first_accepted_stage1_sample_and_predicts_it_exactly():
    a = _analysis("mlp")
    p = SearchPredictor(_predictor(a))
    fp32, low = _fp32(a), Assignment.parse("000")
    with pytest.raises(compfx.SearchError, match="baseline"):
        p.epoch_seconds(fp32)
    with pytest.raises(compfx.SearchError, match="baseline"):
        p.lower_bound_seconds(fp32)
    # nothing before the baseline calibrates: other stages, notes, rejected samples, no batches
    assert p.observe(Stage.STAGE2, fp32, ACCEPTED, 1.0, 4) == {}
    assert p.observe(Stage.SEARCH, fp32, SampleStatus.NOTE, None, 0) == {}
    assert p.observe(Stage.STAGE1, fp32, SampleStatus.REJECTED, 1.0, 4) == {}
    assert p.observe(Stage.STAGE1, fp32, ACCEPTED, 1.0, 0) == {}
    assert not p.calibrated

    extra = p.observe(Stage.STAGE1, fp32, ACCEPTED, 4000.0, 4)
    assert p.calibrated and p.batches == 4
    assert extra["calibration"] is True
    assert extra[MEASURED_STEP] == pytest.approx(1000.0) and extra[PREDICTED_STEP] == pytest.approx(1000.0)
    assert {"profiles_measured", "profiles_reused", "predictor_build_seconds"} <= set(extra)
    assert STALE_PROFILES not in extra
    assert p.epoch_seconds(fp32) == pytest.approx(4000.0)
    assert p.epoch_seconds(low) - p.epoch_seconds(fp32) == pytest.approx(4 * (p.step_seconds(low) - 1000.0))


def test_later_samples_are_annotated_with_their_measured_step():
    a = _analysis("mlp")
    p = _calibrated(a)
    low = Assignment.parse("000")
    pruned = p.observe(Stage.STAGE1, low, PRUNED, 30.0, 2)  # pruned after 2 batches: seconds per batch run
    assert pruned == {PREDICTED_STEP: p.step_seconds(low), MEASURED_STEP: 15.0}
    assert p.observe(Stage.STAGE2, low, ACCEPTED, 0.5, 10) == {PREDICTED_STEP: p.step_seconds(low), MEASURED_STEP: 0.5}
    for status in (SampleStatus.SKIPPED, SampleStatus.ERROR, SampleStatus.NOTE):
        assert p.observe(Stage.STAGE1, low, status, 1.0, 2) == {}
    assert p.observe(Stage.CHECK, low, ACCEPTED, 1.0, 2) == {}
    assert p.observe("stage1", low, "accepted", 8.0, 4)[MEASURED_STEP] == 2.0  # the enums' strings work too


def test_predictions_are_keyed_by_assignment_and_rewrite_each_plan_once():
    a = _analysis("mlp")
    rewrites = []
    p = _calibrated(a, rewrites=rewrites)
    plan = Assignment.parse("0f1")
    first = p.epoch_seconds(plan)
    assert p.epoch_seconds(Assignment.parse("0f1")) == first and p.step_seconds(plan) * 4 == first
    assert [r.bitstring(a) for r in rewrites] == ["111", "0f1"]  # the baseline's annotation, then 0f1 once
    with pytest.raises(compfx.BadInputError, match="Assignment.parse"):
        p.epoch_seconds("0f1")


def test_an_unpriceable_plan_is_nan_and_not_annotated():
    a = _analysis("mlp")
    p = SearchPredictor(Predictor(_predictor(a).profiles, CastCost({}), analysis=a))  # no cast cost: casts fail
    p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, 4.0, 4)  # the FP32 graph has no casts: calibration works
    low = Assignment.parse("000")
    assert math.isnan(p.epoch_seconds(low))
    assert p.observe(Stage.STAGE1, low, ACCEPTED, 4.0, 4) == {}


def test_cached_profiles_far_over_the_fp32_step_are_measured_again():
    a = _analysis("mlp")  # cached FP32 profiles sum to 6 s: 6x a measured 1 s step
    fresh = _predictor(a, fp32=[0.1, 0.1, 0.1], low=[0.2, 0.2, 0.2])
    p = SearchPredictor(_predictor(a, reused=6), remeasure=lambda: fresh)
    extra = p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, 4.0, 4)
    assert p.predictor is fresh and extra[STALE_PROFILES] == pytest.approx(6.0) and 6.0 > STALE_PROFILE_RATIO
    assert p.epoch_seconds(_fp32(a)) == pytest.approx(4.0)  # calibrated on the fresh profiles


def _spot(a, fp32):
    """A spot check that times the asked ops afresh at ``fp32[i]`` seconds each (and records what it was asked)."""
    asked = []

    def check(keys):
        asked.append([str(k) for k in keys])
        return OpProfiles({op.key: OpProfile(op.key, f, 1.0) for op, f in zip(a.ops, fp32) if op.key in keys}, LOW,
                          a.device)
    return check, asked


def test_a_high_ratio_that_fresh_timings_confirm_is_the_devices_and_keeps_the_cache():
    a = _analysis("mlp")  # cached FP32 profiles sum to 6 s: 6x a measured 1 s step, as launch-bound GPU ops can
    check, asked = _spot(a, fp32=[1.1, 1.9, 3.0])  # timed again now: the same in sum
    p = SearchPredictor(_predictor(a, reused=6), remeasure=lambda: pytest.fail("measured again"), spot_check=check)
    extra = p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, 4.0, 4)
    assert asked == [[str(op.key) for op in reversed(a.ops)][:SPOT_CHECK_OPS]]  # the costliest first
    assert STALE_PROFILES not in extra and extra[STALE_RATIO_KEPT] == [pytest.approx(6.0), pytest.approx(1.0)]
    assert p.epoch_seconds(_fp32(a)) == pytest.approx(4.0)


def test_a_high_ratio_that_fresh_timings_contradict_measures_everything_again():
    a = _analysis("mlp")
    check, _ = _spot(a, fp32=[0.1, 0.2, 0.3])  # the cache is 10x what the machine does now
    fresh = _predictor(a, fp32=[0.1, 0.1, 0.1], low=[0.2, 0.2, 0.2])
    p = SearchPredictor(_predictor(a, reused=6), remeasure=lambda: fresh, spot_check=check)
    extra = p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, 4.0, 4)
    assert p.predictor is fresh and extra[STALE_PROFILES] == pytest.approx(6.0) and STALE_RATIO_KEPT not in extra


@pytest.mark.parametrize("reused, step", [(0, 1.0), (6, 3.0)])  # measured now, or within the ratio
def test_profiles_are_trusted_when_measured_now_or_close_to_the_step(reused, step):
    a = _analysis("mlp")
    p = SearchPredictor(_predictor(a, reused=reused), remeasure=lambda: pytest.fail("measured again"))
    assert STALE_PROFILES not in p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, step * 4, 4)


#: the precisions the cost model prices (it does not price FP8: it is off then)
PRICED = [p for p in Precision if p is not Precision.FP8]


def _drawn_calibrated(data, a, *, cast_costs: bool = False):
    """:func:`_calibrated` on profiles, a step and (``cast_costs``) cast-cost coefficients that hypothesis draws."""
    times = st.lists(st.floats(0.0, 10.0), min_size=len(a.ops), max_size=len(a.ops))
    drawn = dict(step=data.draw(st.floats(0.1, 100.0)), fp32=data.draw(times), low=data.draw(times))
    if cast_costs:
        drawn.update(alpha=data.draw(st.floats(0.0, 1e-3)), beta=data.draw(st.floats(0.0, 1e-3)))
    return _calibrated(a, **drawn)


@pytest.mark.parametrize("name", ["mlp", "cnn", "mha", "embed_gru", "writes"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_lower_bound_never_exceeds_the_prediction(name, data):
    a = _analysis(name)
    p = _drawn_calibrated(data, a)
    plan = Assignment(data.draw(st.sampled_from(PRICED)) for _ in a.ops)
    full = p.epoch_seconds(plan)  # negative when the calibrated overhead is: the tolerance is relative to |full|
    assert p.lower_bound_seconds(plan) <= full + 1e-9 * abs(full) + 1e-9


@pytest.mark.parametrize("name", ["mlp", "cnn", "mha", "embed_gru", "writes", "encoder_sdpa"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_a_bound_read_off_a_priced_plan_never_exceeds_the_prediction(name, data):
    a = _analysis(name)
    p = _drawn_calibrated(data, a, cast_costs=True)
    plans = st.lists(st.sampled_from(PRICED), min_size=len(a.ops), max_size=len(a.ops)).map(Assignment)
    plan, reference = data.draw(plans), data.draw(plans)
    for other in data.draw(st.lists(plans, max_size=3)):  # plans priced already: the bound is read off them too
        p.epoch_seconds(other)
    full = p.epoch_seconds(plan)
    bound = p.lower_bound_against(plan, reference)
    assert p.lower_bound_seconds(plan) <= bound <= full + 1e-9 * abs(full) + 1e-9
    assert p.lower_bound_against(plan, plan) == pytest.approx(full, rel=1e-9, abs=1e-9)  # against itself: exact


def test_a_bound_read_off_a_priced_plan_is_tight_where_the_plans_differ_little():
    a = _analysis("mlp")  # fc1, relu, fc2
    p = _calibrated(a, fp32=[1.0, 2.0, 3.0], low=[1.0, 2.0, 3.0], alpha=0.0, beta=10.0)  # each cast 10 s each way
    amp, other = Assignment.parse("0f0"), Assignment.parse("0f1")
    # every cast of AMP's graph around fc2 may go; those around fc1 stay (fc1's precision casts its inputs)
    assert p.lower_bound_seconds(other) < p.lower_bound_against(other, amp) <= p.epoch_seconds(other)


def test_a_bound_is_also_read_off_the_nearest_plans_priced_already():
    a = _analysis("mlp")  # fc1, relu, fc2
    p = _calibrated(a, fp32=[1.0, 2.0, 3.0], low=[1.0, 2.0, 3.0], alpha=0.0, beta=10.0)
    fp32, plan = Assignment.parse("111"), Assignment.parse("1f0")  # fc2 low
    alone = p.lower_bound_against(plan, fp32)  # FP32's graph has no casts: all the bound knows is the profiles
    assert alone == p.lower_bound_seconds(plan)
    p.epoch_seconds(Assignment.parse("0f0"))  # priced (as the search prices a plan): differs from ``plan`` in fc1
    # read off AMP's graph, fc2's casts (out of fc1's reach) are in ``plan``'s too
    assert alone < p.lower_bound_against(plan, fp32) <= p.epoch_seconds(plan)


def test_lower_bound_prices_ops_at_their_precision_and_follow_ops_at_the_cheaper_profile():
    a = _analysis("mlp")  # fc1, relu, fc2; overhead 1000 - (1+2+3) = 994 per step
    p = _calibrated(a)
    assert p.lower_bound_seconds(Assignment.parse("0f1")) == pytest.approx(4 * (994 + 100 + 2 + 3))


def test_lower_bound_is_the_prediction_when_a_cast_cost_is_negative():
    a = _analysis("mlp")
    p = _calibrated(a, alpha=-1e-6)
    plan = Assignment.parse("000")
    assert p.lower_bound_seconds(plan) == p.epoch_seconds(plan)


def test_build_profiles_and_prices_through_the_given_rewrite(tmp_path):
    a = _analysis("mlp")
    rewritten = []

    def rewrite(plan):
        rewritten.append(plan)
        return planned_graph(a.graph_module, plan, a)

    p = SearchPredictor.build(a, rewrite=rewrite, cache_dir=tmp_path, **FAST)
    assert p.build_seconds > 0 and p.profiles.measured == 2 * len(a.ops)
    extra = p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, 0.4, 4)
    assert extra["profiles_measured"] == 2 * len(a.ops) and extra["profiles_reused"] == 0
    assert p.epoch_seconds(Assignment.parse("000")) > 0 and [r.bitstring(a) for r in rewritten] == ["111", "000"]
    assert SearchPredictor.build(a, rewrite=rewrite, cache_dir=tmp_path, **FAST).profiles.reused == 2 * len(a.ops)
    refreshed = SearchPredictor.build(a, rewrite=rewrite, cache_dir=tmp_path, refresh=True, **FAST)
    assert (refreshed.profiles.measured, refreshed.profiles.reused) == (2 * len(a.ops), 0)


# -- the slope check: AMP's measured batches against the profiles' prediction -----------------------------------

def _amp_checked(amp_ratios, *, spot_check=None, remeasure=None, confidence=0.95):
    """The predictor after a 9-batch FP32 epoch (1000 s a batch) and AMP's epoch whose batches are
    ``amp_ratios`` x FP32's. The profiles predict AMP's step at 0.6 x FP32's (fc1, relu, fc2: 300, 100, 300 at
    FP32, 100 each low; casts free)."""
    a = _analysis("mlp")
    p = SearchPredictor(_predictor(a, fp32=[300.0, 100.0, 300.0], low=[100.0, 100.0, 100.0], alpha=0.0, beta=0.0),
                        spot_check=spot_check, remeasure=remeasure, confidence=confidence)
    p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, 9000.0, 9, batch_seconds=[1000.0] * 9)
    amp = Assignment.parse("0f0")
    assert p.step_seconds(amp) == pytest.approx(600.0)  # the profiles' prediction
    batches = [1000.0 * r for r in amp_ratios]
    return p, p.observe(Stage.STAGE1, amp, ACCEPTED, sum(batches), 9, batch_seconds=batches), amp


@pytest.mark.parametrize("ratios", [
    [0.6] * 9,
    [0.45, 0.5, 0.55, 0.6, 0.6, 0.62, 0.7, 0.75, 0.8],  # noisy around the prediction
    [0.55, 0.58, 0.6, 0.6, 0.61, 0.62, 0.64, 0.66, 1.8],  # and a burst of other work in one batch
])
def test_batches_that_cannot_tell_the_prediction_wrong_leave_it_as_it_is(ratios):
    p, extra, amp = _amp_checked(ratios)
    assert p.scale == 1.0 and extra[PREDICTION_SCALE] == 1.0 and p.step_seconds(amp) == pytest.approx(600.0)
    assert extra[SCALE_EVIDENCE]["predicted_ratio"] == pytest.approx(0.6)


def test_batches_that_contradict_the_prediction_scale_it_as_far_as_they_demand():
    # AMP as fast as FP32 within 1% on every batch: the profiles' 40% is contradicted; the interval's end nearest
    # the prediction (0.99 on 9 pairs at 95%: the second smallest ratio) bears out 1% / 40% of it
    p, extra, amp = _amp_checked([0.985, 0.99, 0.995, 1.0, 1.0, 1.0, 1.005, 1.01, 1.015])
    low, high = extra[SCALE_EVIDENCE]["interval"]
    assert (low, high) == (pytest.approx(0.99), pytest.approx(1.01))
    assert p.scale == pytest.approx((0.99 - 1.0) / (0.6 - 1.0)) and p.step_seconds(amp) == pytest.approx(990.0)
    # AMP confidently slower than FP32, as the profiles predicted it faster: none of the difference holds
    p, _, amp = _amp_checked([1.05, 1.1, 1.1, 1.12, 1.15, 1.15, 1.2, 1.2, 1.3])
    assert p.scale == 0.0 and p.step_seconds(amp) == pytest.approx(1000.0)


def test_the_scale_moves_with_the_evidence_without_jumping():
    # as AMP's measured batches move from FP32's to the prediction, the scale grows steadily to 1
    scales = [_amp_checked([c + d for d in (-0.02, -0.01, -0.01, 0.0, 0.0, 0.0, 0.01, 0.01, 0.02)])[0].scale
              for c in (1.0, 0.9, 0.8, 0.7, 0.65, 0.62, 0.6)]
    assert scales == sorted(scales) and scales[-1] == 1.0
    assert max(b - a for a, b in zip(scales, scales[1:])) <= 0.3


def test_a_contradiction_has_the_profiles_behind_it_timed_again_first():
    a = _analysis("mlp")
    asked = []

    def spot(keys):  # timed afresh: fc1 and fc2 low are as slow as at FP32 (the cache was off)
        asked.append([str(k) for k in keys])
        linear = {k: "linear" in str(k) for k in keys}
        return OpProfiles({k: OpProfile(k, 300.0 if linear[k] else 100.0, 300.0 if linear[k] else 100.0)
                           for k in keys}, LOW, a.device)

    fresh = _predictor(a, fp32=[300.0, 100.0, 300.0], low=[300.0, 100.0, 300.0], alpha=0.0, beta=0.0)
    p, extra, amp = _amp_checked([1.0] * 9, spot_check=spot, remeasure=lambda: fresh)
    # the ops AMP runs low, the most different first, one per distinct profile (fc2's is fc1's: one signature)
    assert asked == [["fc1:linear#0", ":relu#0"]]
    assert p.predictor is fresh and set(extra[CONTRADICTED_PROFILES]) == {"fc1:linear#0"}
    assert p.scale == 1.0 and p.step_seconds(amp) == pytest.approx(1000.0)  # the fresh profiles agree
    # fresh timings that confirm the cache: the contradiction stands, and scales the prediction
    p, extra, amp = _amp_checked([1.0] * 9, spot_check=lambda keys: OpProfiles(
        {k: OpProfile(k, 300.0 if "linear" in str(k) else 100.0, 100.0) for k in keys}, LOW, a.device),
        remeasure=lambda: pytest.fail("measured again"))
    assert CONTRADICTED_PROFILES not in extra and p.scale == 0.0


def test_batches_that_agree_with_the_prediction_time_nothing_again():
    p, extra, _ = _amp_checked([0.6] * 9, spot_check=lambda keys: pytest.fail("timed again"),
                               remeasure=lambda: pytest.fail("measured again"))
    assert p.scale == 1.0 and CONTRADICTED_PROFILES not in extra


# -- evidence from samples and duels: predicted wins the measurements do not show -----------------------------

def _after_amp(fp32_profile=(300.0, 100.0, 300.0), low_profile=(100.0, 400.0, 100.0)):
    """A predictor calibrated on a 9-batch FP32 epoch (1000 s a batch), with AMP's epoch measured as predicted.

    With a slow low-precision relu, AMP's plan (relu follows fc1 low) is predicted at 900 s a step and plan
    ``1f0`` (fc1 FP32, so relu runs FP32) at 800 s (each with the 300 s the profiles leave of FP32's step): a
    predicted win of 1/9 over AMP's."""
    a = _analysis("mlp")
    p = SearchPredictor(_predictor(a, fp32=list(fp32_profile), low=list(low_profile), alpha=0.0, beta=0.0))
    p.observe(Stage.STAGE1, _fp32(a), ACCEPTED, 9000.0, 9, batch_seconds=[1000.0] * 9)
    amp, win = Assignment.parse("0f0"), Assignment.parse("1f0")
    assert (p.step_seconds(amp), p.step_seconds(win)) == (pytest.approx(900.0), pytest.approx(800.0))
    p.observe(Stage.STAGE1, amp, ACCEPTED, 8100.0, 9, batch_seconds=[900.0] * 9)
    assert p.scale == 1.0
    return p, amp, win


_NOISE = (0.98, 0.99, 0.99, 1.0, 1.0, 1.0, 1.01, 1.01, 1.02)


def test_a_sample_measured_as_predicted_leaves_the_predictions_as_they_are():
    p, amp, win = _after_amp()
    extra = p.observe(Stage.STAGE1, win, ACCEPTED, 7200.0, 9, batch_seconds=[800.0 * n for n in _NOISE])
    assert p.scale == 1.0 and EVIDENCE_SCALE not in extra and p.step_seconds(win) == pytest.approx(800.0)


def test_samples_that_do_not_show_a_predicted_win_scale_the_predictions_down_as_far_as_they_demand():
    p, amp, win = _after_amp()
    version = p.version
    # measured as fast as AMP's batch for batch (within 2%): the predicted 1/9 win does not show
    extra = p.observe(Stage.STAGE1, win, ACCEPTED, 8100.0, 9, batch_seconds=[900.0 * n for n in _NOISE])
    assert extra[PREDICTED_STEP] == pytest.approx(800.0)  # the record keeps the prediction the search went by
    evidence = extra[EVIDENCE_SCALE]
    assert evidence["scale_before"] == 1.0 and evidence["measured_over_predicted"][0] > 1.0
    assert 0.0 <= p.scale < 0.2 and p.version > version  # the stages price again
    assert p._evidence_interval("sample", p.scale)[0] <= 1.0  # the least scale the evidence demands, not less
    ratio = p.step_seconds(win) / p.step_seconds(amp)
    assert ratio > 0.97  # at the new scale, the plan no longer beats AMP's by a 3% margin


def test_a_duel_that_shows_part_of_a_predicted_win_keeps_that_part():
    p, amp, win = _after_amp()
    # the duel: the candidate at 0.95 x the incumbent, where 0.889 was predicted
    extra = p.observe_duel(amp, win, [900.0] * 9, [900.0 * 0.95 * n for n in _NOISE])
    assert 0.3 < p.scale < 0.8 and extra[EVIDENCE_SCALE]["scale"] == p.scale
    assert p.step_seconds(win) / p.step_seconds(amp) == pytest.approx(0.95, abs=0.015)


def test_measurements_faster_than_predicted_never_raise_the_scale():
    p, amp, win = _after_amp()
    assert p.observe_duel(amp, win, [900.0] * 9, [900.0 * 0.5 * n for n in _NOISE]) == {}
    assert p.scale == 1.0


def test_a_plan_predicted_slower_than_its_reference_is_no_evidence_on_a_win():
    p, amp, _ = _after_amp()
    slower = Assignment.parse("0f1")  # fc2 FP32: predicted 1100 s, slower than AMP's 900
    p.step_seconds(slower)
    p.observe(Stage.STAGE1, slower, ACCEPTED, 13500.0, 9, batch_seconds=[1500.0 * n for n in _NOISE])
    assert p.scale == 1.0


def test_an_unpriced_sample_is_not_priced_for_its_evidence():
    p, amp, _ = _after_amp()
    unpriced = Assignment.parse("010")
    p.annotate_all = False
    assert p.observe(Stage.STAGE1, unpriced, ACCEPTED, 9000.0, 9, batch_seconds=[1000.0] * 9) == {}
    assert unpriced not in p._steps and p.scale == 1.0


def test_duels_are_weighed_apart_from_samples_which_a_drifting_machine_moves():
    p, amp, win = _after_amp()
    # AMP's epoch ran in a slow phase: the sample looks far faster than predicted against it...
    p.observe(Stage.STAGE1, win, ACCEPTED, 5400.0, 9, batch_seconds=[600.0 * n for n in _NOISE])
    assert p.scale == 1.0
    # ...and the duel, both plans taking turns, shows no win at all: its evidence alone decides
    extra = p.observe_duel(amp, win, [900.0] * 9, [900.0 * n for n in _NOISE])
    assert extra[EVIDENCE_SCALE]["kind"] == "duel" and p.scale < 0.2
