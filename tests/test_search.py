"""The pure search core (compfx.search) and the search log, driven by fake evaluators."""

from __future__ import annotations

import json
import math
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compfx.errors import PlanFailedError, PlanFileError, SearchError
from compfx.plan import Assignment
from compfx.search import (
    FunctionEvaluator, SearchSpace, Segment, algorithm2_candidates, check_winner, is_accepted, loss_limit,
    run_stage1, run_stage2, stage1_candidates, stage1_plan_space, stage2_segments,
)
from compfx.search.compare import DecisionRule
from compfx.search.log import SEGMENT_NOT_ENUMERATED, SampleRecord, SearchLog
from compfx.search.outcome import Outcome
from compfx.vocabulary import Category, SampleStatus, Stage

W, B, O = Category.WHITELIST, Category.BLACKLIST, Category.OTHER
T = "tc"  # a Tensor-Core-eligible whitelist op


def space_of(*kinds, groups=None) -> SearchSpace:
    categories = tuple(W if k == T else k for k in kinds)
    return SearchSpace(categories, tuple(k == T for k in kinds), tuple(groups or range(len(kinds))))


def seconds(plan, s):
    """The default cost: the measured seconds."""
    return s


def fake_epoch(table, batches=3, log=None):
    """run_epoch over ``table(plan string) -> list of (loss, seconds)``; records starts and closes in ``log``."""

    def run_epoch(plan):
        code = str(plan)
        if log is not None:
            log.append(("start", code))
        try:
            for loss, s in table(code)[:batches]:
                yield loss, s
            return f"state after {code}"
        finally:
            if log is not None:
                log.append(("close", code))

    return run_epoch


def epochs(table, cost=seconds, *, batches=3, log=None, **functions) -> FunctionEvaluator:
    """A Stage-1 evaluator: the fake epochs of ``table``, priced by ``cost(plan, seconds)``."""
    return FunctionEvaluator(run_epoch=fake_epoch(table, batches, log), cost=cost, **functions)


def timer(step_seconds, cost=seconds, **functions) -> FunctionEvaluator:
    """A Stage-2 evaluator: ``step_seconds(plan string)`` per timed step."""
    return FunctionEvaluator(time_step=lambda plan: step_seconds(str(plan)), cost=cost, **functions)


def ones(plan, s):
    """A cost that rewards every low op: the count of FP32 ops."""
    return str(plan).count("1")


def codes(plans) -> list[str]:
    return [str(plan) for plan in plans]


# -- Stage 1 ---------------------------------------------------------------------

def test_stage1_candidates_are_every_combination_most_low_first():
    space = space_of(W, O, B, T, O)  # adjustable: 0 (whitelist, no TC) and 2 (blacklist)
    assert space.adjustable == (0, 2) and space.stage1_positions == (0, 2, 3)
    assert codes(stage1_candidates(space)) == ["0f00f", "0f10f", "1f00f", "1f10f"]
    assert str(space.fp32_plan) == "11111" and str(space.amp_plan) == "0f10f"


@pytest.mark.parametrize("budget, mode", [(16, "exhaustive"), (15, "grouped"), (4, "grouped"), (3, "greedy")])
def test_stage1_space_is_reduced_by_groups_then_greedy(budget, mode):
    space = space_of(W, W, B, W, groups=["lin", "lin", "exp", "lin"])  # 4 adjustable ops in 2 groups
    assert stage1_plan_space(space, budget) == mode


def test_grouped_stage1_enumerates_groups_then_refines_op_by_op():
    space = space_of(W, W, B, groups=["lin", "lin", "exp"])  # 2^3 = 8 plans > budget 5; 2 groups fit
    records = []

    def table(code):
        return [(math.nan if code[2] == "0" else 1.0, 1.0)] * 2  # the blacklisted op cannot go low

    result = run_stage1(space, epochs(table, ones), budget=5, report=records.append)
    assert result.mode == "grouped"
    # "111": the FP32 baseline; "001": AMP's plan, the first incumbent
    assert codes(s.plan for s in result.samples) == ["111", "001", "000", "110", "101", "011"]
    assert str(result.best.plan) == "001"
    assert "share one decision" in [r for r in records if not r.is_sample][0].reason


