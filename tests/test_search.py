"""The pure search core (compfx.search) and the search log, driven by fake evaluators."""

from __future__ import annotations

import json
import math
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compfx.errors import PlanFileError, SearchError
from compfx.search import (
    SearchSpace, Segment, algorithm2_candidates, check_stage2, is_accepted, loss_limit, run_stage1, run_stage2,
    stage1_candidates, stage1_plan_space, stage2_segments,
)
from compfx.searchlog import SampleRecord, SearchLog

W, B, O, T = "whitelist", "blacklist", "other", "tc"  # T: a Tensor-Core-eligible whitelist op


def space_of(*kinds: str, groups=None) -> SearchSpace:
    categories = tuple(W if k == T else k for k in kinds)
    return SearchSpace(categories, tuple(k == T for k in kinds), tuple(groups or range(len(kinds))))


def fake_epoch(table, batches=3, log=None):
    """run_epoch over a dict bits -> list of (loss, seconds); records starts and closes in ``log``."""

    def run_epoch(bits):
        if log is not None:
            log.append(("start", bits))
        try:
            for loss, seconds in table(bits)[:batches]:
                yield loss, seconds
            return f"state after {bits}"
        finally:
            if log is not None:
                log.append(("close", bits))

    return run_epoch


# -- Stage 1 ---------------------------------------------------------------------

def test_stage1_candidates_are_every_combination_most_low_first():
    space = space_of(W, O, B, T, O)  # adjustable: 0 (whitelist, no TC) and 2 (blacklist)
    assert space.adjustable == (0, 2) and space.stage1_positions == (0, 2, 3)
    assert stage1_candidates(space) == ["0f00f", "0f10f", "1f00f", "1f10f"]


@pytest.mark.parametrize("budget, mode", [(16, "exhaustive"), (15, "grouped"), (4, "grouped"), (3, "greedy")])
def test_stage1_space_is_reduced_by_groups_then_greedy(budget, mode):
    space = space_of(W, W, B, W, groups=["lin", "lin", "exp", "lin"])  # 4 adjustable ops in 2 groups
    assert stage1_plan_space(space, budget) == mode


def test_grouped_stage1_enumerates_groups_then_refines_op_by_op():
    space = space_of(W, W, B, groups=["lin", "lin", "exp"])  # 2^3 = 8 plans > budget 5; 2 groups fit
    records = []

    def table(bits):
        return [(math.nan if bits[2] == "0" else 1.0, 1.0)] * 2  # the blacklisted op cannot go low

    result = run_stage1(space, fake_epoch(table), lambda bits, s: bits.count("1"), budget=5,
                        report=records.append)
    assert result.mode == "grouped"
    assert [s.bits for s in result.samples] == ["111", "000", "001", "110", "101", "011"]  # "111" ran as FP32
    assert result.best.bits == "001"
    assert "share one bit" in [r for r in records if not r.is_sample][0].reason


def test_guard_keeps_the_overflowing_op_fp32():
    # op 2 (blacklist) overflows in low precision; cost rewards every low op.
    space = space_of(W, O, B, W)

    def table(bits):
        loss = math.inf if bits[2] == "0" else 1.0
        return [(loss, 1.0)] * 3

    result = run_stage1(space, fake_epoch(table), lambda bits, s: bits.count("1"))
    assert result.best.bits == "0f10" and result.best.artifact == "state after 0f10"
    statuses = {s.bits: s.status for s in result.samples}
    assert statuses["0f00"] == "pruned" and statuses["1111"] == "accepted"


def test_loss_guard_uses_threshold_relative_to_fp32():
    assert loss_limit(2.0, 1.01) == pytest.approx(2.02)
    assert loss_limit(-2.0, 1.01) == pytest.approx(-1.98)  # a negative loss_0 still allows 1% worse
    assert is_accepted(2.01, 2.0, 1.01) and not is_accepted(2.03, 2.0, 1.01)
    assert not is_accepted(math.nan, 2.0, 1.01) and not is_accepted(None, 2.0, 1.01)


