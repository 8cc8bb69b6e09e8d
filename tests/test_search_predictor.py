"""The cost model inside the search: skipping, stopping, exactness when off, the profile cache, the report."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn as nn

import compfx.search.driver
from compfx import SearchConfig, optimize
from compfx.costmodel.predictor import STALE_PROFILE_RATIO, STALE_PROFILES
from compfx.errors import BadInputError
from compfx.measure import Conditions
from compfx.search import DecisionRule, FunctionEvaluator, SearchSpace, run_stage1, skip_message
from compfx.costmodel.predictor import MEASURED_STEP, PREDICTED_STEP
from compfx.report import prediction_table
from compfx.search.log import NOTHING_CAN_WIN, SampleRecord, SearchLog
from compfx.vocabulary import SampleStatus, Stage
from tests.helpers import ce

# Cached profiles are trusted only under the conditions they were taken in (a reference kernel timed
# alike); at two threads on a shared 2-core machine that kernel swings 100x, one thread keeps it steady.
pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

FAST = dict(progress=False, warmup=0, repeats=1, stage2_check_batches=0)
SKIP = re.compile(r"skipped \(predicted \S+ s vs best \S+ s\)")


def space(k: int = 2) -> SearchSpace:
    return SearchSpace(("whitelist",) * k, (False,) * k, tuple(range(k)))


def epochs(seconds_of, calls) -> FunctionEvaluator:
    """Fake two-batch epochs of ``seconds_of(plan string)`` seconds; each plan run is appended to ``calls``."""
    def run_epoch(plan):
        calls.append(str(plan))
        for _ in range(2):
            yield 1.0, seconds_of(str(plan)) / 2
    return FunctionEvaluator(run_epoch=run_epoch)


def by_code(table):
    """``table[plan string]`` as a function of the plan: a fake prediction."""
    return lambda plan: table[str(plan)]


@pytest.mark.parametrize("predicted", [{"11": 2.0, "00": 0.9, "01": 0.5, "10": 0.7},
                                       {"11": 2.0, "00": 0.9, "01": 0.8, "10": 0.4}])
def test_candidates_run_in_a_fixed_order_whatever_the_predictions(predicted):
    # measured times equal: nothing gets pruned or skipped, and noisy predictions must not reorder near-ties
    calls = []
    run_stage1(space(), epochs(lambda code: 1.0, calls), prune=False, predict=by_code(predicted), margin=math.inf)
    assert calls == ["11", "00", "01", "10"]  # FP32 baseline, AMP's plan (the first incumbent), then most-low first


def test_plan_the_profiles_show_cannot_win_is_skipped_and_logged():
    measured = {"11": 1.0, "00": 0.9, "01": 0.5, "10": 0.6}
    predicted = {"00": 0.9, "01": 1.2, "10": 0.6}  # "01" predicted over AMP's predicted 0.9: it cannot win; "10" can
    calls, records = [], []
    result = run_stage1(space(), epochs(measured.__getitem__, calls), predict=by_code(predicted),
                        report=records.append, rule=DecisionRule(margin=0.03, rounds=0))
    skipped = [r for r in records if r.status == "skipped"]
    assert [r.plan for r in skipped] == ["01"] and calls == ["11", "00", "10"]
    assert skipped[0].reason == "skipped: cannot beat the incumbent by more than 3% on the profiles (predicted 1.2 s, " \
                                "bar 0.873 s)"
    assert skipped[0].extra == {"predicted_cost": 1.2, "cannot_win": pytest.approx(0.873)}
    assert str(result.best.plan) == "10"  # the measured winner; a skipped plan never wins


def test_plan_predicted_over_the_margin_of_the_measured_best_is_skipped_when_the_incumbent_cannot_be_priced():
    measured = {"11": 1.0, "00": 0.4, "01": 0.5, "10": 0.45}
    predicted = {"00": math.nan, "01": 0.7, "10": 0.45}  # 0.7 > 1.25 * 0.4 (AMP's measured cost)
    calls, records = [], []
    run_stage1(space(), epochs(measured.__getitem__, calls), predict=by_code(predicted), report=records.append)
    skipped = [r for r in records if r.status == "skipped"]
    assert [r.plan for r in skipped] == ["01"] and calls == ["11", "00", "10"]
    assert skipped[0].reason == "skipped (predicted 0.7 s vs best 0.4 s)" == skip_message(0.7, 0.4)
    assert all(SKIP.fullmatch(r.reason) for r in skipped)


def test_plan_the_profiles_show_can_win_is_sampled_though_predicted_over_the_incumbents_measured_cost():
    # the profiles' seconds run 40% over the epochs' (another phase, no duel yet to scale them): "01", predicted
    # 5% under the incumbent's predicted cost, is 1.3x AMP's measured cost. Like for like it can win, so it runs
    measured = {"11": 1.0, "00": 0.5, "01": 0.45, "10": 0.6}
    predicted = {"00": 0.7, "01": 0.665, "10": 0.9}
    calls, records = [], []
    result = run_stage1(space(), epochs(measured.__getitem__, calls), predict=by_code(predicted),
                        report=records.append, rule=DecisionRule(margin=0.03, rounds=0))
    assert calls == ["11", "00", "01"] and str(result.best.plan) == "01"  # "10" (0.9 predicted) cannot win
    assert not any(r.plan == "01" and r.status == "skipped" for r in records)


def test_stage1_stops_when_the_bounds_show_nothing_left_can_win():
    measured = {"11": 1.0, "00": 0.5, "01": 0.45, "10": 0.45}
    bound = {"00": 0.5, "01": 0.49, "10": 0.6}  # at 3% margin the bar is 0.485: neither bound is below it
    calls, records = [], []
    result = run_stage1(space(), epochs(measured.__getitem__, calls), predict=by_code(bound), bound=by_code(bound),
                        report=records.append, rule=DecisionRule(margin=0.03, rounds=0))
    assert calls == ["11", "00"] and str(result.best.plan) == "00"
    [stop] = [r for r in records if NOTHING_CAN_WIN in r.extra]
    assert stop.extra[NOTHING_CAN_WIN] == 2 and "none of the 2 plans left" in stop.reason
    calls.clear()
    run_stage1(space(), epochs(measured.__getitem__, calls), predict=by_code(bound), bound=by_code(bound),
               rule=DecisionRule(margin=0.0, rounds=0))  # without the margin the bar is 0.5: "01" might win, and runs
    assert calls == ["11", "00", "01"]


def test_margin_infinity_and_no_predictor_choose_the_same_plan():
    measured = {"11": 1.0, "01": 0.6, "10": 0.8, "00": 0.5}
    wrong = {"11": 0.0, "01": 0.1, "10": 0.2, "00": 9.0}  # a bad prediction may reorder but must not change the winner
    exact = run_stage1(space(), epochs(measured.__getitem__, []))
    guided = run_stage1(space(), epochs(measured.__getitem__, []), predict=by_code(wrong), margin=math.inf)
    assert str(exact.best.plan) == str(guided.best.plan) == "00"


def test_unpriceable_plan_is_never_skipped_and_never_stops_the_search():
    predicted = {"11": 1.0, "00": 1.0, "01": math.nan, "10": 9.0}
    calls, records = [], []
    run_stage1(space(), epochs(lambda code: 1.0, calls), predict=by_code(predicted), margin=1.0, prune=False,
               report=records.append)
    assert calls == ["11", "00", "01"] and not any(r.status == "skipped" for r in records)
    stops = [r for r in records if NOTHING_CAN_WIN in r.extra]  # only once "10", priced, is all that is left
    assert [r.extra[NOTHING_CAN_WIN] for r in stops] == [1] and records.index(stops[0]) > len(records) - 3


def mlp_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    loader = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    return model, opt, loader


def fp32_ops(plan, seconds):
    """Deterministic cost: seconds barely matter, the count of FP32 ops decides."""
    return sum(p == "fp32" for p in plan.values()) + seconds * 1e-9


def search(_unused, **kw):
    model, opt, loader = mlp_setup()
    rule = DecisionRule(**{name: kw.pop(name) for name in ("margin", "confidence", "rounds") if name in kw})
    return optimize(model, loader, loss_fn=ce, optimizer=opt,
                    config=SearchConfig(cost_fn=fp32_ops, decision=rule, **FAST, **kw))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPFX_CACHE_DIR", str(tmp_path))
    # the machine's conditions, fixed: timed for real, a loaded machine makes them differ between two searches by
    # more than the staleness check's tolerance, and every cached profile is measured again (that check is tested
    # in test_costmodel.py with conditions made to differ)
    steady = lambda **kw: Conditions(reference_s=1e-3)  # noqa: E731
    monkeypatch.setattr("compfx.costmodel.profile.measure_conditions", steady)
    monkeypatch.setattr("compfx.costmodel.cast_cost.measure_conditions", steady)
    return tmp_path


def test_predictor_off_and_on_with_infinite_margin_choose_the_exact_plan(cache):
    off = search(None, predictor=False)
    inf = search(None, predictor=True, predictor_margin=math.inf)
    assert off.plan == inf.plan
    assert not any(r.status == "skipped" for r in off.log.samples() + inf.log.samples())
    assert not any("predicted_step_seconds" in r.extra for r in off.log.samples())
    assert any("predicted_step_seconds" in r.extra for r in inf.log.samples())


def test_second_search_reuses_the_profile_cache(cache, monkeypatch):
    # nor measured again against the FP32 step (whose timing the machine's load decides)
    monkeypatch.setattr("compfx.costmodel.predictor.STALE_PROFILE_RATIO", math.inf)
    first = search(None)
    files = sorted(p.name for p in (cache / "profiles").rglob("*") if p.is_file())
    second = search(None)
    stats = [next(r.extra for r in result.log.samples("stage1") if r.extra.get("calibration"))
             for result in (first, second)]
    assert stats[0]["profiles_measured"] > 0 and stats[1]["profiles_measured"] == 0
    assert stats[1]["profiles_reused"] == stats[0]["profiles_measured"]
    assert files and sorted(p.name for p in (cache / "profiles").rglob("*") if p.is_file()) == files


def test_profiles_cached_under_other_conditions_are_measured_again(cache):
    search(None)  # fills the cache
    entries = [path for path in (cache / "profiles").glob("*.json")
               if json.loads(path.read_text())["format"] == "compfx-op-profile"]
    stale = []
    for path in entries:  # as if profiled while another job hogged the cores: far slower than any step here
        data = json.loads(path.read_text())
        stale.append(data["seconds"] * 20 + 1.0)
        path.write_text(json.dumps({**data, "seconds": stale[-1]}))
    again = search(None)
    calibration = next(r.extra for r in again.log.samples("stage1") if r.extra.get("calibration"))
    assert calibration[STALE_PROFILES] > STALE_PROFILE_RATIO
    assert calibration["profiles_measured"] > 0 and calibration["profiles_reused"] == 0
    rewritten = [json.loads(path.read_text())["seconds"] for path in entries]
    # Every stale entry was overwritten by a new measurement. Not "< 1 ms": a loaded CI machine can time a slow op above it.
    assert all(new != old for new, old in zip(rewritten, stale, strict=True))
    assert "measured again" in again.report()
    third = search(None)  # fresh entries are trusted
    assert STALE_PROFILES not in next(r.extra for r in third.log.samples("stage1") if r.extra.get("calibration"))


def test_report_shows_predicted_against_measured(cache):
    text = search(None, predictor_margin=math.inf, margin=0.0, rounds=0).report()  # every candidate that may win runs
    assert "cost model " in text and "(FP32's and AMP's plans excluded: they calibrate it)" in text
    log = SearchLog()
    log.append(SampleRecord(Stage.STAGE1, "01", SampleStatus.PRUNED, extra={PREDICTED_STEP: 0.011, MEASURED_STEP: 0.01}))
    table = prediction_table(log)
    assert "predicted step" in table and "measured step" in table and "+10.0%" in table


@pytest.mark.parametrize("kw", [dict(predictor="maybe"), dict(predictor=1), dict(predictor_margin=0.9),
                                dict(predictor_margin="1.25")])
def test_config_refuses_bad_predictor_settings(kw):
    with pytest.raises(BadInputError, match="predictor"):
        SearchConfig(**kw)


@pytest.mark.parametrize("value", [-0.01, "0.05", True, math.nan])
def test_config_refuses_a_bad_early_stop(value):
    with pytest.raises(BadInputError, match="early_stop"):
        SearchConfig(early_stop=value)


def test_early_stop_is_part_of_the_guided_search_only(cache, monkeypatch):
    seen = []
    real = compfx.search.driver.run_stage1
    monkeypatch.setattr(compfx.search.driver, "run_stage1",
                        lambda *a, **kw: seen.append(kw["early_stop"]) or real(*a, **kw))
    search(None, predictor=True, early_stop=0.2)
    search(None, predictor=False, early_stop=0.2)
    assert seen == [0.2, None]


def test_lower_bound_skips_without_the_full_prediction():
    measured = {"11": 1.0, "00": 0.9, "01": 0.5, "10": 0.8}
    bound = {"00": 0.85, "01": 1.2, "10": 0.6}
    full = {"00": 0.9, "10": 0.7}  # "01" must never be priced in full: its bound is already over the bar
    calls, records = [], []
    run_stage1(space(), epochs(measured.__getitem__, calls), predict=by_code(full), bound=by_code(bound),
               report=records.append)
    assert calls == ["11", "00", "10"]  # "10" passes the bound
    skipped = [r for r in records if r.status == "skipped"]
    assert [r.plan for r in skipped] == ["01"] and "cannot beat the incumbent" in skipped[0].reason
    assert skipped[0].extra["predicted_cost_lower_bound"] == 1.2  # the figure logged is the bound's


def test_stage1_prices_again_when_the_predictor_scales_its_predictions_down():
    # the profiles predict AMP's plan 20% and "01" and "10" 10% slower than FP32: both candidates beat AMP's by more
    # than the margin. Measured, "01" is no faster than AMP's plan. Once it is recorded, the predictor (here: the
    # report hook) scales every predicted difference to nothing: no plan can beat AMP's any more.
    measured = {"11": 1.2, "00": 1.1, "01": 1.1, "10": 1.1}
    raw = {"00": 1.2, "01": 1.1, "10": 1.1}
    scale, version = [1.0], [0]

    def predict(plan):
        return 1.0 + scale[0] * (raw[str(plan)] - 1.0)

    def learn(record):
        if record.plan == "01" and record.is_sample:
            scale[0], version[0] = 0.0, version[0] + 1

    for price_version, expected in ((lambda: version[0], ["11", "00", "01"]), (None, ["11", "00", "01", "10"])):
        scale[0], calls = 1.0, []
        run_stage1(space(), epochs(measured.__getitem__, calls), predict=predict, report=learn,
                   rule=DecisionRule(margin=0.03, rounds=0), price_version=price_version)
        # with the version, AMP's predicted cost is priced again at the new scale and "10" cannot beat it; without,
        # the stale price of AMP's plan (made before "01" ran) still leaves room for a win, and "10" runs
        assert calls == expected


def test_the_recorder_hands_each_duel_to_the_predictor_and_logs_what_it_changed():
    from compfx.search.compare import Comparison, DecisionRule as Rule, log_duel
    from compfx.search.driver import Recorder

    class Predictor:
        seen = []

        def observe_duel(self, incumbent, candidate, incumbent_seconds, candidate_seconds):
            self.seen.append((str(incumbent), str(candidate), list(incumbent_seconds), list(candidate_seconds)))
            return {"evidence_scale": {"scale": 0.5}}

    log = SearchLog()
    verdict = Rule(margin=0.03, rounds=3).verdict(Comparison.of([1.0, 1.0, 1.0], [0.99, 1.0, 1.01]), saves_less=False)
    verdict = type(verdict)(**{**verdict.__dict__, "seconds": ((1.0, 1.0, 1.0), (0.99, 1.0, 1.01))})
    log_duel(Recorder(log, predictor=Predictor()), Stage.STAGE1, verdict, "00", "01", 3)
    assert Predictor.seen == [("00", "01", [1.0, 1.0, 1.0], [0.99, 1.0, 1.01])]
    [record] = log.notes()
    assert record.extra["evidence_scale"] == {"scale": 0.5} and "duel" in record.extra


def test_the_report_says_how_far_evidence_scaled_the_predictions():
    from compfx.search.report import _evidence_scaling

    log = SearchLog()
    log.append(SampleRecord(Stage.STAGE1, "01", SampleStatus.ACCEPTED, seconds=1.0, batches=2))
    assert _evidence_scaling(log) == ""
    for scale in (0.8, 0.45):
        log.append(SampleRecord(Stage.STAGE1, "", SampleStatus.NOTE, reason="duel",
                                extra={"evidence_scale": {"scale": scale}}))
    assert "in 2 of the samples and duels, scaled the predicted differences down to 45%" in _evidence_scaling(log)


def test_stage2_prices_again_when_the_predictor_scales_its_predictions_down():
    from compfx.plan import Assignment
    from compfx.search.outcome import Outcome
    from compfx.search.stage2 import _Stage2

    scale, version = [1.0], [0]
    raw = {"0f1": 1.2, "001": 1.1}

    def predict(plan):
        return 1.0 + scale[0] * (raw[str(plan)] - 1.0)

    stage = _Stage2(FunctionEvaluator(time_step=lambda plan: 1.0), None, DecisionRule(margin=0.03, rounds=0),
                    bound=predict, predict=predict, price_version=lambda: version[0])
    incumbent = Outcome(Assignment.parse("0f1"), SampleStatus.ACCEPTED)
    assert stage.predicted_cost(incumbent, Assignment.parse("001")) == pytest.approx(1.1)
    assert not stage.cannot_win(incumbent, Assignment.parse("001"))
    scale[0], version[0] = 0.0, 1  # the evidence scaled the predicted differences to nothing
    assert stage.predicted_cost(incumbent, Assignment.parse("001")) == pytest.approx(1.0)
    assert stage.cannot_win(incumbent, Assignment.parse("001"))
