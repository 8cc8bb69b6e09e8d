"""The decision rule (compfx.search.compare): near ties resolve the same way whatever the noise, a clear win wins.

Every timing here comes from an injected noisy timer (no wall clock): the fake
epochs and steps are a plan's true time times a noise factor the test controls.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compfx import SearchConfig
from compfx.errors import BadInputError, SearchError
from compfx.plan import Assignment
from compfx.search import (Comparison, DecisionRule, FunctionEvaluator, SearchSpace, median_interval, run_search,
                           run_stage1, run_stage2, speedup_text)
from compfx.search.log import DUEL, NOTHING_CAN_WIN, SearchLog
from compfx.search.stage1 import EARLY_STOP_MIN_BATCHES
from compfx.vocabulary import Category

W, B, O = Category.WHITELIST, Category.BLACKLIST, Category.OTHER
#: three adjustable ops (two whitelist without Tensor Cores, one blacklist) and "other" ops between them
SPACE = SearchSpace((W, O, B, O, W, O), (False,) * 6, tuple(range(6)))
AMP = str(SPACE.amp_plan)  # "0f1f0f": what the user would otherwise run, the first incumbent
BATCHES = 6


class NoisyDevice:
    """A fake device: ``true(plan string)`` seconds per step, times noise drawn from ``noise(rng)`` at every call.

    It serves Stage-1 epochs (``BATCHES`` steps, constant loss), Stage-2 timings and the duels' interleaved
    steps, and counts the duels' steps.
    """

    def __init__(self, true, noise, seed: int, saved_bytes=None):
        self.true, self.noise, self.rng = true, noise, random.Random(seed)
        self.saved = saved_bytes or (lambda plan: None)

    def step(self, plan) -> float:
        return self.true(str(plan)) * self.noise(self.rng)

    def run_epoch(self, plan):
        for _ in range(BATCHES):
            yield 1.0, self.step(plan)

    def evaluator(self, turns: bool = False) -> FunctionEvaluator:
        """``turns``: it also runs epochs taking turns (each plan's a generator of its own, advanced by the search
        in turns, the noise drawn in that order)."""
        in_turns = (lambda plans: [self.run_epoch(plan) for plan in plans]) if turns else None
        return FunctionEvaluator(run_epoch=self.run_epoch, time_step=self.step, check_loss=lambda plan, n: 1.0,
                                 saved_bytes=self.saved, run_epochs_taking_turns=in_turns)


def uniform(spread: float):
    return lambda rng: 1.0 + rng.uniform(-spread, spread)


def heavy_tailed(rng) -> float:
    """5% jitter, and one step in ten hit by another job: twice as long."""
    return (1.0 + rng.uniform(-0.05, 0.05)) * (2.0 if rng.random() < 0.1 else 1.0)


def near_tie(code: str) -> float:
    """Every plan within 1% of every other: low precision neither pays nor costs here."""
    return 1.0 + 0.002 * (sum(c == "0" for c in code) % 5)


def search(device: NoisyDevice, turns: bool = False, **config):
    rule = DecisionRule(**{name: config.pop(name) for name in ("margin", "confidence", "rounds") if name in config})
    settings_ = dict(progress=False, stage2_check_batches=0, predictor=False, decision=rule, **config)
    return run_search(SPACE, device.evaluator(turns), SearchConfig(**settings_))


def stage1_logged(space, evaluator, rule=DecisionRule(margin=0.03, rounds=7), **kwargs):
    """Stage 1 of ``space`` under the 3% rule (7 pairs), its records kept: (the result, the log)."""
    log = SearchLog()
    return run_stage1(space, evaluator, rule=rule, report=log.append, **kwargs), log


# -- the statistics -------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=40), confidence=st.sampled_from([0.5, 0.9, 0.95]))
def test_the_median_interval_brackets_the_median_at_its_stated_coverage(values, confidence):
    low, high, coverage = median_interval(values, confidence)
    ordered = sorted(values)
    median = (ordered[(len(values) - 1) // 2] + ordered[len(values) // 2]) / 2
    assert low <= median <= high and low in values and high in values
    if 1 - 2 / 2 ** len(values) >= confidence:  # enough values to reach the confidence asked for
        assert coverage >= confidence


def test_the_median_interval_covers_the_median_as_often_as_it_says():
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        sample = [rng.gauss(0.0, 1.0) for _ in range(15)]
        low, high, coverage = median_interval(sample, 0.9)
        hits += low <= 0.0 <= high
    assert coverage >= 0.9 and hits / 2000 >= 0.9 - 0.02


def test_the_report_says_no_measurable_difference_unless_the_interval_excludes_one():
    assert speedup_text(Comparison.of([1.3, 1.24, 1.19, 1.27, 1.22, 1.25, 1.3], [1.0] * 7), 0.95) == \
        "speed-up 1.25x (1.19-1.30)"
    assert speedup_text(Comparison.of([1.03, 0.99, 1.01, 0.98, 1.02, 1.0, 1.0], [1.0] * 7), 0.95) == \
        "no measurable difference (±3%)"


@pytest.mark.parametrize("kw, match", [(dict(margin=-0.1), "margin"), (dict(margin=1.0), "margin"),
                                       (dict(confidence=1.0), "confidence"), (dict(rounds=-1), "rounds"),
                                       (dict(rounds=3), "rounds=3 pairs cannot give 95% confidence"),
                                       (dict(margin="0.03"), "margin")])
def test_config_refuses_a_bad_rule(kw, match):
    with pytest.raises(BadInputError, match=match):
        SearchConfig(decision=DecisionRule(**kw))


# -- near ties: the same plan whatever the noise -----------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(noise=st.lists(st.floats(-0.01, 0.01), min_size=1, max_size=64))
def test_near_ties_resolve_to_the_first_incumbent_whatever_the_noise(noise):
    # any noise sequence up to ±1% (hypothesis picks it, adversarially if it can): with plans within 1% of each
    # other, no ratio can get below 0.97, so no candidate can replace AMP's plan -- in any run
    sequence = iter(noise * (10_000 // len(noise) + 1))
    device = NoisyDevice(near_tie, lambda rng: 1.0 + next(sequence), seed=0)
    assert str(search(device).plan) == AMP


@pytest.mark.parametrize("turns", [False, True], ids=["epochs alone", "epochs taking turns"])
@pytest.mark.parametrize("noise", [uniform(0.05), heavy_tailed], ids=["uniform 5%", "heavy-tailed"])
def test_near_ties_resolve_to_the_same_plan_in_every_run_of_a_noisy_machine(noise, turns):
    plans = {str(search(NoisyDevice(near_tie, noise, seed), turns).plan) for seed in range(25)}
    assert plans == {AMP}


def test_without_the_rule_noise_decides_between_near_ties():
    # the same machine with CoMP's own rule (the cheaper plan wins): what the rule above prevents
    plans = {str(search(NoisyDevice(near_tie, uniform(0.05), seed), margin=0.0, rounds=0).plan) for seed in range(25)}
    assert len(plans) > 3


# -- a clear win wins ------------------------------------------------------------------------------------

FASTER = "1f0f0f"  # the blacklist op low, the first whitelist op FP32


def clear_win(code: str) -> float:
    return 0.8 if code.startswith("1f0f0") else 1.0  # 20% faster than anything else, Stage-2 variants alike


@settings(max_examples=20, deadline=None)
@given(noise=st.lists(st.floats(-0.05, 0.05), min_size=1, max_size=64))
def test_a_candidate_faster_by_more_than_the_margin_and_the_noise_wins(noise):
    sequence = iter(noise * (10_000 // len(noise) + 1))
    device = NoisyDevice(clear_win, lambda rng: 1.0 + next(sequence), seed=0)
    result = search(device)
    assert str(result.stage1.best.plan) == FASTER and str(result.plan).startswith("1f0f0")


def test_a_clear_win_wins_in_every_run_of_a_noisy_machine():
    # (under heavy-tailed noise a Stage-1 epoch alone hit by bursts can cost more than the bar and be pruned: the
    # epoch's sum is what pruning needs, and it is not robust; then the incumbent stays, which is a tie's outcome)
    assert {str(search(NoisyDevice(clear_win, uniform(0.05), seed)).stage1.best.plan) for seed in range(15)} == {FASTER}


def test_a_clear_win_taking_turns_wins_in_every_run_even_under_heavy_tailed_noise():
    # taking turns with the incumbent's epoch, a candidate is judged on the pairs' median: a burst moves it by a rank
    plans = {str(search(NoisyDevice(clear_win, heavy_tailed, seed), turns=True).stage1.best.plan) for seed in range(15)}
    assert plans == {FASTER}


def test_a_candidate_faster_by_less_than_the_margin_does_not_win():
    slightly = lambda code: 0.98 if code == FASTER else 1.0  # noqa: E731 - 2% faster: below the 3% margin
    assert str(search(NoisyDevice(slightly, uniform(0.0), 0)).plan) == AMP
    assert str(search(NoisyDevice(slightly, uniform(0.0), 0), margin=0.01).stage1.best.plan) == FASTER


def test_fp32_replaces_amp_only_when_faster_by_the_margin():
    fp32_fast = lambda code: 0.5 if code == "111111" else 1.0  # noqa: E731 - low precision slow (an AVX2 CPU)
    assert str(search(NoisyDevice(fp32_fast, uniform(0.02), 0)).plan) == "111111"
    fp32_tie = lambda code: 0.99 if code == "111111" else 1.0  # noqa: E731
    assert str(search(NoisyDevice(fp32_tie, uniform(0.0), 0)).plan) == AMP


def test_every_duel_is_logged_with_its_rounds():
    log = SearchLog()
    evaluator = NoisyDevice(clear_win, uniform(0.02), 3).evaluator()
    run_search(SPACE, evaluator, SearchConfig(progress=False, stage2_check_batches=0, predictor=False),
               report=log.append)
    duels = [r.extra[DUEL] for r in log.notes() if DUEL in r.extra]
    assert duels and any(d["replaces"] for d in duels)
    for d in duels:
        assert len(d["seconds"][0]) == len(d["seconds"][1]) == len(d["candidate_costs"]) and len(d["seconds"][0]) % 7 == 0
        low, high = d["interval"]
        assert d["replaces"] == (high < d["bar"] and not d.get("too_noisy")) and low <= d["median_ratio"] <= high


# -- memory --------------------------------------------------------------------------------------------

def test_between_plans_within_the_margin_the_one_that_saves_less_wins():
    tie = lambda code: 1.0  # noqa: E731
    less = lambda plan: 50 if str(plan) == FASTER else 100  # noqa: E731
    more = lambda plan: 150 if str(plan) == FASTER else 100  # noqa: E731
    assert str(search(NoisyDevice(tie, uniform(0.01), 0, saved_bytes=less)).stage1.best.plan) == FASTER
    assert str(search(NoisyDevice(tie, uniform(0.01), 0, saved_bytes=more)).plan) == AMP


def test_a_memory_budget_rejects_plans_over_it_before_they_run():
    started = []
    device = NoisyDevice(lambda code: 0.5 if code == FASTER else 1.0, uniform(0.0), 0,
                         saved_bytes=lambda plan: 200 if str(plan) == FASTER else 100)
    evaluator = device.evaluator()
    evaluator.run_epoch = lambda plan: started.append(str(plan)) or device.run_epoch(plan)
    result, log = stage1_logged(SPACE, evaluator, memory_budget=150)
    assert str(result.best.plan) == AMP and FASTER not in started
    [over] = [r for r in log.samples() if r.plan == FASTER]
    assert over.status == "rejected" and "over memory_budget=150" in over.reason and over.extra["saved_bytes"] == 200


def test_no_plan_within_the_memory_budget_is_a_search_error():
    device = NoisyDevice(lambda code: 1.0, uniform(0.0), 0, saved_bytes=lambda plan: 100)
    with pytest.raises(SearchError, match="no plan fits memory_budget=50"):
        run_stage1(SPACE, device.evaluator(), memory_budget=50)


# -- pruning stays exact against the rule --------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), margin=st.sampled_from([0.0, 0.03, 0.2]), rounds=st.sampled_from([0, 7]),
       memory=st.booleans(), turns=st.booleans())
def test_pruning_picks_the_plan_the_unpruned_search_picks_under_the_rule(seed, margin, rounds, memory, turns):
    # taking turns, a candidate's epoch is pruned at a block of pairs whose median is at or over the bar: the
    # unpruned search runs it to its end, and its duel looks at the same block first, so it keeps the incumbent too
    rng = random.Random(seed)
    per_batch = {}
    batches = 2 * 7 + 1 if turns else BATCHES  # with turns: two blocks of pairs after the warm-up pair

    def table(code):  # a fixed random epoch per plan (a pace, and its batches within 20% of it); its step times
        if code not in per_batch:  # are its batches' median (no noise)
            pace = rng.uniform(0.5, 2.0)
            per_batch[code] = [pace * rng.uniform(0.8, 1.2) for _ in range(batches)]
        return per_batch[code]

    def run_epoch(plan):
        for s in table(str(plan)):
            yield 1.0, s

    sizes = {}

    def saved_bytes(plan):
        return sizes.setdefault(str(plan), rng.randint(1, 4)) if memory else None

    def evaluator():
        in_turns = (lambda plans: [run_epoch(plan) for plan in plans]) if turns else None
        return FunctionEvaluator(run_epoch=run_epoch, time_step=lambda plan: sorted(table(str(plan)))[batches // 2],
                                 saved_bytes=saved_bytes, run_epochs_taking_turns=in_turns)

    rule = DecisionRule(margin=margin, rounds=rounds)
    pruned = run_stage1(SPACE, evaluator(), rule=rule)
    full = run_stage1(SPACE, evaluator(), rule=rule, prune=False)
    assert pruned.best.plan == full.best.plan and pruned.best.cost == full.best.cost
    assert sum(s.batches for s in pruned.samples) <= sum(s.batches for s in full.samples) + batches


# -- stopping when nothing can win -------------------------------------------------------------------------

def test_stage2_is_not_timed_when_the_profiles_show_nothing_can_win():
    timed, log = [], SearchLog()
    base = Assignment.parse("0f1f0f")
    evaluator = FunctionEvaluator(time_step=lambda plan: timed.append(str(plan)) or 1.0)
    result = run_stage2(SPACE, base, evaluator, rule=DecisionRule(margin=0.03, rounds=0), report=log.append,
                        bound=lambda plan: 0.99, predict=lambda plan: 1.0)  # every plan within 1% of the winner
    assert timed == [] and result.best.plan == base and result.samples == []  # not even the winner is timed
    [stop] = [r for r in log.notes() if NOTHING_CAN_WIN in r.extra]
    assert stop.stage == "stage2" and "Stage 2 not timed" in stop.reason
    timed.clear()  # bounds under the bar, but every prediction within the margin: priced in full, nothing timed
    run_stage2(SPACE, base, evaluator, rule=DecisionRule(margin=0.03, rounds=0), bound=lambda plan: 0.5,
               predict=lambda plan: 1.0)
    assert timed == []
    run_stage2(SPACE, base, evaluator, rule=DecisionRule(margin=0.03, rounds=0), bound=lambda plan: 0.5,
               predict=lambda plan: 1.0 if plan == base else 0.9)
    assert len(timed) > 1  # a plan predicted to win is timed


# -- why each op got its precision ------------------------------------------------------------------

def _evidence_search():
    """A search whose log holds each kind of evidence: a loss rejection, a pruned plan, a win, a Stage-2 choice."""
    from compfx.search import Recorder, Replay, ReplayingEvaluator

    def true(code):  # op 0 low saves 0.2 per step; op 2 low saves 0.3 but breaks the loss; the others are free
        return 1.0 - (0.2 if code[0] == "0" else 0.0) - (0.3 if code[2] == "0" else 0.0)

    def run_epoch(plan):
        code = str(plan)
        for _ in range(BATCHES):
            yield (1.5 if code[2] == "0" else 1.0), true(code)

    log = SearchLog.open(None, {"fingerprint": "x", **{"threshold": 1.01, "margin": 0.03}})
    replay = Replay()
    evaluator = ReplayingEvaluator(FunctionEvaluator(run_epoch=run_epoch, time_step=lambda plan: true(str(plan)),
                                                     check_loss=lambda plan, n: 1.0), replay)
    decision = run_search(SPACE, evaluator, SearchConfig(progress=False, stage2_check_batches=0, predictor=False),
                          report=Recorder(log, replay=replay))
    return log, decision


class _Op:
    def __init__(self, category):
        self.category, self.tc_eligible = category, False


def test_each_reason_in_the_evidence_column_matches_the_log():
    import re

    from compfx.search.evidence import batch_seconds, op_evidence

    log, decision = _evidence_search()
    analysis = type("A", (), {"ops": [_Op(c) for c in SPACE.categories]})()
    chosen, stage1 = str(decision.plan), str(decision.stage1.best.plan)
    reasons = op_evidence(analysis, log, chosen, stage1, loss0=1.0)
    samples = log.samples()
    names = {"low": "0", "fp32": "1", "follow": "f"}
    assert chosen == "0f1f0f" or chosen.startswith("0f1"), chosen
    checked = set()
    for i, reason in enumerate(reasons):
        assert reason.split(":")[0] == {"0": "low", "1": "fp32", "f": "follow"}[chosen[i]], reason
        for match in re.finditer(r"sample (\d+)", reason):
            record = samples[int(match.group(1)) - 1]
            other = re.search(r"with (?:this op|it) (\w+)", reason)
            if other and record.stage == "stage1":
                assert record.plan[i] == names[other.group(1)] and record.plan[i] != chosen[i]
            loss = re.search(r"epoch loss (\S+) > limit (\S+) ", reason)
            if loss:
                assert loss.group(1) == f"{record.loss:.4g}" and loss.group(2) == f"{1.01:.4g}"
                checked.add("loss")
            faster = re.search(r"(\d+\.\d+) ms/step faster than with it", reason)
            if faster:
                winner = next(r for r in reversed(samples) if r.stage == "stage1" and r.plan == stage1)
                diffs = sorted(a - b for a, b in zip(batch_seconds(record), batch_seconds(winner)))
                assert faster.group(1) == f"{(diffs[(len(diffs) - 1) // 2] + diffs[len(diffs) // 2]) / 2 * 1e3:.2f}"
                checked.add("faster")
    assert reasons[2].startswith("fp32: with this op low, epoch loss 1.5 > limit 1.01 (")  # the guard's evidence
    assert "not adjustable (other)" in reasons[1] or "Stage 2" in reasons[1]
    assert {"loss", "faster"} <= checked, reasons


def test_the_evidence_reads_a_candidates_difference_off_its_pairs_with_the_incumbent():
    # op 0 low saves 0.2 s per step. The candidates' epochs took turns with AMP's during a burst (every step 2x):
    # op 0 FP32 ran 2.0 s against AMP's 1.6 s beside it, 0.4 s slower; against AMP's own epoch (0.8 s, before
    # the burst) it would read 1.2 s
    from compfx.search.evidence import op_evidence

    def true(code):
        return 1.0 - (0.2 if code[0] == "0" else 0.0)

    def epoch(plan, slow=1.0):
        for _ in range(BATCHES):
            yield 1.0, true(str(plan)) * slow

    def in_turns(plans):
        slow = 1.0 if "111111" in map(str, plans) else 2.0  # FP32's and AMP's first epochs come before the burst
        return [epoch(plan, slow) for plan in plans]

    from compfx.search import Recorder, Replay, ReplayingEvaluator

    log, replay = SearchLog.open(None, {"fingerprint": "x", "threshold": 1.01, "margin": 0.03}), Replay()
    evaluator = ReplayingEvaluator(FunctionEvaluator(run_epoch=epoch, time_step=lambda plan: true(str(plan)),
                                                     run_epochs_taking_turns=in_turns), replay)  # logs the batches
    result = run_stage1(SPACE, evaluator, rule=DecisionRule(margin=0.03, rounds=7),
                        report=Recorder(log, replay=replay))
    assert str(result.best.plan) == AMP
    analysis = type("A", (), {"ops": [_Op(c) for c in SPACE.categories]})()
    reasons = op_evidence(analysis, log, AMP, AMP, loss0=1.0)
    assert reasons[0].startswith("low: 400.00 ms/step faster than with it fp32"), reasons[0]
    cited = int(reasons[0].split("sample ")[1].rstrip(")"))
    assert "incumbent_again" not in log.samples()[cited - 1].extra  # it cites the candidate's own sample


# -- the report -----------------------------------------------------------------------------------------

def test_the_report_from_the_log_is_the_report_and_quotes_one_interleaved_comparison(tmp_path, one_thread):
    import torch

    import compfx
    from compfx.report import render_log_report
    from tests.helpers import batches, ce

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    loader = batches(4, (16, 8), classes=3)
    path = tmp_path / "search.jsonl"
    result = compfx.optimize(model, loader, loss_fn=ce, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             log=path, config=SearchConfig(progress=False, cache_plan=False))
    comparison = result.step_comparison
    assert set(comparison.seconds) == {"fp32", "amp", "chosen"}
    # one phase, every plan every round: 7 rounds, or Stage 1's FP32-vs-AMP duel: its epochs' pairs, taking turns,
    # and the blocks of 7 pairs after them while it was undecided
    from compfx.search.compare import IN_THE_FIRST_EPOCHS

    counts = {len(rounds) for rounds in comparison.seconds.values()}
    assert len(counts) == 1 and min(counts) >= 7
    assert comparison.phase == IN_THE_FIRST_EPOCHS or min(counts) % 7 == 0
    assert result.step_seconds == {name: comparison.median(name) for name in comparison.seconds}
    x = loader[0][0]
    assert comparison.saved_bytes["fp32"] == compfx.memory.saved_activation_bytes(
        compfx.apply(model, compfx.Plan.fp32(result.analysis), analysis=result.analysis), (x,))
    text = result.report()
    assert text == render_log_report(path)  # `compfx report LOG` prints the same report, numbers and evidence
    assert f"chosen vs FP32: {comparison.speedup('fp32')}" in text and "memory " in text and "fixed part" in text
    assert "why (sample N" in text


def test_the_first_incumbent_is_never_stopped_on_pace():
    # AMP's plan paces 10% over FP32's in its first batches, then catches up: early stopping (not exact) would drop
    # it after 3 batches, while FP32's plan is not faster by more than the margin over the whole epoch
    def run_epoch(plan):
        for i in range(BATCHES):
            yield 1.0, (1.1 if i < 3 else 0.9) if str(plan) == AMP else 1.0

    evaluator = FunctionEvaluator(run_epoch=run_epoch, time_step=lambda plan: 1.0)
    result = run_stage1(SPACE, evaluator, early_stop=0.05, rule=DecisionRule(margin=0.03, rounds=7))
    assert str(result.best.plan) == AMP


def _counting_epochs(amp_batch_seconds):
    """An evaluator whose AMP plan takes ``amp_batch_seconds`` per batch (FP32 and the rest 1.0), every step alike
    in a duel; it counts the batches each plan's epochs ran."""
    ran: dict[str, list[int]] = {}

    def run_epoch(plan):
        ran.setdefault(str(plan), []).append(0)
        for _ in range(BATCHES):
            ran[str(plan)][-1] += 1
            yield 1.0, amp_batch_seconds if str(plan) == AMP else 1.0

    return FunctionEvaluator(run_epoch=run_epoch, time_step=lambda plan: 1.0), ran