def test_pruned_and_failed_samples_close_their_epoch_and_the_search_goes_on():
    space = space_of(W, B)
    events = []

    def table(bits):
        if bits == "10":
            raise RuntimeError("unsupported dtype")
        return [(1.0, 1.0 if bits == "11" else 5.0)] * 4  # every low plan is slower than FP32

    result = run_stage1(space, fake_epoch(table, batches=4, log=events), lambda bits, s: s)
    assert result.best.bits == "11"
    assert sorted(b for e, b in events if e == "start") == sorted(b for e, b in events if e == "close")
    by_bits = {s.bits: s for s in result.samples}
    assert by_bits["10"].status == "error" and "unsupported dtype" in by_bits["10"].reason
    assert by_bits["00"].status == "pruned" and by_bits["00"].batches == 1  # 5.0 >= 4.0 after one batch


def test_keyboard_interrupt_closes_the_epoch_and_propagates():
    events = []

    def table(bits):
        if bits == "0":
            raise KeyboardInterrupt
        return [(1.0, 1.0)] * 2

    with pytest.raises(KeyboardInterrupt):
        run_stage1(space_of(W), fake_epoch(table, log=events), lambda bits, s: s)
    assert events[-1] == ("close", "0")


def test_failed_fp32_baseline_is_a_search_error():
    with pytest.raises(SearchError, match="FP32 baseline"):
        run_stage1(space_of(W), fake_epoch(lambda bits: [(math.nan, 1.0)]), lambda bits, s: s)


def _random_table(seed: int, batches: int, nan_rate: float, tie_grid: bool):
    def table(bits):
        rng = random.Random(zlib.crc32(bits.encode()) ^ seed)
        out = []
        for _ in range(batches):
            seconds = rng.randint(1, 4) if tie_grid else rng.uniform(0.1, 4.0)
            loss = math.nan if rng.random() < nan_rate else rng.uniform(0.9, 1.1)
            out.append((loss, seconds))
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
    space = space_of(*kinds, groups=[k for k in kinds])  # same category -> same group: exercises "grouped"
    table = _random_table(seed, batches, nan_rate, tie_grid)
    weight = lambda bits: 1 + (zlib.crc32(bits.encode()) % 3)  # noqa: E731
    cost = {"seconds": lambda bits, s: s,
            "scaled": lambda bits, s: s * weight(bits),
            "shifted": lambda bits, s: s + weight(bits),
            "plan_only": lambda bits, s: float(bits.count("1"))}[cost_form]
    if not all(math.isfinite(loss) for loss, _ in table(space.fp32_bits)):
        with pytest.raises(SearchError):
            run_stage1(space, fake_epoch(table, batches), cost, threshold=threshold, budget=budget)
        return
    pruned = run_stage1(space, fake_epoch(table, batches), cost, threshold=threshold, budget=budget)
    full = run_stage1(space, fake_epoch(table, batches), cost, threshold=threshold, budget=budget, prune=False)
    assert pruned.best.bits == full.best.bits
    assert pruned.best.cost == full.best.cost
    assert [s.bits for s in pruned.samples] == [s.bits for s in full.samples]  # same decisions, same order
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

    def program(bits):
        return bits.replace("f", "1") if "0" not in bits else bits  # follow ops see only FP32 inputs

    run_stage1(space, fake_epoch(lambda bits: [(1.0, 1.0)] * 3, log=started), lambda bits, s: s,
               identity=program, report=records.append)
    assert [b for event, b in started if event == "start"] == ["111", "0f0", "0f1", "1f0"]
    notes = [r for r in records if not r.is_sample]
    assert [n.extra["plan"] for n in notes] == ["1f1"] and notes[0].extra["same_as"] == "111"
    assert "same program" in notes[0].reason


def pace_table(per_batch):
    """Fake epochs of 10 batches whose seconds per batch come from ``per_batch[bits]`` (FP32: 1.0)."""
    return lambda bits: [(1.0, per_batch.get(bits, 1.0))] * 10