def test_guard_keeps_the_overflowing_op_fp32():
    # op 2 (blacklist) overflows in low precision; cost rewards every low op.
    space = space_of(W, O, B, W)

    def table(code):
        loss = math.inf if code[2] == "0" else 1.0
        return [(loss, 1.0)] * 3

    result = run_stage1(space, epochs(table, ones))
    assert str(result.best.plan) == "0f10" and result.best.artifact == "state after 0f10"
    statuses = {str(s.plan): s.status for s in result.samples}
    assert statuses["0f00"] == "pruned" and statuses["1111"] == "accepted"


def test_loss_guard_uses_threshold_relative_to_fp32():
    assert loss_limit(2.0, 1.01) == pytest.approx(2.02)
    assert loss_limit(-2.0, 1.01) == pytest.approx(-1.98)  # a negative loss_0 still allows 1% worse
    assert is_accepted(2.01, 2.0, 1.01) and not is_accepted(2.03, 2.0, 1.01)
    assert not is_accepted(math.nan, 2.0, 1.01) and not is_accepted(None, 2.0, 1.01)


def test_pruned_and_failed_samples_close_their_epoch_and_the_search_goes_on():
    space = space_of(W, B)
    events = []

    def table(code):
        if code == "10":
            raise PlanFailedError("RuntimeError: unsupported dtype")
        return [(1.0, 1.0 if code == "11" else 5.0)] * 4  # every low plan is slower than FP32

    result = run_stage1(space, epochs(table, batches=4, log=events))
    assert str(result.best.plan) == "11"
    assert sorted(b for e, b in events if e == "start") == sorted(b for e, b in events if e == "close")
    by_plan = {str(s.plan): s for s in result.samples}
    assert by_plan["10"].status == "error" and "unsupported dtype" in by_plan["10"].reason
    assert by_plan["00"].status == "pruned" and by_plan["00"].batches == 1  # 5.0 >= 4.0 after one batch


@pytest.mark.parametrize("error", [RuntimeError("a bug in compfx"), SearchError("bad input"), KeyboardInterrupt()])
def test_an_error_that_is_not_the_plans_closes_the_epoch_and_stops_stage1(error):
    events = []

    def table(code):
        if code == "0":
            raise error
        return [(1.0, 1.0)] * 2

    with pytest.raises(type(error)):
        run_stage1(space_of(W), epochs(table, log=events))
    assert events[-1] == ("close", "0")


def test_failed_fp32_baseline_is_a_search_error():
    with pytest.raises(SearchError, match="FP32 baseline"):
        run_stage1(space_of(W), epochs(lambda code: [(math.nan, 1.0)]))

    def failing(code):
        raise PlanFailedError("RuntimeError: no kernel")

    with pytest.raises(SearchError, match="FP32 baseline.*no kernel"):
        run_stage1(space_of(W), epochs(failing))


def _random_table(seed: int, batches: int, nan_rate: float, tie_grid: bool):
    def table(code):
        rng = random.Random(zlib.crc32(code.encode()) ^ seed)
        out = []
        for _ in range(batches):
            s = rng.randint(1, 4) if tie_grid else rng.uniform(0.1, 4.0)
            loss = math.nan if rng.random() < nan_rate else rng.uniform(0.9, 1.1)
            out.append((loss, s))
        return out

    return table


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(st.sampled_from([W, B, B, O, T]), min_size=2, max_size=7),
    seed=st.integers(0, 2 ** 16),
    batches=st.integers(1, 5),
    nan_rate=st.sampled_from([0.0, 0.1, 0.4]),
    tie_grid=st.booleans(),
    budget=st.sampled_from([1, 3, 8, 64]),
    cost_form=st.sampled_from(["seconds", "scaled", "shifted", "plan_only"]),
    threshold=st.sampled_from([1.0, 1.01, 1.1]),
)
def test_pruning_picks_the_same_plan_as_exhaustive_search(kinds, seed, batches, nan_rate, tie_grid, budget,
                                                          cost_form, threshold):
    space = space_of(*kinds, groups=[str(k) for k in kinds])  # same category -> same group: exercises "grouped"
    table = _random_table(seed, batches, nan_rate, tie_grid)
    weight = lambda plan: 1 + (zlib.crc32(str(plan).encode()) % 3)  # noqa: E731
    cost = {"seconds": seconds,
            "scaled": lambda plan, s: s * weight(plan),
            "shifted": lambda plan, s: s + weight(plan),
            "plan_only": lambda plan, s: float(str(plan).count("1"))}[cost_form]
    if not all(math.isfinite(loss) for loss, _ in table(str(space.fp32_plan))):
        with pytest.raises(SearchError):
            run_stage1(space, epochs(table, cost, batches=batches), threshold=threshold, budget=budget)
        return
    pruned = run_stage1(space, epochs(table, cost, batches=batches), threshold=threshold, budget=budget)
    full = run_stage1(space, epochs(table, cost, batches=batches), threshold=threshold, budget=budget,
                      prune=False)
    assert pruned.best.plan == full.best.plan
    assert pruned.best.cost == full.best.cost
    assert [s.plan for s in pruned.samples] == [s.plan for s in full.samples]  # same decisions, same order
    best_so_far = math.inf
    for sample, whole in zip(pruned.samples, full.samples):
        if sample.status == "pruned":  # could not have won when it ran: too costly, or a non-finite loss
            assert whole.cost >= best_so_far or not math.isfinite(whole.loss)
            assert sample.batches <= whole.batches
        if whole.status == "accepted":
            best_so_far = min(best_so_far, whole.cost)


