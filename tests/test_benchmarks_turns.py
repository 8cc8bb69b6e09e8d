"""The benchmark runner's modes take turns: one step each per batch, in rotating order, each with its own random
state, each step timed on its own and compared with FP32's step on the same batch.

The models here are tiny specs of the test's own (an MLP with dropout, on synthetic batches): a spec's ``build``
and ``train_step`` are where a test records what the runner did.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import torch
import torch.nn as nn

from benchmarks.harness import RunOptions, load_batches, run_benchmark, run_modes
from benchmarks.models.spec import ModelSpec, cross_entropy, supervised_step
from benchmarks.modes import compfx_status
from benchmarks.run import TIMING, main

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

CONFIG = {"batch_size": 4, "features": 8, "classes": 3}
OPTIONS = RunOptions(device="cpu", epochs=2, batches=3, data="synthetic", count_casts=False)
# The smallest search that still runs both stages (as in test_benchmarks_smoke.py).
TINY_SEARCH = dict(stage1_budget=1, stage2_budget=1, repeats=1, warmup=0, stage2_check_batches=0)


def _mlp_with_dropout(config) -> nn.Module:
    return nn.Sequential(nn.Linear(config["features"], 16), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(16, config["classes"]))


def _example_batch(config, batch_size: int, generator: torch.Generator):
    return (torch.randn(batch_size, config["features"], generator=generator),
            torch.randint(0, config["classes"], (batch_size,), generator=generator))


def _no_real_data(*_):
    raise AssertionError("these tests train on synthetic batches only")


TINY = ModelSpec(name="tiny_dropout", description="an MLP with dropout", configs={"small": CONFIG, "paper": CONFIG},
                 build=_mlp_with_dropout, example_batch=_example_batch, real_batches=_no_real_data,
                 loss_fn=cross_entropy, real_data="none")


class BuiltModels:
    """A spec's ``build`` that keeps every model it builds, in order (one per mode prepared)."""

    def __init__(self):
        self.models: list[nn.Module] = []

    def __call__(self, config) -> nn.Module:
        model = _mlp_with_dropout(config)
        self.models.append(model)
        return model


class StepLog:
    """A spec's ``train_step`` that records which mode trained on which batch, then trains as usual."""

    def __init__(self, spec: ModelSpec, options: RunOptions):
        batches = load_batches(spec, spec.config("small"), options, "train", torch.device("cpu"))
        self.batch_index = {self._key(batch): index for index, batch in enumerate(batches)}
        self.steps: list[tuple[str, int]] = []

    @staticmethod
    def _key(batch) -> float:
        return float(batch[0][0, 0])  # every mode loads the same seeded batches: equal values, equal batch

    def __call__(self, spec, nets, optimizers, batch, precision) -> torch.Tensor:
        self.steps.append((precision.mode, self.batch_index[self._key(batch)]))
        return supervised_step(spec, nets, optimizers, batch, precision)


class FailsOnStep:
    """A spec's ``train_step`` that raises on ``mode``'s ``step``-th step (counting from 1: the measured step)."""

    def __init__(self, mode: str, step: int):
        self.mode, self.step, self.count = mode, step, 0

    def __call__(self, spec, nets, optimizers, batch, precision) -> torch.Tensor:
        if precision.mode == self.mode:
            self.count += 1
            if self.count == self.step:
                raise RuntimeError(f"{self.mode} fails on its step {self.step}")
        return supervised_step(spec, nets, optimizers, batch, precision)


# -- the turns ------------------------------------------------------------------------------------------
def test_every_batch_runs_all_modes_before_the_next_and_the_order_rotates():
    if compfx_status() != "available":
        pytest.skip(f"compfx mode {compfx_status()}")
    modes = ["fp32", "amp", "compfx"]
    options = dataclasses.replace(OPTIONS, search=TINY_SEARCH)
    log = StepLog(TINY, options)
    rows = run_modes(dataclasses.replace(TINY, train_step=log), "small", modes, options)
    assert [row["status"] for row in rows] == ["ok"] * 3, [row.get("error") for row in rows]
    measured, turns = log.steps[:len(modes)], log.steps[len(modes):]
    assert measured == [(mode, 0) for mode in modes]  # each mode's measured step, as it is prepared
    batches = OPTIONS.batches
    assert len(turns) == OPTIONS.epochs * batches * len(modes)
    for turn in range(OPTIONS.epochs * batches):
        steps = turns[turn * len(modes):(turn + 1) * len(modes)]
        assert {index for _, index in steps} == {turn % batches}, f"turn {turn} mixes batches: {steps}"
        assert [mode for mode, _ in steps] == [modes[(turn + i) % len(modes)] for i in range(len(modes))]
    firsts = {turns[turn * len(modes)][0] for turn in range(OPTIONS.epochs * batches)}
    assert firsts == set(modes), "every mode goes first in some turn"