def test_amps_epoch_crossing_the_bar_late_runs_once_and_the_duel_keeps_it():
    # AMP's plan 4% slower batch for batch: its running cost passes FP32's bar (1.0 x 6 / 0.97) only in its last
    # batch, so the batches suggest FP32 is faster by the margin and a duel (equal steps) keeps AMP's plan. Stopped
    # there, its epoch would have to run again for its loss; in the last quarter of its epoch it is not stopped.
    evaluator, ran = _counting_epochs(1.04)
    result, log = stage1_logged(SPACE, evaluator)
    assert str(result.best.plan) == AMP
    assert ran[AMP] == [BATCHES]  # one epoch, in full
    assert any(DUEL in r.extra for r in log.notes())  # the same decision: judged on the batches, then the duel


def test_amps_epoch_crossing_the_bar_early_stops_there_and_fp32_wins():
    # AMP's plan 3x slower (an AVX2 CPU): it passes the bar in its third batch of six and stops there (as a plan
    # 1.5x slower stops in its seventh of ten: tests/test_search.py)
    evaluator, ran = _counting_epochs(3.0)
    result = run_stage1(SPACE, evaluator, rule=DecisionRule(margin=0.03, rounds=0))
    assert str(result.best.plan) == "111111"
    assert ran[AMP] == [3]