def test_plan_that_runs_the_same_program_as_one_sampled_is_not_run_again():
    space = space_of(W, O, B)  # "1f1" (every adjustable op FP32) is the FP32 baseline "111" in disguise
    started, records = [], []

    def program(plan):
        code = str(plan)
        return code.replace("f", "1") if "0" not in code else code  # follow ops see only FP32 inputs

    run_stage1(space, epochs(lambda code: [(1.0, 1.0)] * 3, log=started, program=program), report=records.append)
    assert [b for event, b in started if event == "start"] == ["111", "0f1", "0f0", "1f0"]  # FP32, AMP, the rest
    notes = [r for r in records if not r.is_sample]
    assert [n.extra["plan"] for n in notes] == ["1f1"] and notes[0].extra["same_as"] == "111"
    assert "same program" in notes[0].reason


def pace_table(per_batch):
    """Fake epochs of 10 batches whose seconds per batch come from ``per_batch[code]`` (FP32: 1.0)."""
    return lambda code: [(1.0, per_batch.get(code, 1.0))] * 10


def test_early_stop_ends_a_sample_whose_pace_projects_it_over_the_best():
    space = space_of(W, B)
    per_batch = {"00": 2.0, "01": 1.5, "10": 1.03}  # 2x and 1.5x: clearly slower; 3%: within the tolerance
    result = run_stage1(space, epochs(pace_table(per_batch), batches=10), early_stop=0.05)
    by_plan = {str(s.plan): s for s in result.samples}
    assert by_plan["00"].status == "pruned" and by_plan["00"].batches == 3
    assert by_plan["00"].extra["stopped_early"] and "stopped early" in by_plan["00"].reason
    assert by_plan["00"].cost == pytest.approx(10 * per_batch["00"])  # the projected epoch
    amp = by_plan["01"]  # AMP's plan, the first incumbent: stopped only at the exact bar (FP32's cost), never on pace
    assert amp.status == "pruned" and amp.batches == 7 and "stopped_early" not in amp.extra
    near_tie = by_plan["10"]
    assert near_tie.status == "pruned" and near_tie.batches == 10 and "stopped_early" not in near_tie.extra
    assert str(result.best.plan) == "11"


def test_early_stop_compares_batch_for_batch_and_is_off_by_default():
    space = space_of(B)  # AMP's plan keeps the blacklist op FP32: it is the FP32 baseline, and "0" a candidate
    # batches alternate long and short; the low plan is 20% slower on each, its first batches being long ones
    fp32 = [(1.0, 2.0), (1.0, 0.5)] * 5
    low = [(1.0, 2.4), (1.0, 0.6)] * 5
    table = {"1": fp32, "0": low}.__getitem__
    stopped = run_stage1(space, epochs(table, batches=10), early_stop=0.1)
    assert stopped.samples[1].extra["stopped_early"] and stopped.samples[1].batches == 3
    assert stopped.samples[1].cost == pytest.approx(1.2 * 12.5)  # median ratio 1.2 x the best's 12.5 s
    exact = run_stage1(space, epochs(table, batches=10))
    assert exact.samples[1].batches == 9 and "stopped_early" not in exact.samples[1].extra
    with pytest.raises(SearchError, match="early_stop"):
        run_stage1(space, epochs(table), early_stop=-0.1)


# -- Stage 2 ---------------------------------------------------------------------