def test_a_mode_trained_in_turns_ends_with_the_weights_it_has_trained_alone():
    # Dropout draws from torch's CPU generator: a mode taking turns draws it as it would alone only if its own
    # random state is swapped in around its steps.
    def trained(modes: list[str]) -> list[dict]:
        built = BuiltModels()
        rows = run_modes(dataclasses.replace(TINY, build=built), "small", modes, OPTIONS)
        assert [row["status"] for row in rows] == ["ok"] * len(modes), [row.get("error") for row in rows]
        return [model.state_dict() for model in built.models]

    fp32_alone, amp_alone = trained(["fp32"]) + trained(["amp"])
    fp32_in_turns, amp_in_turns = trained(["fp32", "amp"])
    for alone, in_turns in ((fp32_alone, fp32_in_turns), (amp_alone, amp_in_turns)):
        assert alone.keys() == in_turns.keys()
        assert all(torch.equal(alone[name], in_turns[name]) for name in alone)


def test_a_mode_that_fails_gets_an_error_row_and_the_others_train():
    # amp fails on its measured step (while prepared), then on its third step (while taking turns)
    for failing_step, modes in ((1, ["fp32", "amp"]), (3, ["amp", "fp32"])):
        spec = dataclasses.replace(TINY, train_step=FailsOnStep("amp", failing_step))
        rows = {row["mode"]: row for row in run_modes(spec, "small", modes, OPTIONS)}
        assert rows["amp"]["status"] == "error" and f"step {failing_step}" in rows["amp"]["error"]
        assert "time_per_epoch_s" not in rows["amp"]
        assert rows["fp32"]["status"] == "ok"
        assert [len(steps) for steps in rows["fp32"]["step_seconds"]] == [OPTIONS.batches] * OPTIONS.epochs


def test_compfx_without_a_plan_for_its_network_is_an_error_row_beside_ok_rows():
    if compfx_status() != "available":
        pytest.skip(f"compfx mode {compfx_status()}")
    options = dataclasses.replace(OPTIONS, plans={"another_network": {}})
    fp32, compfx = run_modes(TINY, "small", ["fp32", "compfx"], options)
    assert compfx["status"] == "error" and "no plan given for network 'model'" in compfx["error"]
    assert fp32["status"] == "ok" and fp32["modes_in_turns"] == ["fp32"]


# -- what a row says about its steps ----------------------------------------------------------------------
def test_rows_give_their_steps_and_the_per_batch_ratio_to_fp32_with_its_interval():
    options = dataclasses.replace(OPTIONS, batches=5)
    fp32, amp = run_modes(TINY, "small", ["fp32", "amp"], options)
    for row in (fp32, amp):
        assert row["status"] == "ok", row.get("error")
        assert [len(steps) for steps in row["step_seconds"]] == [5, 5]
        assert row["epoch_seconds"] == [sum(steps) for steps in row["step_seconds"]]
        assert row["time_per_epoch_s"] == row["epoch_seconds"][1]  # the epochs after the first
        assert row["step_median_s"] == statistics.median(row["step_seconds"][1])
        assert row["modes_in_turns"] == ["fp32", "amp"]
    assert "time_vs_fp32" not in fp32
    ratio = amp["time_vs_fp32"]
    # pairs: AMP's and FP32's steps on the same batch of the same (steady) epoch
    expected = statistics.median(a / f for a, f in zip(amp["step_seconds"][1], fp32["step_seconds"][1]))
    assert ratio["pairs"] == 5 and ratio["median"] == expected
    assert ratio["low"] <= ratio["median"] <= ratio["high"] and 0 < ratio["coverage"] <= 1


def test_one_mode_alone_is_turns_with_one_participant():
    row = run_benchmark(TINY, "small", "fp32", OPTIONS)
    assert row["status"] == "ok" and row["modes_in_turns"] == ["fp32"] and "time_vs_fp32" not in row
    assert [len(steps) for steps in row["step_seconds"]] == [OPTIONS.batches] * OPTIONS.epochs


def test_the_runner_says_the_modes_took_turns_and_tables_the_interval(tmp_path):
    code = main(["--models", "gcn", "--modes", "fp32", "amp", "--batches", "1", "--device", "cpu", "--no-casts",
                 "--out", str(tmp_path)])
    [folder] = tmp_path.iterdir()
    result = json.loads((folder / "small-real.json").read_text())
    fp32, amp = result["rows"]
    assert code == 0 and result["meta"]["timing"] == TIMING
    ratio = amp["time_vs_fp32"]
    assert f"{ratio['median']:.2f}x ({ratio['low']:.2f}-{ratio['high']:.2f})" in (folder / "small-real.md").read_text()