# -- FP32's and AMP's epochs taking turns ---------------------------------------------------------------

ONE_OP = SearchSpace((W,), (False,), ("mm",))  # one adjustable op: FP32's plan "1" and AMP's "0", nothing else


def _taking_turns(true, noise, seed: int, batches: int = BATCHES):
    """An evaluator that runs epochs in turns (each plan's a generator of its own, the caller advancing them in
    turns, the noise drawn in that order); it counts the steps timed outside the epochs, and each epoch's batches."""
    rng, counts = random.Random(seed), {"steps": 0, "batches": {}}

    def run_epoch(plan):
        counts["batches"][str(plan)] = 0
        for _ in range(batches):
            counts["batches"][str(plan)] += 1
            yield 1.0, true(str(plan)) * noise(rng)

    def time_step(plan):
        counts["steps"] += 1
        return true(str(plan)) * noise(rng)

    evaluator = FunctionEvaluator(run_epoch=run_epoch, time_step=time_step,
                                  run_epochs_taking_turns=lambda plans: [run_epoch(plan) for plan in plans])
    return evaluator, counts


@pytest.mark.parametrize("noise", [uniform(0.05), heavy_tailed], ids=["uniform", "heavy-tailed"])
def test_fp32s_and_amps_epochs_taking_turns_are_their_duel_and_a_near_tie_keeps_amp(noise):
    for seed in range(10):
        evaluator, counts = _taking_turns(lambda code: 1.0 if code == "0" else 0.99, noise, seed, batches=14)
        result, log = stage1_logged(ONE_OP, evaluator)
        assert str(result.best.plan) == "0" and result.first_epochs_in_turns
        assert counts["batches"] == {"1": 14, "0": 14}
        (duel,) = [r.extra[DUEL] for r in log.notes() if DUEL in r.extra]
        assert duel["epoch_pairs"] == 13 and not duel["replaces"]  # the first pair is the duel's warm-up
        # steps besides the epochs only in blocks of 7 pairs, where the epochs' pairs left the duel undecided
        assert counts["steps"] == 2 * (len(duel["seconds"][0]) - 13) and counts["steps"] % 14 == 0
        assert [r.plan for r in log.samples()] == ["1", "0"]  # FP32's record first: loss_0