# ops:        0  1  2  3  4  5  6  7
STAGE2_SPACE = space_of(O, W, O, O, B, O, T, O)
STAGE2_BASE = Assignment.parse("f0ff1f0f")  # a Stage-1 winner: op 1 low, op 4 FP32, op 6 (TC) low, the rest follow


def stage2_seconds(code: str) -> float:
    """Additive fake step time: low 1, FP32 2, follow 1.5 -- except op 3, which is fastest in FP32."""
    weights = {"0": 1.0, "1": 2.0, "f": 1.5}
    return sum((3.0 if (i == 3 and c == "0") else 2.5 if (i == 3 and c == "f") else weights[c])
               for i, c in enumerate(code))


def test_stage2_segments_use_the_paper_boundaries():
    # boundaries: -1 (model inputs, FP32) and len (FP32 outputs/loss); Stage-1 ops at 1, 4, 6
    assert stage2_segments(STAGE2_SPACE, STAGE2_BASE) == [
        Segment(-1, 1, (0,)), Segment(1, 4, (2, 3)), Segment(4, 6, (5,)), Segment(6, 8, (7,))]
    assert stage2_segments(STAGE2_SPACE, Assignment.parse("11111111")) == []  # the FP32 winner: nothing differs
    assert stage2_segments(STAGE2_SPACE, Assignment.parse("f1ff1f0f")) == [Segment(4, 6, (5,)), Segment(6, 8, (7,))]
    with pytest.raises(SearchError, match="precisions for 8 ops"):
        stage2_segments(STAGE2_SPACE, Assignment.parse("f0f"))


def test_algorithm2_candidates_and_final_plan_match_a_hand_checked_example():
    seen = []

    def time_step(code):
        seen.append(code)
        return stage2_seconds(code)

    result = run_stage2(STAGE2_SPACE, STAGE2_BASE, timer(time_step), budget=32)
    assert seen == [
        "f0ff1f0f",  # the Stage-1 winner                           12.5
        "00ff1f0f", "10ff1f0f",  # segment (-1, 1)                    12.0, 13.0
        "f0001f0f", "f0011f0f", "f0101f0f", "f0111f0f",  # (1, 4)      12.5, 11.5, 13.5, 12.5
        "f0ff100f", "f0ff110f",  # segment (4, 6)                     12.0, 13.0
        "f0ff1f00", "f0ff1f01",  # segment (6, 8)                     12.0, 13.0
        "00011000",  # every segment's best plan, combined            10.0
    ]
    assert str(result.best.plan) == "00011000" and result.best.cost == 10.0
    assert codes(algorithm2_candidates(STAGE2_BASE, Segment(1, 4, (2, 3)))) == seen[3:7]


def test_stage2_goes_greedy_over_budget_and_breaks_ties_by_order():
    records = []
    result = run_stage2(STAGE2_SPACE, STAGE2_BASE, timer(stage2_seconds), budget=4, report=records.append)
    tried = [r.plan for r in records if r.is_sample]
    assert tried == ["f0ff1f0f", "00ff1f0f", "10ff1f0f", "f00f1f0f"]  # segment (1, 4) gets one greedy try
    assert str(result.best.plan) == "00ff1f0f"  # 12.0, tied with f00f1f0f; the earlier candidate wins
    assert any("greedy" in r.reason or "one at a time" in r.reason for r in records if not r.is_sample)


def test_stage2_without_segments_times_nothing():
    timed, records = [], []
    fp32 = Assignment.parse("11111111")
    result = run_stage2(STAGE2_SPACE, fp32, timer(lambda code: timed.append(code) or 1.0), report=records.append)
    assert timed == [] and result.samples == [] and result.best.plan == fp32
    assert "nothing to time" in records[0].reason and not records[0].is_sample


def test_stage2_does_not_time_a_candidate_that_runs_the_same_program_again():
    space = space_of(W, O, O, B)  # base "0ff1": the follow ops after the low op 0 run low already
    timed, records = [], []

    def program(plan):  # a follow op takes the precision of the op before it
        out = []
        for code in str(plan):
            out.append(out[-1] if code == "f" else code)
        return "".join(out)

    def time_step(code):
        timed.append(code)
        return 1.0 - 0.1 * program(code).count("0")

    result = run_stage2(space, Assignment.parse("0ff1"), timer(time_step, program=program), budget=4 + 1,
                        report=records.append)
    assert timed == ["0ff1", "0011", "0101", "0111"]  # "0001" is "0ff1" again, and timing it was not needed
    assert str(result.best.plan) == "0ff1"  # the cheapest program, timed once
    twin = [r for r in records if not r.is_sample]
    assert [(r.extra["plan"], r.extra["same_as"]) for r in twin] == [("0001", "0ff1")]


