"""The search through the Evaluator interface alone: fake evaluators, replay, and the distributed wrapper.

No model is trained here. The distributed pieces run over a fake two-rank
context whose "other rank" reports numbers derived from this rank's, so the
synchronised evaluator and the strategies are shown to work through the
interface without a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from compfx.errors import PlanFailedError, SearchError
from compfx.plan import Assignment
from compfx.search import (SINGLE_PROCESS, FunctionEvaluator, Replay, ReplayingEvaluator, SearchConfig, SearchLog,
                           SearchSpace, run_search)
from compfx.search.distributed import PerDeviceAllocation, RankAgreement, RankContext, SyncedEvaluator
from compfx.search.log import BATCHES, SampleRecord
from compfx.vocabulary import Category, SampleStatus, Stage

W, O, B = Category.WHITELIST, Category.OTHER, Category.BLACKLIST
SPACE = SearchSpace((W, O, B), (False,) * 3, ("lin", "relu", "exp"))
CONFIG = SearchConfig(progress=False, stage2_check_batches=2)


def seconds_of(plan: Assignment) -> float:
    """This rank's device: each low op saves a quarter of a second per batch."""
    return 1.0 - 0.25 * str(plan).count("0")


def fake_evaluator(calls: list | None = None) -> FunctionEvaluator:
    def run_epoch(plan):
        if calls is not None:
            calls.append(str(plan))
        for _ in range(3):
            yield 1.0, seconds_of(plan)
        return f"state of {plan}"

    return FunctionEvaluator(run_epoch=run_epoch, time_step=seconds_of, check_loss=lambda plan, batches: 1.0)


@dataclass(frozen=True)
class MirroredRanks(RankContext):
    """Two ranks in one process: rank 1 reports ``2 - x`` for every number rank 0 reports (its status kept).

    Where this rank's low precision is fast, the other rank's is slow.
    """

    rank: int = 0
    world_size: int = 2

    def gather(self, values):
        mine = [float(v) for v in values]
        return [mine, [mine[0], *(2.0 - v for v in mine[1:])]]

    def broadcast_text(self, text: str, src: int = 0) -> str:
        return text  # this process is rank 0, the source


def test_a_plan_is_chosen_on_the_slowest_rank_through_the_evaluator_interface():
    alone = run_search(SPACE, fake_evaluator(), CONFIG)
    records = []
    synced = run_search(SPACE, SyncedEvaluator(fake_evaluator(), MirroredRanks()), CONFIG, report=records.append,
                        strategy=RankAgreement(MirroredRanks(), model=None, optimizer=None))
    assert str(alone.plan) == "0f0"  # on this rank alone, every low op pays
    # the other rank is slower in low precision: the step waits for it, so FP32 wins for both
    assert str(synced.plan) == "111"
    baseline = synced.stage1.baseline
    assert baseline.batch_losses == [1.0] * 3 and baseline.batch_seconds == [1.0] * 3  # mean loss, max seconds
    pruned = [o for o in synced.stage1.samples if o.status is SampleStatus.PRUNED]
    assert pruned and all(o.batch_seconds[0] == 2.0 - seconds_of(o.plan) for o in pruned)
    assert any(r.stage is Stage.DISTRIBUTED and "2 ranks agreed" in r.reason for r in records)


def test_a_plan_that_fails_on_this_rank_fails_on_every_rank_and_the_search_goes_on():
    def run_epoch(plan):
        if str(plan) == "0f0":
            raise PlanFailedError("RuntimeError: no bf16 kernel")
        yield 1.0, 1.0

    evaluator = SyncedEvaluator(FunctionEvaluator(run_epoch=run_epoch, time_step=lambda plan: 1.0,
                                                  check_loss=lambda plan, batches: 1.0), MirroredRanks())
    decision = run_search(SPACE, evaluator, CONFIG)
    failed = [o for o in decision.stage1.samples if o.status is SampleStatus.ERROR]
    assert [str(o.plan) for o in failed] == ["0f0"] and "no bf16 kernel" in failed[0].reason