def test_fp32s_plan_faster_by_the_margin_on_the_pairs_wins_and_amps_epoch_stops_after_a_block():
    evaluator, counts = _taking_turns(lambda code: 1.0 if code == "0" else 0.8, uniform(0.02), 0, batches=16)
    result, log = stage1_logged(ONE_OP, evaluator)
    assert str(result.best.plan) == "1"
    assert counts["batches"] == {"1": 16, "0": 8}  # AMP's epoch stopped once a block of pairs (after one) decided
    amp = next(r for r in log.samples() if r.plan == "0")
    assert amp.status == "pruned" and "faster by more than the margin" in amp.reason
    (duel,) = [r.extra[DUEL] for r in log.notes() if DUEL in r.extra]
    assert duel["replaces"] and len(duel["seconds"][0]) == 7


def _bursty(true, burst: float, batches: int):
    """An evaluator whose every step runs ``burst`` x slower while FASTER's epoch runs (another job's burst): alone,
    or taking turns with another plan's. Counts the duel's steps."""
    duel_steps = []

    def epoch(plan, slow):
        for _ in range(batches):
            yield 1.0, true(str(plan)) * slow

    def in_turns(plans):
        slow = burst if FASTER in map(str, plans) else 1.0
        return [epoch(plan, slow) for plan in plans]

    return FunctionEvaluator(run_epoch=lambda plan: epoch(plan, burst if str(plan) == FASTER else 1.0),
                             time_step=lambda plan: duel_steps.append(plan) or true(str(plan)),
                             run_epochs_taking_turns=in_turns), duel_steps