def test_stage2_failed_candidate_is_logged_and_skipped():
    def time_step(code):
        if code == "00ff1f0f":
            raise PlanFailedError("OutOfMemoryError: out of memory")
        return stage2_seconds(code)

    result = run_stage2(STAGE2_SPACE, STAGE2_BASE, timer(time_step))
    failed = [s for s in result.samples if s.status == "error"]
    assert codes(s.plan for s in failed) == ["00ff1f0f"] and "out of memory" in failed[0].reason
    assert str(result.best.plan) == "f0011000"  # segment (-1, 1) no longer improves; the other three combine


def test_stage2_stops_on_an_error_that_is_not_the_plans():
    def time_step(code):
        if code == "00ff1f0f":
            raise MemoryError("the host ran out of memory")  # not a PlanFailedError: compfx cannot go on
        return stage2_seconds(code)

    records = []
    with pytest.raises(MemoryError):
        run_stage2(STAGE2_SPACE, STAGE2_BASE, timer(time_step), report=records.append)
    assert [r.plan for r in records if r.is_sample] == ["f0ff1f0f"]  # the failing candidate is not logged


# a Stage-1 winner with one segment of 30 "other" ops between a low op and an FP32 op: 2**30 plans
LONG_SPACE = space_of(W, *[O] * 30, B)
LONG_BASE = Assignment.parse("0" + "f" * 30 + "1")


def _priced(table):
    """A cost model's ``bound`` and ``predict`` over ``table(plan string)``, and the plans each was asked to price."""
    priced = []

    def price(plan):
        priced.append(str(plan))
        return table(str(plan))

    return price, priced


def test_stage2_prices_no_more_plans_of_a_long_segment_than_the_budget_could_time():
    # every plan is predicted within the margin of the winner: nothing can win, and nothing is timed
    bound, priced = _priced(lambda code: 1.0)
    log = SearchLog()
    result = run_stage2(LONG_SPACE, LONG_BASE, timer(lambda code: 1.0), budget=8, report=log.append,
                        bound=bound, predict=bound, rule=DecisionRule(margin=0.03))
    assert result.samples == [] and result.best.plan == LONG_BASE
    assert len(set(priced) - {str(LONG_BASE)}) == 8 - 1  # the greedy order's first 7 plans, not 2**30
    [partial] = [r.extra[SEGMENT_NOT_ENUMERATED] for r in log.notes() if SEGMENT_NOT_ENUMERATED in r.extra]
    assert partial == {"segment": [0, 31], "ops": 30, "tried": 0}


def test_stage2_times_a_long_segment_greedily_within_the_budget_and_says_so():
    def step(code):  # each op run low saves a little, predicted and measured alike
        return 2.0 - 0.01 * code.count("0")

    bound, priced = _priced(step)
    log = SearchLog()
    result = run_stage2(LONG_SPACE, LONG_BASE, timer(step), budget=12, report=log.append, bound=bound,
                        predict=bound, rule=DecisionRule(margin=0.0))
    assert len(result.samples) == 12 and len(set(priced)) <= 12 + 1
    assert str(result.best.plan) == "0" * 7 + "f" * 24 + "1"  # 11 tries: ops 1-6 went low, one at a time
    [partial] = [r for r in log.notes() if SEGMENT_NOT_ENUMERATED in r.extra]
    assert partial.extra[SEGMENT_NOT_ENUMERATED] == {"segment": [0, 31], "ops": 30, "tried": 11}
    assert "11 of its 2^30 plans tried" in partial.reason and "op1 to op30" in partial.reason


def test_stage2_enumerates_a_segment_that_fits_the_budget_and_notes_nothing():
    log = SearchLog()
    space, base = space_of(W, O, O, O, B), Assignment.parse("0fff1")
    result = run_stage2(space, base, timer(lambda code: 1.0 - 0.01 * code.count("0")), budget=9, report=log.append)
    assert len(result.samples) == 1 + 2 ** 3
    assert not [r for r in log.notes() if SEGMENT_NOT_ENUMERATED in r.extra]