def test_an_error_that_is_not_the_plans_stops_the_search():
    def run_epoch(plan):
        if str(plan) != "111":
            raise KeyError("a bug in the evaluator")
        yield 1.0, 1.0

    with pytest.raises(KeyError):
        run_search(SPACE, FunctionEvaluator(run_epoch=run_epoch), CONFIG)


def test_per_device_allocation_runs_through_the_interface_alone():
    # one rank; low ops halve activation bytes; the budget leaves room for one FP32 Stage-1 op
    nbytes = {"0": 10, "1": 20, "f": 0}
    activation_bytes = lambda plan: sum(nbytes[c] for c in str(plan))  # noqa: E731
    # this rank's own timing, as the allocator sees it: a device where low precision costs time
    slow_low = FunctionEvaluator(time_step=lambda plan: 1.0 + 0.25 * str(plan).count("0"))
    strategy = PerDeviceAllocation(RankContext(), model=None, optimizer=None, space=SPACE, local=slow_low,
                                   activation_bytes=activation_bytes, memory_budget=30, threshold=1.01,
                                   check_batches=2)
    records = []
    decision = run_search(SPACE, fake_evaluator(), CONFIG, report=records.append, strategy=strategy)
    assert str(decision.stage1.best.plan) == "0f0"  # the search's own evaluator favours low precision
    # the fastest plans within 30 bytes keep one op low; the earlier wins the tie, and giving its last
    # low op back to FP32 would need 40 bytes
    assert str(decision.plan) == "0f1" and activation_bytes(decision.plan) <= 30
    assert any("per-device plans" in r.reason for r in records if r.stage is Stage.DISTRIBUTED)


def test_per_device_plans_that_fail_the_loss_check_fall_back_to_the_shared_plan():
    local = fake_evaluator()
    diverging = FunctionEvaluator(run_epoch=local.run_epoch, time_step=seconds_of,
                                  check_loss=lambda plan, batches: math.nan if str(plan) == "1f1" else 1.0)
    strategy = PerDeviceAllocation(RankContext(), model=None, optimizer=None, space=SPACE, local=local,
                                   activation_bytes=lambda plan: str(plan).count("0"), memory_budget=0,
                                   threshold=1.01, check_batches=2)  # only the all-FP32 plan fits 0 bytes
    records = []
    decision = run_search(SPACE, diverging, CONFIG, report=records.append, strategy=strategy)
    assert str(decision.stage1.best.plan) == "0f0"
    assert str(decision.plan) == "0f0"  # the shared plan: the allocation's 1f1 failed its loss check
    assert any("failed the loss check" in r.reason for r in records)


def test_replaying_evaluator_serves_logged_samples_and_runs_the_rest():
    log = SearchLog()
    log.append(SampleRecord(Stage.STAGE1, "111", SampleStatus.ACCEPTED, extra={BATCHES: [[1.0, 1.0]] * 3}))
    log.append(SampleRecord(Stage.STAGE1, "0f0", SampleStatus.ERROR, reason="RuntimeError: logged failure"))
    calls = []
    decision = run_search(SPACE, ReplayingEvaluator(fake_evaluator(calls), Replay(log.records)), CONFIG)
    assert "111" not in calls and "0f0" not in calls  # both served from the log
    by_plan = {str(o.plan): o for o in decision.stage1.samples}
    assert by_plan["0f0"].status is SampleStatus.ERROR and "logged failure" in by_plan["0f0"].reason
    assert calls  # the plans the log lacks ran live


def test_a_function_evaluator_without_a_measurement_says_which_one():
    with pytest.raises(SearchError, match="no time_step"):
        FunctionEvaluator().time_step(Assignment.parse("1"))


def test_single_process_strategy_keeps_the_checked_plan():
    plan = Assignment.parse("0f1")
    assert SINGLE_PROCESS.decide(plan, stage1=None, evaluator=None, report=print) is plan