def test_a_burst_during_a_candidates_epoch_taking_turns_slows_the_incumbents_steps_alike():
    # FASTER is truly 10% faster; another job slows every step by 30% while its epoch runs. Its epoch taking turns
    # with the incumbent's: every pair sees the burst, their ratios are 0.9, and it wins on them without a duel
    true = lambda code: 0.9 if code == FASTER else 1.0  # noqa: E731
    evaluator, duel_steps = _bursty(true, burst=1.3, batches=8)
    result, log = stage1_logged(SPACE, evaluator)
    assert str(result.best.plan) == FASTER and not duel_steps
    (duel,) = [r.extra[DUEL] for r in log.notes() if DUEL in r.extra and r.extra[DUEL]["candidate"] == FASTER]
    assert duel["replaces"] and duel["epoch_pairs"] == 7
    again = [r for r in log.samples() if r.reason.startswith("the incumbent, its epoch again")]
    # the incumbent's epoch, once per candidate (AMP's, then FASTER's once it won), not budgeted
    assert again[0].plan == AMP and {r.plan for r in again} == {AMP, FASTER}
    # its epoch alone, compared with the incumbent's epoch from before the burst, costs 1.17x: pruned, AMP's kept
    alone = FunctionEvaluator(run_epoch=evaluator.run_epoch, time_step=evaluator.time_step)
    assert str(run_stage1(SPACE, alone, rule=DecisionRule(margin=0.03, rounds=7)).best.plan) == AMP


