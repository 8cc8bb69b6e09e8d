"""Resume: a search interrupted at any sample and resumed from its log picks the plan of an uninterrupted run.

Costs are injected (``cost_fn`` ignores the measured seconds), so two runs with
the same samples make the same decisions; the resumed run must reach them while
re-running only the samples the log lacks.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from compfx import SearchConfig, optimize
from compfx.errors import PlanFileError, PlanMismatchError
from compfx.search.compare import AFTER_THE_SEARCH
from compfx.search.log import DUEL, SearchLog
from compfx.search.session import COMPARE_ROUNDS
from compfx.vocabulary import Stage
from tests.helpers import EXACT, nll
from tests.test_reliability import BATCHES, setup

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def costs(salt: int):
    """A deterministic, arbitrary cost per plan (so that any plan can win), constant in the seconds."""
    def cost_fn(plan, seconds):
        key = "".join(p[0] for p in plan.values()) + str(salt)
        return 1.0 + zlib.crc32(key.encode()) % 97 / 10

    return cost_fn


def config(salt: int, prune: bool) -> SearchConfig:
    return SearchConfig(cost_fn=costs(salt), prune=prune, progress=False, warmup=0, repeats=1,
                        stage2_check_batches=1, threshold=1.5, **EXACT)


def counting(stop_at: int | None = None):
    calls = []

    def loss_fn(output, batch):
        calls.append(1)
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        return nll(output, batch)

    return loss_fn, calls


def state(model):
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def loss_calls(record) -> int:
    """``loss_fn`` calls the search made for one logged record (``warmup=0``, ``repeats=1``, one check batch): a
    sample's, or a duel's (two plans, one step each per round; none for the rounds that were the two plans' epochs,
    taking turns)."""
    if DUEL in record.extra:
        duel = record.extra[DUEL]
        return 2 * (len(duel["seconds"][0]) - duel.get("epoch_pairs", 0))
    return record.batches if record.stage is Stage.STAGE1 else 1


def comparison_calls(result, config: SearchConfig, *, blocks: int | None = None) -> int:
    """``loss_fn`` calls of the report's step comparison after the search (of its first ``blocks`` blocks): each
    distinct plan's rounds, and a warm-up step per block of them (none where it was read off the first duel). How
    many blocks it takes depends on the timings, not on the injected costs."""
    block = max(config.decision.rounds, COMPARE_ROUNDS)
    rounds = [len(r.extra["round_seconds"]) for r in result.log.samples(Stage.COMPARE)
              if r.status == "accepted" and r.extra.get("phase") == AFTER_THE_SEARCH]
    return sum(n + n // block for n in (rounds if blocks is None else [min(n, blocks * block) for n in rounds]))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(salt=st.integers(0, 1000), prune=st.booleans(), where=st.floats(0.0, 1.0))
@example(salt=928, prune=False, where=0.25)  # interrupted after the FP32 baseline, which then won Stage 1
@example(salt=0, prune=False, where=1.0)  # interrupted in the step comparison: every sample is replayed
def test_resumed_search_picks_the_plan_of_an_uninterrupted_one(tmp_path_factory, salt, prune, where):
    path = tmp_path_factory.mktemp("resume") / "search.jsonl"
    model, opt, loader = setup()
    loss_fn, calls = counting()
    straight = optimize(model, loader, loss_fn=loss_fn, optimizer=opt, config=config(salt, prune))
    total = len(calls)

    # call 1 is the input check: interrupt anywhere after it, up to the comparison's first block (which every run
    # takes)
    reached = total - comparison_calls(straight, config(salt, prune)) + comparison_calls(straight, config(salt, prune),
                                                                                         blocks=1)
    stop_at = 2 + int(where * (reached - 2))
    model, opt, loader = setup()
    loss_fn, _ = counting(stop_at)
    with pytest.raises(KeyboardInterrupt):
        optimize(model, loader, loss_fn=loss_fn, optimizer=opt, config=config(salt, prune), log=path)
    logged = [r for r in SearchLog.read(path).records if r.stage in (Stage.STAGE1, Stage.STAGE2, Stage.CHECK)
              and (r.is_sample or DUEL in r.extra)]

    loss_fn, resumed_calls = counting()
    resumed = optimize(model, loader, loss_fn=loss_fn, optimizer=opt, config=config(salt, prune), log=path,
                       resume=True)
    assert resumed.plan == straight.plan
    assert resumed.stage1_plan == straight.stage1_plan
    # the model holds the Stage-1 winner's trained state, as after the uninterrupted run: a winner served from
    # the log has no state of its own, so its epoch is trained again (BATCHES more calls)
    assert all(torch.equal(a, b) for a, b in zip(state(resumed.module), state(straight.module)))
    winner = resumed.stage1_plan.bitstring(resumed.analysis)
    retrained = BATCHES if any(r.is_sample and r.stage is Stage.STAGE1 and r.plan == winner for r in logged) else 0
    # logged samples were replayed, not run again; every other sample ran once, as in the uninterrupted run. The
    # report's step comparison is timed again (its blocks depend on the timings, not on the injected costs).
    searched = len(resumed_calls) - comparison_calls(resumed, config(salt, prune))
    assert searched == total - comparison_calls(straight, config(salt, prune)) - sum(map(loss_calls, logged)) \
        + retrained
    # (the incumbent's epoch again, taking turns with a candidate's, is another sample of it by design)
    samples = [(r.stage, r.plan) for r in SearchLog.read(path).samples()
               if r.stage is not Stage.COMPARE and not r.reason.startswith("the incumbent, its epoch again")]
    duels = [(d["incumbent"], d["candidate"]) for d in (r.extra.get(DUEL) for r in SearchLog.read(path).notes()) if d]
    assert len(samples) == len(set(samples)) and len(duels) == len(set(duels))  # no sample or duel logged twice


def _interrupted_log(tmp_path, stop_at=6):
    path = tmp_path / "search.jsonl"
    model, opt, loader = setup()
    loss_fn, _ = counting(stop_at)
    with pytest.raises(KeyboardInterrupt):
        optimize(model, loader, loss_fn=loss_fn, optimizer=opt, config=config(0, True), log=path)
    return path


def test_a_last_line_cut_short_by_a_crash_is_dropped_on_resume(tmp_path):
    path = _interrupted_log(tmp_path)
    complete = len(SearchLog.read(path).records)
    with open(path, "a") as file:
        file.write('{"stage": "stage1", "bitstr')  # killed mid-write
    with pytest.raises(PlanFileError, match=f"line {complete + 1}"):
        SearchLog.read(path)  # reading is strict; resuming drops the unfinished line
    model, opt, loader = setup()
    resumed = optimize(model, loader, loss_fn=nll, optimizer=opt, config=config(0, True), log=path, resume=True)
    assert len(SearchLog.read(path).records) == len(resumed.log.records)  # every line parses again


def test_a_damaged_line_inside_the_log_names_the_file_and_line(tmp_path):
    path = _interrupted_log(tmp_path)
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:10]
    path.write_text("\n".join(lines) + "\n")
    model, opt, loader = setup()
    with pytest.raises(PlanFileError, match="line 2") as error:
        optimize(model, loader, loss_fn=nll, optimizer=opt, config=config(0, True), log=path, resume=True)
    assert str(path) in str(error.value) and error.value.__cause__ is not None


def test_resuming_the_log_of_another_model_or_other_settings_is_refused(tmp_path):
    path = _interrupted_log(tmp_path)
    before = path.read_text()
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))
    _, _, loader = setup()
    with pytest.raises(PlanMismatchError, match="another model"):
        optimize(other, loader, loss_fn=F.cross_entropy and (lambda out, b: F.cross_entropy(out, b[-1])),
                 optimizer=torch.optim.SGD(other.parameters(), 0.1), config=config(0, True), log=path, resume=True)
    model, opt, loader = setup()
    with pytest.raises(PlanMismatchError, match="threshold"):
        optimize(model, loader, loss_fn=nll, optimizer=opt, log=path, resume=True,
                 config=SearchConfig(cost_fn=costs(0), progress=False, warmup=0, repeats=1, stage2_check_batches=1,
                                     threshold=1.2, **EXACT))
    assert path.read_text() == before  # a refused resume leaves the log alone


def test_resume_without_a_log_file_starts_a_fresh_search(tmp_path):
    model, opt, loader = setup()
    result = optimize(model, loader, loss_fn=nll, optimizer=opt, config=config(0, True),
                      log=tmp_path / "new.jsonl", resume=True)
    assert SearchLog.read(tmp_path / "new.jsonl").samples("stage1")[0].plan == "1" * len(result.plan)


def test_the_log_syncs_to_disk_what_a_resumed_search_would_otherwise_measure_again(tmp_path, monkeypatch):
    import compfx.search.log as log_module
    from compfx.search.log import DUEL, SampleRecord, SearchLog
    from compfx.vocabulary import SampleStatus, Stage

    synced = []
    monkeypatch.setattr(log_module.os, "fsync", lambda fd: synced.append(fd))
    log = SearchLog.open(tmp_path / "search.jsonl", {"fingerprint": "x"})
    log.note(Stage.STAGE1, "a note")
    log.append(SampleRecord(Stage.STAGE1, "01", SampleStatus.SKIPPED, reason="predicted not to win"))
    assert synced == []  # written and flushed (a killed process keeps them), not worth a disk sync each
    log.append(SampleRecord(Stage.STAGE1, "01", SampleStatus.ACCEPTED, loss=1.0, seconds=2.0, batches=4))
    log.note(Stage.STAGE1, "duel", **{DUEL: {"seconds": [[1.0], [1.0]]}})
    assert len(synced) == 2
    log.append(SampleRecord(Stage.COMPARE, "01", SampleStatus.ACCEPTED, seconds=0.5))  # timed again on resume
    assert len(synced) == 2
    log.close()
    assert len((tmp_path / "search.jsonl").read_text().splitlines()) == 5