def test_early_stop_ends_a_sample_whose_pace_projects_it_over_the_best():
    space = space_of(W, B)
    per_batch = {"00": 2.0, "01": 1.5, "10": 1.03}  # 2x and 1.5x: clearly slower; 3%: within the tolerance
    result = run_stage1(space, fake_epoch(pace_table(per_batch), batches=10), lambda bits, s: s,
                        early_stop=0.05)
    by_bits = {s.bits: s for s in result.samples}
    for bits in ("00", "01"):
        assert by_bits[bits].status == "pruned" and by_bits[bits].batches == 3
        assert by_bits[bits].extra["stopped_early"] and "stopped early" in by_bits[bits].reason
        assert by_bits[bits].cost == pytest.approx(10 * per_batch[bits])  # the projected epoch
    near_tie = by_bits["10"]
    assert near_tie.status == "pruned" and near_tie.batches == 10 and "stopped_early" not in near_tie.extra
    assert result.best.bits == "11"


def test_early_stop_compares_batch_for_batch_and_is_off_by_default():
    space = space_of(W)
    # batches alternate long and short; the low plan is 20% slower on each, its first batches being long ones
    fp32 = [(1.0, 2.0), (1.0, 0.5)] * 5
    low = [(1.0, 2.4), (1.0, 0.6)] * 5
    table = {"1": fp32, "0": low}.__getitem__
    stopped = run_stage1(space, fake_epoch(table, batches=10), lambda bits, s: s, early_stop=0.1)
    assert stopped.samples[1].extra["stopped_early"] and stopped.samples[1].batches == 3
    assert stopped.samples[1].cost == pytest.approx(1.2 * 12.5)  # median ratio 1.2 x the best's 12.5 s
    exact = run_stage1(space, fake_epoch(table, batches=10), lambda bits, s: s)
    assert exact.samples[1].batches == 9 and "stopped_early" not in exact.samples[1].extra
    with pytest.raises(SearchError, match="early_stop"):
        run_stage1(space, fake_epoch(table), lambda bits, s: s, early_stop=-0.1)


# -- Stage 2 ---------------------------------------------------------------------

# ops:        0  1  2  3  4  5  6  7
STAGE2_SPACE = space_of(O, W, O, O, B, O, T, O)
STAGE2_BASE = "f0ff1f0f"  # a Stage-1 winner: op 1 low, op 4 FP32, op 6 (TC) low, "other" ops follow


def stage2_seconds(bits: str) -> float:
    """Additive fake step time: low 1, FP32 2, follow 1.5 -- except op 3, which is fastest in FP32."""
    weights = {"0": 1.0, "1": 2.0, "f": 1.5}
    return sum((3.0 if (i == 3 and c == "0") else 2.5 if (i == 3 and c == "f") else weights[c])
               for i, c in enumerate(bits))


def test_stage2_segments_use_the_paper_boundaries():
    # boundaries: -1 (model inputs, FP32) and len (FP32 outputs/loss); Stage-1 ops at 1, 4, 6
    assert stage2_segments(STAGE2_SPACE, STAGE2_BASE) == [
        Segment(-1, 1, (0,)), Segment(1, 4, (2, 3)), Segment(4, 6, (5,)), Segment(6, 8, (7,))]
    assert stage2_segments(STAGE2_SPACE, "11111111") == []  # the FP32 winner: nothing differs
    assert stage2_segments(STAGE2_SPACE, "f1ff1f0f") == [Segment(4, 6, (5,)), Segment(6, 8, (7,))]


def test_algorithm2_candidates_and_final_plan_match_a_hand_checked_example():
    seen = []

    def time_step(bits):
        seen.append(bits)
        return stage2_seconds(bits)

    result = run_stage2(STAGE2_SPACE, STAGE2_BASE, time_step, lambda bits, s: s, budget=32)
    assert seen == [
        "f0ff1f0f",  # the Stage-1 winner                           12.5
        "00ff1f0f", "10ff1f0f",  # segment (-1, 1)                    12.0, 13.0
        "f0001f0f", "f0011f0f", "f0101f0f", "f0111f0f",  # (1, 4)      12.5, 11.5, 13.5, 12.5
        "f0ff100f", "f0ff110f",  # segment (4, 6)                     12.0, 13.0
        "f0ff1f00", "f0ff1f01",  # segment (6, 8)                     12.0, 13.0
        "00011000",  # every segment's best string, combined          10.0
    ]
    assert result.best.bits == "00011000" and result.best.cost == 10.0
    assert algorithm2_candidates(STAGE2_BASE, Segment(1, 4, (2, 3))) == seen[3:7]