def test_a_near_tie_taking_turns_with_the_incumbent_is_stopped_on_its_pairs_without_a_duel():
    # FASTER 1% faster: its pairs' median ratio, 0.99, is not below the bar (0.97). After its first block of pairs
    # it stops, as the duel would keep the incumbent; no step is timed outside the epochs
    true = lambda code: 0.99 if code == FASTER else 1.0  # noqa: E731
    evaluator, duel_steps = _bursty(true, burst=1.0, batches=8)
    result, log = stage1_logged(SPACE, evaluator)
    assert str(result.best.plan) == AMP and not duel_steps
    (faster,) = [r for r in log.samples() if r.plan == FASTER]
    assert faster.status == "pruned" and "median over 7 pairs), not below 0.97: it cannot win" in faster.reason


def test_a_block_of_pairs_that_keeps_the_incumbent_decides_whether_the_candidates_epoch_is_pruned_or_not():
    # FASTER's first block of pairs has 4 ties with AMP's (ratio 1.0) and 3 twice as fast: median 1.0, so the duel's
    # first look keeps the incumbent. Pruned, its epoch stops there; unpruned, it runs to its end for its loss, and
    # the decision is the same. Its later pairs (all twice as fast) are not looked at: over all 21 the interval
    # would lie below the bar
    def epoch(plan):
        for i in range(22):
            yield 1.0, (1.0 if i <= 4 else 0.5) if str(plan) == FASTER else 1.0

    evaluator = lambda: FunctionEvaluator(  # noqa: E731
        run_epoch=epoch, time_step=lambda plan: 0.5 if str(plan) == FASTER else 1.0,
        run_epochs_taking_turns=lambda plans: [epoch(plan) for plan in plans])
    rule = DecisionRule(margin=0.03, rounds=7)
    for prune in (True, False):
        result, log = stage1_logged(SPACE, evaluator(), rule=rule, prune=prune)
        assert str(result.best.plan) == AMP
        (faster,) = [r for r in log.samples() if r.plan == FASTER]
        assert faster.batches == (8 if prune else 22)


