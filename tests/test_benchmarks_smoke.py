"""Smoke tests for benchmarks/: every model's small config in every mode, the measurements, the runner.

compfx mode runs only where ``compfx.optimize`` imports; otherwise those cases
are skipped with the reason (and the runner's own "not available" path is tested).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import data, modes
from benchmarks.casts import count_forward_casts
from benchmarks.harness import RunOptions, run_benchmark
from benchmarks.models import MODELS, get_spec
from benchmarks.paper_figures import PAPER_ROWS
from benchmarks.report import attach_paper_figures
from benchmarks.run import main
from compfx.memory import saved_storages

COMPFX_STATUS = modes.compfx_status()
# The smallest search that still runs both stages, so the smoke test stays fast.
TINY_SEARCH = dict(stage1_budget=1, stage2_budget=1, repeats=1, warmup=0, stage2_check_batches=0)
SMOKE = RunOptions(device="cpu", epochs=1, batches=1, search=TINY_SEARCH)


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


# -- the registry ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_spec_has_small_and_paper_configs_and_a_loss(name):
    spec = get_spec(name)
    config = spec.config("small")
    model = spec.build(config)
    batch = spec.example_batch(config, config["batch_size"], torch.Generator().manual_seed(0))
    loss = spec.loss_fn(model(*batch[:-1]), batch)
    assert {"small", "paper"} <= set(spec.configs)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert spec.real_data, "every model names the real data it reads"


def test_paper_rows_of_specs_exist_in_the_paper_table():
    claimed = {row for spec in MODELS.values() for row in spec.paper_rows.values()}
    assert claimed <= set(PAPER_ROWS)
    assert {model for model, _ in claimed} >= {"AlexNet", "Vgg16", "GAN", "GCN", "GAT", "BERT-base"}


# -- every model x mode -----------------------------------------------------------
def _check_row(row: dict) -> None:
    assert row["status"] == "ok", row.get("error")
    assert row["time_per_epoch_s"] > 0 and math.isfinite(row["final_train_loss"])
    assert row["saved_activation_bytes"] > 0
    assert 0.0 <= row["metric"] <= 1.0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_small_config_runs_in_fp32_and_amp(name):
    fp32 = run_benchmark(get_spec(name), "small", "fp32", SMOKE)
    amp = run_benchmark(get_spec(name), "small", "amp", SMOKE)
    _check_row(fp32)
    _check_row(amp)
    assert fp32["casts_forward"] == 0  # the models themselves never cast
    assert amp["casts_forward"] > 0  # autocast does
    assert amp["low_dtype"] == "bfloat16"  # CPU default


@pytest.mark.parametrize("name", sorted(MODELS))
def test_small_config_runs_in_compfx_mode(name):
    if COMPFX_STATUS != "available":
        pytest.skip(f"compfx mode {COMPFX_STATUS}")
    row = run_benchmark(get_spec(name), "small", "compfx", SMOKE)
    _check_row(row)
    assert 0 < row["search_share"] < 1
    assert sum(sum(counts.values()) for counts in row["plan"].values()) > 0
    assert all(set(counts) == {"low", "fp32", "follow"} for counts in row["plan"].values())
    assert row["search"].keys() == row["plan"].keys()
    assert all(figures["search_fp32_epochs"] > 1 for figures in row["search"].values())  # the FP32 epoch, at least
    assert row["casts_graph"] >= 0 and row["casts_graph_counter"]


def test_compfx_mode_reports_not_available_instead_of_crashing(monkeypatch):
    def missing():
        raise ImportError("no compfx.optimize in this checkout")

    monkeypatch.setattr(modes, "load_compfx", missing)
    row = run_benchmark(get_spec("gcn"), "small", "compfx", SMOKE)
    assert row["status"].startswith("not available") and "no compfx.optimize" in row["status"]


# -- memory: measured with saved-tensor hooks ----------------------------------------
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 16), cols=st.integers(1, 16))
def test_saved_bytes_are_the_unique_storages_autograd_keeps(rows, cols):
    x = torch.randn(rows, cols, requires_grad=True)
    with saved_storages() as saved:
        y = torch.sigmoid(x)  # saves its output only
        z = y * y  # saves y twice: one storage, counted once
    z.sum().backward()
    assert saved.total_bytes == rows * cols * 4
    assert saved.resident_bytes == 0


def test_parameter_storages_are_counted_apart_from_activations():
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with saved_storages(linear.parameters()) as saved:
        linear(x).sum().backward()
    assert saved.resident_bytes == linear.weight.numel() * 4  # addmm saves the weight, not the bias
    assert saved.activation_bytes == x.numel() * 4


@pytest.mark.parametrize("name", ["alexnet_cifar", "gpt", "gcn"])
def test_all_low_saves_fewer_activation_bytes_than_fp32(name):
    spec = get_spec(name)
    config = spec.config("small")
    torch.manual_seed(0)
    model = spec.build(config)
    batch = spec.example_batch(config, config["batch_size"], torch.Generator().manual_seed(0))

    def saved_activation_bytes(forward, precision=None):
        with saved_storages([*model.parameters(), *model.buffers()]) as saved:
            with precision or torch.autocast("cpu", enabled=False):
                loss = spec.loss_fn(forward(*batch[:-1]), batch)
        loss.backward()
        return saved.activation_bytes

    fp32 = saved_activation_bytes(model)
    assert saved_activation_bytes(model, _bf16_autocast()) < fp32
    apply_module = pytest.importorskip("compfx.planned_module")
    import compfx

    analysis = compfx.analyze(model, batch[:-1], low_dtype=torch.bfloat16)
    all_low = apply_module.apply(model, compfx.Plan.uniform(analysis, "low"), analysis=analysis)
    assert saved_activation_bytes(all_low) < fp32


# -- casts ---------------------------------------------------------------------------
def test_cast_counter_counts_autocast_casts_of_a_linear():
    linear, x = nn.Linear(4, 2), torch.randn(3, 4)
    assert count_forward_casts(linear, (x,), _bf16_autocast) == 3  # input, weight, bias to bf16
    assert count_forward_casts(linear, (x,), lambda: torch.autocast("cpu", enabled=False)) == 0


def test_cast_counter_agrees_with_the_project_counter_when_present():
    passes = pytest.importorskip("compfx.passes")
    spec = get_spec("bert_squad")
    config = spec.config("small")
    model = spec.build(config)
    batch = spec.example_batch(config, 2, torch.Generator().manual_seed(0))
    ours = count_forward_casts(model, batch[:-1], _bf16_autocast)
    assert ours == passes.count_autocast_casts(model, batch[:-1], dtype=torch.bfloat16, device_type="cpu") > 0


# -- data ----------------------------------------------------------------------------
def test_span_qa_target_points_at_the_question_text_in_the_context():
    ids, spans = data.span_qa_batches(seq_len=48, batch_size=6, n_batches=1, seed=3)[0]
    for row, (start, end) in zip(ids, spans.tolist()):
        answer = row[start:end + 1]
        assert torch.equal(row[:len(answer)], answer)  # the question is the answer's text
        assert row[8] == 1  # separator after the 8-token question


def test_char_lm_targets_are_the_inputs_shifted_by_one():
    ids, targets = data.char_lm_batches(seq_len=16, batch_size=3, n_batches=1)[0]
    assert torch.equal(ids[:, 1:], targets[:, :-1]) and int(ids.max()) < data.VOCAB_SIZE


def test_graphs_are_symmetric_and_splits_are_disjoint():
    for graph in (data.karate_graph(), data.block_model_graph(70, 7, 5, seed=1)):
        x, adjacency, train_target = data.graph_batch(graph, "train")
        _, _, eval_target = data.graph_batch(graph, "eval")
        assert torch.allclose(adjacency, adjacency.T) and (adjacency.diagonal() > 0).all()
        assert ((train_target == data.IGNORE_INDEX) != (eval_target == data.IGNORE_INDEX)).all()
    assert len(data.karate_graph().labels) == 34


def test_train_and_eval_digits_do_not_overlap():
    train, _ = data.digits("train")
    held_out, _ = data.digits("eval")
    assert len(train) + len(held_out) == 1797
    assert not any(torch.equal(train[i], held_out[0]) for i in range(len(train)))


# -- the runner and its report -----------------------------------------------------------
def test_runner_writes_json_and_markdown(tmp_path):
    code = main(["--models", "gcn", "gat", "--modes", "fp32", "amp", "--epochs", "2", "--batches", "1",
                 "--device", "cpu", "--out", str(tmp_path)])
    [folder] = tmp_path.iterdir()
    result = json.loads((folder / "small-real.json").read_text())
    markdown = (folder / "small-real.md").read_text()
    assert code == 0
    assert [(row["model"], row["mode"]) for row in result["rows"]] == [
        ("gcn", "fp32"), ("gcn", "amp"), ("gat", "fp32"), ("gat", "amp")]
    assert all(len(row["epoch_seconds"]) == 2 for row in result["rows"])
    assert "| gcn" in markdown and "paper s/epoch A100" in markdown


def test_cpu_clock_times_one_thread_and_says_so(tmp_path):
    threads = torch.get_num_threads()
    try:
        code = main(["--models", "gcn", "--modes", "fp32", "--epochs", "2", "--batches", "1", "--device", "cpu",
                     "--threads", "1", "--clock", "cpu", "--no-casts", "--out", str(tmp_path)])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    [folder] = tmp_path.iterdir()
    result = json.loads((folder / "small-real.json").read_text())
    assert code == 0 and result["meta"]["options"]["clock"] == "cpu" and result["meta"]["threads"] == 1
    assert all(seconds > 0 for seconds in result["rows"][0]["epoch_seconds"])
    assert "process CPU time" in (folder / "small-real.md").read_text()
    with pytest.raises(ValueError, match="threads=1"):
        RunOptions(clock="cpu", threads=2)
    with pytest.raises(ValueError, match="clock"):
        RunOptions(clock="sundial")


def test_paper_figures_sit_beside_matching_paper_config_rows_only():
    paper = attach_paper_figures({"model": "vgg16_cifar", "config": "paper", "mode": "amp"})["paper"]
    small = attach_paper_figures({"model": "vgg16_cifar", "config": "small", "mode": "amp"})["paper"]
    assert paper["time_a100_s"] == 5.08 and paper["peak_memory_mb"] == 813.91 and paper["accuracy_pct"] == 70.88
    assert small is None
    assert attach_paper_figures({"model": "gpt", "config": "paper", "mode": "fp32"})["paper"] is None


def test_verify_cost_measures_the_check_in_seconds_and_fp32_steps(tmp_path, capsys):
    from benchmarks.verify_cost import main as verify_cost

    out = tmp_path / "verify_cost.json"
    assert verify_cost(["--tiny", "--rounds", "1", "--steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rounds"] == 1 and result["per_round"][0]["exact"]
    assert result["verification"]["median"] > 0 and result["fp32_step"]["median"] > 0
    assert math.isclose(result["verification_in_steps"]["median"],
                        result["per_round"][0]["verification"] / result["per_round"][0]["fp32_step"])
    assert "FP32 steps" in capsys.readouterr().out


def test_compile_depth_writes_its_figures_and_the_regions_compile_as_many_graphs_at_each_depth(tmp_path):
    from benchmarks.compile_depth import main as compile_depth

    assert compile_depth(["--layers", "2", "3", "--inner", "aot_eager", "--steps", "1", "--rounds", "1",
                          "--search-budget", "2", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "compile_depth.json").read_text())
    shallow, deep = result["rows"]
    assert shallow["stage1"]["tied"]["samples"] == deep["stage1"]["tied"]["samples"]
    assert shallow["stage1"]["untied"]["decisions"] < deep["stage1"]["untied"]["decisions"]
    assert shallow["compile"]["regions"]["amp"]["graphs"] == deep["compile"]["regions"]["amp"]["graphs"]
    for row in result["rows"]:  # the compiled searches ran, by regions, and torch's timers counted their compiles
        assert all(row["compiled_search"][name]["programs"] >= 2 for name in ("tied", "untied"))
        assert all(row["compiled_search"][name]["torch_timers"] > 0 for name in ("tied", "untied"))
    assert set(result["search_deepest_over_shallowest"]) == {"tied", "untied"} and len(result["load_average_end"]) == 3
    table = (tmp_path / "compile_depth.md").read_text()
    assert "| 3 |" in table and "compiled search by regions, tied blocks" in table