def test_stage2_goes_greedy_over_budget_and_breaks_ties_by_order():
    records = []
    result = run_stage2(STAGE2_SPACE, STAGE2_BASE, stage2_seconds, lambda bits, s: s, budget=4,
                        report=records.append)
    tried = [r.bitstring for r in records if r.is_sample]
    assert tried == ["f0ff1f0f", "00ff1f0f", "10ff1f0f", "f00f1f0f"]  # segment (1, 4) gets one greedy try
    assert result.best.bits == "00ff1f0f"  # 12.0, tied with f00f1f0f; the earlier candidate wins
    assert any("greedy" in r.reason or "one at a time" in r.reason for r in records if not r.is_sample)


def test_stage2_without_segments_times_nothing():
    timed, records = [], []
    result = run_stage2(STAGE2_SPACE, "11111111", lambda bits: timed.append(bits) or 1.0, lambda b, s: s,
                        report=records.append)
    assert timed == [] and result.samples == [] and result.best.bits == "11111111"
    assert "nothing to time" in records[0].reason and not records[0].is_sample


def test_stage2_does_not_time_a_candidate_that_runs_the_same_program_again():
    space = space_of(W, O, O, B)  # base "0ff1": the follow ops after the low op 0 run low already
    timed, records = [], []

    def program(bits):  # a follow op takes the precision of the op before it
        out = []
        for bit in bits:
            out.append(out[-1] if bit == "f" else bit)
        return "".join(out)

    def time_step(bits):
        timed.append(bits)
        return 1.0 - 0.1 * program(bits).count("0")

    result = run_stage2(space, "0ff1", time_step, lambda b, s: s, budget=4 + 1, report=records.append,
                        identity=program)
    assert timed == ["0ff1", "0011", "0101", "0111"]  # "0001" is "0ff1" again, and timing it was not needed
    assert result.best.bits == "0ff1"  # the cheapest program, timed once
    twin = [r for r in records if not r.is_sample]
    assert [(r.extra["plan"], r.extra["same_as"]) for r in twin] == [("0001", "0ff1")]


def test_stage2_failed_candidate_is_logged_and_skipped():
    def time_step(bits):
        if bits == "00ff1f0f":
            raise MemoryError("out of memory")
        return stage2_seconds(bits)

    result = run_stage2(STAGE2_SPACE, STAGE2_BASE, time_step, lambda bits, s: s)
    failed = [s for s in result.samples if s.status == "error"]
    assert [s.bits for s in failed] == ["00ff1f0f"] and "out of memory" in failed[0].reason
    assert result.best.bits == "f0011000"  # segment (-1, 1) no longer improves; the other three combine


@pytest.mark.parametrize("loss, expected", [(1.0, "winner"), (1.5, "fallback"), (math.nan, "fallback")])
def test_stage2_check_falls_back_to_the_stage1_winner(loss, expected):
    records = []
    chosen = check_stage2("winner", "fallback", lambda bits: loss, reference_loss=1.0, threshold=1.01,
                          report=records.append)
    assert chosen == expected
    assert records[0].stage == "check" and (("falling back" in records[0].reason) == (expected == "fallback"))


# -- the log -------------------------------------------------------------------------

def test_search_log_is_flushed_per_record_and_reads_back(tmp_path):
    path = tmp_path / "search.jsonl"
    log = SearchLog(path)
    log.append(SampleRecord("stage1", "11", "accepted", loss=1.0, cost=2.0, reason="FP32 baseline"))
    assert len(path.read_text().splitlines()) == 1  # on disk before the log is closed
    log.append(SampleRecord("stage1", "01", "pruned", loss=math.inf, reason="loss became inf"))
    log.note("stage1", "space reduced")
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[1]["loss"] == "inf" and lines[2]["status"] == "note"
    again = SearchLog.read(path)
    assert [r.bitstring for r in again.samples()] == ["11", "01"] and math.isinf(again.records[1].loss)


def test_damaged_search_log_raises_plan_file_error(tmp_path):
    path = tmp_path / "search.jsonl"
    path.write_text('{"stage": "stage1", "bitstring": "1", "status": "accepted"}\n{"stage": "sta')
    with pytest.raises(PlanFileError, match="line 2"):
        SearchLog.read(path)