def test_a_clear_loser_taking_turns_stops_on_pace_after_three_pairs():
    # with early_stop, a candidate twice as slow as the incumbent, pair for pair, stops before its first block
    true = lambda code: 2.0 if code == FASTER else 1.0  # noqa: E731
    evaluator, duel_steps = _bursty(true, burst=1.0, batches=8)
    _, log = stage1_logged(SPACE, evaluator, early_stop=0.05)
    (slow,) = [r for r in log.samples() if r.plan == FASTER]
    assert slow.status == "pruned" and slow.extra["stopped_early"] and slow.batches == 1 + EARLY_STOP_MIN_BATCHES
    assert "median over 3 pairs" in slow.reason and not duel_steps


def test_a_short_epoch_taking_turns_screens_on_its_pairs_before_a_duel():
    # 6 batches: 5 pairs, fewer than a block. A near tie's pairs screen it out (no duel); a clear win's pass, and its
    # duel times blocks of its own (5 pairs cannot give the rule's confidence)
    for factor, winner, duels in ((0.99, AMP, 0), (0.8, FASTER, 14)):
        true = lambda code, factor=factor: factor if code == FASTER else 1.0  # noqa: E731
        evaluator, duel_steps = _bursty(true, burst=1.0, batches=6)
        result, log = stage1_logged(SPACE, evaluator)
        assert str(result.best.plan) == winner and len(duel_steps) == duels
        (faster,) = [r for r in log.samples() if r.plan == FASTER and "its epoch again" not in r.reason]
        assert ("batch_verdict" in faster.extra) == (winner == AMP)


def test_an_undecided_duel_of_the_epochs_in_turns_takes_more_blocks_as_any_duel_does():
    # FP32's plan 10% faster in most pairs of the epochs, slower in a few: the median is past the bar, the interval
    # is not; like any duel, blocks of `rounds` pairs more are timed until it is decided (at most three blocks' worth)
    fp32_epoch = iter([0.9, 1.1, 0.9, 1.1, 0.9, 0.9, 1.1, 0.9, 0.9])
    steps = []

    def run_epoch(plan):
        for _ in range(9):
            yield 1.0, next(fp32_epoch) if str(plan) == "1" else 1.0

    def time_step(plan):
        steps.append(str(plan))
        return 0.9 if str(plan) == "1" else 1.0

    evaluator = FunctionEvaluator(run_epoch=run_epoch, time_step=time_step,
                                  run_epochs_taking_turns=lambda plans: [run_epoch(plan) for plan in plans])
    result, log = stage1_logged(ONE_OP, evaluator)
    (duel,) = [r.extra[DUEL] for r in log.notes() if DUEL in r.extra]
    assert duel["epoch_pairs"] == 8 and len(steps) == 2 * (len(duel["seconds"][0]) - 8) > 0
    assert duel["replaces"] and str(result.best.plan) == "1"  # the blocks showed FP32's plan confidently faster


def test_without_turns_fp32s_and_amps_epochs_run_one_after_the_other():
    # an evaluator that cannot run epochs in turns (the distributed one, or copies that may not fit): as before
    evaluator, counts = _taking_turns(lambda code: 1.0, uniform(0.0), 0)
    evaluator.run_epochs_taking_turns = None
    result = run_stage1(ONE_OP, evaluator, rule=DecisionRule(margin=0.03, rounds=7))
    assert str(result.best.plan) == "0" and not result.first_epochs_in_turns


# -- the callbacks' searches pay what optimize() pays -----------------------------------------------------