# -- the loss check of the Stage-2 winner ----------------------------------------------------

WINNER, FALLBACK = Assignment.parse("00"), Assignment.parse("01")
BASELINE = Outcome(Assignment.parse("11"), SampleStatus.ACCEPTED, loss=1.0, batches=3, batch_losses=[1.0, 1.0, 4.0])


@pytest.mark.parametrize("loss, chosen, status", [(1.0, WINNER, "accepted"), (1.5, FALLBACK, "rejected"),
                                                  (math.nan, FALLBACK, "rejected")])
def test_stage2_check_falls_back_to_the_stage1_winner(loss, chosen, status):
    records, checked = [], []
    evaluator = FunctionEvaluator(check_loss=lambda plan, batches: checked.append((str(plan), batches)) or loss)
    assert check_winner(evaluator, WINNER, FALLBACK, BASELINE, batches=2, threshold=1.01,
                        report=records.append) == chosen
    assert checked == [("00", 2)]  # compared with FP32's mean over the same first 2 batches: 1.0
    [record] = records
    assert record.stage == Stage.CHECK and record.plan == "00" and record.status == status
    assert ("falling back" in record.reason) == (chosen == FALLBACK)


def test_stage2_check_rejects_a_failing_winner_and_stops_on_other_errors():
    def failing(plan, batches):
        raise PlanFailedError("RuntimeError: no kernel")

    records = []
    assert check_winner(FunctionEvaluator(check_loss=failing), WINNER, FALLBACK, BASELINE, batches=2,
                        threshold=1.01, report=records.append) == FALLBACK
    assert records[0].status == "error" and "no kernel" in records[0].reason and records[0].loss is None

    def broken(plan, batches):
        raise RuntimeError("a bug in compfx")

    with pytest.raises(RuntimeError, match="a bug"):
        check_winner(FunctionEvaluator(check_loss=broken), WINNER, FALLBACK, BASELINE, batches=2, threshold=1.01)


def test_stage2_check_is_skipped_when_there_is_nothing_to_check():
    never = FunctionEvaluator()  # its check_loss refuses to be called
    assert check_winner(never, FALLBACK, FALLBACK, BASELINE, batches=2, threshold=1.01) == FALLBACK
    assert check_winner(never, WINNER, FALLBACK, BASELINE, batches=0, threshold=1.01) == WINNER


# -- the log -------------------------------------------------------------------------

def test_search_log_is_flushed_per_record_and_reads_back(tmp_path):
    path = tmp_path / "search.jsonl"
    log = SearchLog(path)
    log.append(SampleRecord(Stage.STAGE1, "11", SampleStatus.ACCEPTED, loss=1.0, cost=2.0, reason="FP32 baseline"))
    assert len(path.read_text().splitlines()) == 1  # on disk before the log is closed
    log.append(SampleRecord(Stage.STAGE1, "01", SampleStatus.PRUNED, loss=math.inf, reason="loss became inf"))
    log.note(Stage.STAGE1, "space reduced")
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["stage"] == "stage1" and lines[0]["plan"] == "11"  # the enums are written as their text
    assert lines[1]["loss"] == "inf" and lines[2]["status"] == "note"
    again = SearchLog.read(path)
    assert [r.plan for r in again.samples()] == ["11", "01"] and math.isinf(again.records[1].loss)
    assert again.records[1].status is SampleStatus.PRUNED and again.records[2].stage is Stage.STAGE1


def test_a_log_written_before_plans_had_their_name_still_reads(tmp_path):
    path = tmp_path / "search.jsonl"
    path.write_text('{"stage": "stage1", "bitstring": "1f0", "status": "accepted", "loss": 1.0}\n')
    with pytest.warns(UserWarning, match="no digests"):  # it predates digests too: read, unchecked
        [record] = SearchLog.read(path).records
    assert record.plan == "1f0" and record.status is SampleStatus.ACCEPTED


def test_damaged_search_log_raises_plan_file_error(tmp_path):
    path = tmp_path / "search.jsonl"
    path.write_text('{"stage": "stage1", "plan": "1", "status": "accepted"}\n{"stage": "sta')
    with pytest.raises(PlanFileError, match="line 2"):
        SearchLog.read(path)
    path.write_text('{"stage": "stage7", "plan": "1", "status": "accepted"}\n')
    with pytest.raises(PlanFileError, match="line 1"):  # a stage compfx does not write
        SearchLog.read(path)