def test_the_cost_model_prices_a_per_module_search(one_thread, tmp_path, monkeypatch):
    import torch

    import compfx
    from compfx.costmodel import Predictor
    from compfx.regions import analyze_regions
    from tests.helpers import batches, ce

    monkeypatch.setenv("COMPFX_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    loader = batches(3, (16, 8), classes=3)
    result = compfx.optimize(model, loader, loss_fn=ce, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             per_module=torch.nn.Linear, config=SearchConfig(progress=False, cache_plan=False))
    assert not any("cost model off" in r.reason for r in result.log.notes())
    assert any(r.extra.get("calibration") for r in result.log.samples("stage1"))  # the predictor calibrated
    # the regions' graph holds each block's ops under model keys, so a plan of the regions is priced like any other
    analysis = analyze_regions(model, loader[0][0], torch.nn.Linear)
    predictor = Predictor.build(analysis, use_cache=False, repeats=1)
    fp32, low = compfx.Plan.fp32(analysis), compfx.Plan.from_bitstring(analysis, "00")
    assert predictor.breakdown(low).low_ops == tuple(analysis.keys) and predictor.breakdown(fp32).low_ops == ()
    assert predictor.breakdown(low).n_casts > 0 == predictor.breakdown(fp32).n_casts


# -- the benchmarks that check the timing acceptance points (smoke: they run and say what they measured) -----

def test_the_decisions_benchmark_times_the_plans_independently(one_thread):
    from benchmarks.decisions import run_one

    row = run_one("readme")
    assert set(row["independent_step_seconds"]) == {"fp32", "amp", "chosen"}
    assert row["independent_speedup"] > 0 and row["chosen_vs_better_of_fp32_amp"] > 0
    assert row["report_speedup_text"] and len(row["plan"]) == 11


def test_the_trainer_benchmark_counts_the_callbacks_search_in_fp32_epochs(one_thread):
    from benchmarks.search_cost import run_trainer

    figures = run_trainer(steps=2, search_batches=2)
    assert figures["search_cost_fp32_epochs"] == figures["search_seconds"] / figures["fp32_epoch_seconds"] > 0
    assert "compfx_search_runtime" in figures["trainer_metrics"]


def test_amps_measured_step_scales_the_profiles_predicted_differences():
    import torch

    import compfx
    from compfx.costmodel import SearchPredictor
    from compfx.measure import Conditions
    from compfx.vocabulary import SampleStatus as S, Stage as G

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    analysis = compfx.analyze(model, torch.randn(32, 64))
    fp32, amp = Assignment.parse("111"), Assignment.parse("0f0")
    for measured_amp, scale in ((None, 1.0), ("same", 0.0), ("half", 0.5)):
        p = SearchPredictor.build(analysis, use_cache=False, repeats=1, conditions=Conditions(1e-3))
        # the profiles as they are: timed again (on a busy machine) they would move the prediction the steps below
        # are made from (tests/test_predictor.py checks the re-timing of contradicted profiles)
        p.spot_check = None
        p.observe(G.STAGE1, fp32, S.ACCEPTED, 0.004, 4)  # FP32: 1 ms a step
        raw = p.step_seconds(amp)
        if abs(raw - 0.001) < 1e-5:
            pytest.skip("the profiles predict no difference between FP32 and AMP here: nothing to scale")
        if measured_amp is not None:
            step = 0.001 if measured_amp == "same" else 0.001 + 0.5 * (raw - 0.001)
            extra = p.observe(G.STAGE1, amp, S.ACCEPTED, step * 4, 4)
            assert extra["calibration"] and extra["prediction_scale"] == pytest.approx(scale)
        assert p.scale == pytest.approx(scale)
        assert p.step_seconds(amp) == pytest.approx(0.001 + scale * (raw - 0.001))
        assert p.step_lower_bound(amp) <= p.step_seconds(amp) + 1e-12  # still a lower bound


def test_the_step_comparison_reads_the_first_duel_when_the_chosen_plan_is_fp32s_or_amps():
    # the duel of FP32's and AMP's plans is the phase the comparison would run: the plans taking turns on the same
    # batches, warm; when the chosen plan is one of them, it is not timed again
    from dataclasses import replace
    from types import SimpleNamespace

    from compfx.measure import PhaseClock
    from compfx.search.compare import IN_THE_FIRST_DUEL, IN_THE_FIRST_EPOCHS, Comparison
    from compfx.search.driver import SINGLE_PROCESS
    from compfx.search.session import SearchSession

    fp32, amp = SPACE.fp32_plan, SPACE.amp_plan
    rounds = (tuple(1.0 + 0.01 * i for i in range(7)), tuple(1.1 + 0.01 * i for i in range(7)))  # AMP's, FP32's
    verdict = DecisionRule(margin=0.03, rounds=7).verdict(Comparison.of(*rounds), saves_less=False)
    verdict = replace(verdict, seconds=rounds)

    def comparison(chosen, duels=((amp, fp32, verdict),), padded=False, config=SearchConfig(progress=False),
                   in_turns=False):
        session = SimpleNamespace(space=SPACE, config=config, strategy=SINGLE_PROCESS, clock=PhaseClock(),
                                  local=SimpleNamespace(saved_bytes=lambda plan: 100), log=SearchLog())
        decision = SimpleNamespace(plan=chosen, stage1=SimpleNamespace(duels=list(duels),
                                                                       first_epochs_in_turns=in_turns))
        return SearchSession._first_duel_comparison(session, decision, SimpleNamespace(kept=padded)), session.log

    read, log = comparison(amp)
    assert read.phase == IN_THE_FIRST_DUEL
    assert read.seconds == {"fp32": rounds[1], "amp": rounds[0], "chosen": rounds[0]}
    assert read.speedup("amp") == "the same plan as AMP" and read.speedup("fp32").startswith("speed-up 1.10x")
    assert [(r.plan, r.extra["phase"]) for r in log.records] == [(str(amp), IN_THE_FIRST_DUEL),
                                                                  (str(fp32), IN_THE_FIRST_DUEL)]
    assert comparison(fp32)[0].seconds["chosen"] == rounds[1]
    other = Assignment.parse("0f0f0f")
    assert comparison(other)[0] is None  # another plan: timed in a phase of its own
    assert comparison(amp, padded=True)[0] is None  # the chosen plan runs padded: not the program the duel timed
    assert comparison(amp, duels=())[0] is None  # no duel of the two
    assert comparison(amp, config=SearchConfig(progress=False, decision=DecisionRule(rounds=9)))[0] is None  # fewer rounds than asked
    # FP32's and AMP's epochs took turns: their pairs were the duel, and the report says where they were taken
    assert comparison(amp, in_turns=True)[0].phase == IN_THE_FIRST_EPOCHS
