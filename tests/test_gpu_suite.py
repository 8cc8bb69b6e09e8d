"""The GPU suite cannot rot between GPU runs: its smoke run (CPU, tiny shapes) goes through the same code, the
results merge across runs, a row that overruns is stopped, and the README's GPU section is what the committed
results generate."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_readme
from benchmarks.gpu_bench import Settings, Task, _fitting, needs_run, run_groups, suite_groups
from benchmarks.gpu_report import NO_GPU_YET, RUN_COMMANDS, fp8_text, readme_section, summary_lines
from benchmarks.gpu_suite import _junit_counts
from benchmarks.timebox import Boxed, CpuClock, run_boxed
from compfx.float8 import torchao_missing

ROOT = Path(__file__).resolve().parent.parent
#: The smoke run takes about a CPU minute (60 s wall at a load of 4 on two cores, 330 s at 6 beside other test
#: runs). Its own limits, and this one, count CPU seconds (CpuClock), so a machine loaded by other jobs makes it
#: slower, never nearer a limit; a fifth of the wall seconds counts at the least, so a hang ends after 25 minutes.
SMOKE_LIMIT_CPU_S = 300


def _suite(*args, limit_cpu_s=SMOKE_LIMIT_CPU_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    clock = CpuClock(floor=0.2)
    process = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu_suite", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        try:
            stdout, stderr = process.communicate(timeout=1)  # no output is lost when it is asked again
            return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            if clock() >= limit_cpu_s:
                process.kill()
                stdout, stderr = process.communicate()
                pytest.fail(f"the GPU suite's smoke run used {limit_cpu_s} CPU s without ending:\n"
                            f"{stdout[-3000:]}{stderr[-3000:]}")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-suite")
    done = _suite("--smoke", "--out", str(out))
    [folder] = [path for path in out.iterdir() if path.is_dir()]
    return done, out, folder


def test_smoke_run_writes_json_and_markdown_with_fp32_amp_and_compfx_rows(smoke):
    done, _, folder = smoke
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = json.loads((folder / "gpu-suite-smoke.json").read_text())
    rows = state["bench"]["rows"]
    assert state["smoke"] is True and state["device_name"] and state["slug"] == folder.name
    assert {"torch", "python", "device_name", "matmul_probe"} <= set(state["environment"])
    assert state["environment"]["matmul_probe"]["bfloat16"]["tflops"] > 0
    for model in ("alexnet_cifar", "bert_squad"):
        for mode in ("fp32", "amp-fp16", "amp-bf16", "compfx-fp16"):
            row = rows[f"{model}/{mode}"]
            assert row["status"] == "ok", row.get("error")
            assert row["steps_per_s"] > 0 and row["flops_per_step"] > 0 and row["mfu_pct"] > 0
    searched = rows["bert_squad/compfx-fp16"]
    assert searched["search_s"] > 0 and 0 < searched["search_share_100_epochs"] < 1 and searched["plans"]
    assert rows["alexnet_cifar/compfx-fp16+compile"]["plans"] == rows["alexnet_cifar/compfx-fp16"]["plans"]
    assert rows["bert_squad/amp-fp16"]["casts_forward"] > 0 and rows["bert_squad/fp32"]["casts_forward"] == 0
    assert state["cuda_tests"]["status"] == "passed" and state["cuda_tests"]["skipped"] > 0
    assert state["environment"]["status"] == "ok"
    fp8 = state["fp8"]  # part 4: emulated on the CPU, and saying so; skipped, not failed, without torchao
    if torchao_missing():
        assert fp8 == {"status": "skipped", "why": torchao_missing(), "run": 1}
        assert "skipped: torchao not installed" in (folder / "gpu-suite-smoke.md").read_text()
        return
    assert fp8["status"] == "ok", fp8.get("output_tail")
    assert fp8["times_mean_nothing"] is True and {name: row["how"] for name, row in fp8["rows"].items()} == {
        "bf16 AMP (eager)": "eager", "bf16 AMP (compiled)": "compiled (aot_eager)",
        "torchao float8 (all linears) + bf16 AMP (compiled)": "compiled (aot_eager)",
        "compfx (searched plan) (compiled)": "compiled (aot_eager, compile_with_plan)"}
    assert all(row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"] and row["mean_loss"] == row["mean_loss"]
               and row["steps_timed"] == fp8["rounds"] * fp8["steps_per_round"] for row in fp8["rows"].values())
    searched = fp8["rows"]["compfx (searched plan) (compiled)"]
    assert set(searched["plan"]) <= set("018f") and searched["low_dtype"] == "bfloat16"  # in bf16 terms
    markdown = (folder / "gpu-suite-smoke.md").read_text()
    for text in ("| bert_squad ", "| fp32 ", "| amp-fp16 ", "| compfx-fp16 ", "## compfx search", "## FP8", "Matmul probe",
                 "| torchao float8 (all linears) + bf16 AMP | compiled (aot_eager) |"):
        assert text in markdown
    assert (folder / "cuda-tests.txt").exists()


def test_smoke_run_trains_the_compiled_fp8_contenders_and_both_searched_plans(smoke):
    done, _, folder = smoke
    part = json.loads((folder / "gpu-suite-smoke.json").read_text())["fp8_compiled"]
    if torchao_missing():
        assert part == {"status": "skipped", "why": torchao_missing(), "run": 1}
        return
    assert part["status"] == "ok", part.get("output_tail")
    rows = part["rows"]
    assert set(rows) == {f"{name} (compiled)" for name in (
        "bf16 AMP", "torchao float8 (all linears)", "torchao float8 (auto filter)", "compfx (plan searched eager)",
        "compfx (plan searched compiled)")}
    assert all(row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"] and row["mean_loss"] == row["mean_loss"]
               for row in rows.values())
    assert part["times_mean_nothing"] is True and part["searched_by"].startswith("roofline_cost")
    for searched in ("compfx (plan searched eager) (compiled)", "compfx (plan searched compiled) (compiled)"):
        assert set(rows[searched]["plan"]) <= set("018f") and "agrees_with_auto_filter" in rows[searched]
    markdown = (folder / "gpu-suite-smoke.md").read_text()
    assert "## FP8, compiled" in markdown and "| compfx (plan searched compiled) |" in markdown
    assert "fp8-compiled: ok" in done.stdout


def test_smoke_run_has_the_padding_row_with_and_without_padding(smoke):
    done, _, folder = smoke
    state = json.loads((folder / "gpu-suite-smoke.json").read_text())
    row = state["bench"]["rows"]["gpt_vocab50257/padding-fp16"]
    assert row["status"] == "ok", row.get("error")
    padding = row["padding"]
    assert padding["model"]["vocab"] % 8 and padding["padded_ops"] == {"head:linear#0": "out_features 131 -> 136"}
    assert len(padding["unpadded_ms"]) == len(padding["padded_ms"]) == padding["rounds"] >= 2
    assert all(ms > 0 for ms in padding["unpadded_ms"] + padding["padded_ms"])
    assert padding["verdict"] in ("padded faster", "padded slower", "no measurable difference")
    assert padding["times_mean_nothing"] is True and "no tensor cores" in padding["note"]  # a CPU says so
    assert row["steps_per_s"] == pytest.approx(1e3 / padding["padded_median_ms"])
    markdown = (folder / "gpu-suite-smoke.md").read_text()
    assert "## Shape padding" in markdown and "| Plan.amp, padded |" in markdown


def test_smoke_output_ends_with_one_line_per_row(smoke):
    done, _, folder = smoke
    state = json.loads((folder / "gpu-suite-smoke.json").read_text())
    tail = done.stdout.splitlines()[-len(state["bench"]["rows"]):]
    assert sorted(line.split()[0] for line in tail) == sorted(state["bench"]["rows"])
    assert all(" ok " in line and "steps/s" in line for line in tail)


def test_a_second_call_merges_and_measures_nothing_twice(smoke, tmp_path):
    _, root, folder = smoke
    done = _suite("--smoke", "--parts", "bench", "--merge-from", str(root), "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before = json.loads((folder / "gpu-suite-smoke.json").read_text())
    after = json.loads((tmp_path / folder.name / "gpu-suite-smoke.json").read_text())
    assert [run["run"] for run in after["runs"]] == [1, 2]
    assert after["bench"]["rows"] == before["bench"]["rows"]  # every row was measured in run 1 and kept
    assert after["cuda_tests"] == before["cuda_tests"]
    assert "bench:" not in done.stdout  # no worker was started


def test_a_row_past_its_limit_is_stopped_and_recorded_as_a_timeout(tmp_path):
    settings = dataclasses.replace(Settings.for_run(smoke=True), row_limit_s=0.05)  # its imports alone take longer
    recorded = []
    left = run_groups([[Task("gpt", "fp32")]], settings, rows={}, budget_end=time.time() + 120, workdir=tmp_path,
                      record=recorded.append, log=lambda line: None)
    [row] = recorded
    assert left == [] and row["id"] == "gpt/fp32"
    assert row["status"] == "timeout" and row["stopped_by"] == "row limit"
    assert not needs_run(row) and needs_run(row, retry_failed=True)


def test_groups_over_the_budget_are_left_for_a_later_call(tmp_path):
    groups = suite_groups(["bert_squad"], ["fp32", "compfx-fp16"])
    left = run_groups(groups, Settings(), rows={}, budget_end=time.time() + 30, workdir=tmp_path,
                      record=lambda row: pytest.fail("nothing fits 30 s"), log=lambda line: None)
    assert left == ["bert_squad/fp32: over this run's budget (estimate 15 s)",
                    "bert_squad/compfx-fp16: over this run's budget (estimate 180 s)",
                    "bert_squad/compfx-fp16+compile: waits for the plan of bert_squad/compfx-fp16",
                    "bert_squad/fp32+compile: over this run's budget (estimate 120 s)"]


def test_a_group_larger_than_the_time_left_runs_its_head():
    [group] = suite_groups(["gpt"], ["fp32", "amp-fp16", "compfx-fp16"], compiled=False)
    fits, estimate = _fitting(group, Settings(), budget_end=time.time() + 60)
    assert [task.id for task in fits] == ["gpt/fp32", "gpt/amp-fp16"] and estimate == 25 + 15 + 15


def test_timebox_kills_the_commands_children_too(tmp_path):
    marker = tmp_path / "child-alive"
    child = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(marker)!r}).write_text('x')"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    end = time.time() + 0.5
    boxed = run_boxed([sys.executable, "-c", parent], log_path=tmp_path / "log", deadline=lambda: end)
    time.sleep(2.0)
    assert boxed.timed_out and not marker.exists()


def test_on_the_cpu_clock_waiting_uses_no_time_and_computing_does(tmp_path):
    """What makes the smoke run's limits hold on a loaded machine: a command kept off the CPU (here: asleep, as
    one waiting for a core is) does not bring its limit nearer; one that computes past its CPU seconds is stopped."""
    limit = 0.5  # CPU seconds; a tenth of the wall seconds counts at the least, so a hang still ends
    asleep = run_boxed([sys.executable, "-c", "import time; time.sleep(1.5)"], log_path=tmp_path / "asleep.log",
                       deadline=lambda: limit, clock=CpuClock())
    assert asleep.returncode == 0 and not asleep.timed_out and asleep.seconds > limit
    spinning = run_boxed([sys.executable, "-c", "while True: pass"], log_path=tmp_path / "spinning.log",
                         deadline=lambda: limit, clock=CpuClock())
    assert spinning.timed_out and spinning.returncode is None


def test_the_smoke_run_reads_its_parts_limits_on_one_cpu_clock(tmp_path, monkeypatch):
    from benchmarks import gpu_suite

    clocks = []

    def boxed(argv, *, log_path, clock, **kwargs):
        clocks.append(clock)
        Path(log_path).write_text("")
        return Boxed(returncode=1, seconds=0.1, timed_out=False, log_path=Path(log_path))

    monkeypatch.setattr(gpu_suite, "run_boxed", boxed)
    monkeypatch.setattr(gpu_suite, "torchao_missing", lambda: None)
    assert gpu_suite.main(["--smoke", "--parts", "env,cuda-tests,fp8", "--out", str(tmp_path)]) == 1
    assert len(clocks) == 3 and isinstance(clocks[0], CpuClock) and clocks.count(clocks[0]) == 3


def test_a_failed_environment_probe_still_leaves_a_results_file_that_says_so(tmp_path, monkeypatch):
    from benchmarks import gpu_suite

    def failing_probe(argv, *, log_path, **kwargs):
        assert argv[2] == "benchmarks.gpu_env"
        Path(log_path).write_text("RuntimeError: CUDA error: no kernel image is available for execution\n")
        return Boxed(returncode=1, seconds=0.5, timed_out=False, log_path=Path(log_path))

    monkeypatch.setattr(gpu_suite, "run_boxed", failing_probe)
    assert gpu_suite.main(["--smoke", "--parts", "env", "--out", str(tmp_path)]) == 1
    [result] = tmp_path.glob("*/gpu-suite-smoke.json")
    env = json.loads(result.read_text())["environment"]
    assert env["status"] == "failed" and env["why"] == "the environment probe exited with code 1"
    assert "no kernel image" in env["output_tail"] and env["device_name"] and env["torch"]
    markdown = result.with_suffix(".md").read_text()
    assert "The environment probe failed" in markdown and "no kernel image" in markdown


def test_the_fp8_part_is_skipped_not_failed_without_torchao(tmp_path, monkeypatch):
    from benchmarks import gpu_suite

    monkeypatch.setattr(gpu_suite, "torchao_missing", lambda: "torchao not installed (No module named 'torchao')")
    monkeypatch.setattr(gpu_suite, "run_boxed", lambda *a, **k: pytest.fail("nothing to run without torchao"))
    fp8 = gpu_suite.run_fp8(True, tmp_path, tmp_path / "fp8.txt", time.time() + 600)
    compiled = gpu_suite.run_fp8(True, tmp_path, tmp_path / "fp8_compiled.txt", time.time() + 600, "fp8-compiled")
    assert fp8 == compiled == {"status": "skipped", "why": "torchao not installed (No module named 'torchao')"}
    state = {"environment": {"status": "ok"}, "cuda_tests": {"status": "passed"}, "bench": {"rows": {}}, "fp8": fp8,
             "fp8_compiled": compiled}
    assert gpu_suite.succeeded(state, gpu_suite.PARTS)
    assert not gpu_suite.succeeded({**state, "fp8": {"status": "failed"}}, gpu_suite.PARTS)
    assert not gpu_suite.succeeded({**state, "fp8_compiled": {"status": "timeout"}}, gpu_suite.PARTS)
    assert gpu_suite.succeeded({**state, "fp8_compiled": {"status": "timeout"}}, ["env", "fp8"])
    assert fp8_text(fp8).startswith("skipped: torchao not installed")
    assert "fp8: skipped: torchao not installed (No module named 'torchao')" in summary_lines(state)


def test_junit_counts_read_passes_failures_and_skips(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.test_cuda" name="test_a"/>'
                   '<testcase classname="tests.test_cuda" name="test_b"><failure message="boom"/></testcase>'
                   '</testsuite></testsuites>')
    counts = _junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (2, 1, 1)
    assert counts["failures"] == [{"test": "tests.test_cuda::test_b", "outcome": "failure", "message": "boom"}]
    assert _junit_counts(tmp_path / "missing.xml") == {}


# -- the README's section ---------------------------------------------------------------------------

def test_the_readme_gpu_section_is_what_the_committed_results_generate():
    section = gpu_readme.section_of(gpu_readme.README.read_text())
    assert section == gpu_readme.generated_section(), "run: python -m benchmarks.gpu_readme"


def test_the_run_commands_are_the_same_everywhere_they_are_given():
    from benchmarks import gpu_suite

    assert RUN_COMMANDS in (gpu_readme.ROOT / "benchmarks" / "results" / "README.md").read_text()
    assert "\n".join(line.strip() for line in gpu_suite.__doc__.splitlines()).count(
        "\n".join(line.strip() for line in RUN_COMMANDS.splitlines())) == 1


def test_without_gpu_results_the_section_says_so_and_gives_the_commands(tmp_path):
    (tmp_path / "amd-epyc").mkdir()
    (tmp_path / "amd-epyc" / "gpu-suite.json").write_text(json.dumps({"smoke": True, "device_name": "AMD EPYC"}))
    section = readme_section(tmp_path)
    assert NO_GPU_YET in section and RUN_COMMANDS in section


def _row(model, mode, steps, compiled=False, **extra):
    return {"id": f"{model}/{mode}{'+compile' if compiled else ''}", "model": model, "mode_label": mode,
            "compiled": compiled, "status": "ok", "steps_per_s": steps, "peak_memory_bytes": 2 ** 30, "run": 1, **extra}


def test_committed_results_become_tables_with_ratios_measured_in_one_run(tmp_path):
    rows = [_row("gpt", "fp32", 2.0), _row("gpt", "amp-fp16", 5.0), _row("gpt", "amp-bf16", 4.0),
            _row("gpt", "compfx-fp16", 6.0, mfu_pct=41.5, search_share_100_epochs=0.0012),
            _row("gpt", "fp32", 3.0, compiled=True), _row("gpt", "compfx-fp16", 9.0, compiled=True)]
    state = {"smoke": False, "device_name": "NVIDIA H100 80GB HBM3", "runs": [{"run": 1}],
             "environment": {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "capability": [9, 0],
                             "fp32_math": {"matmul": "ieee", "convolution": "tf32"},
                             "matmul_probe": {"bfloat16": {"tflops": 790.0, "n": 8192}}},
             "cuda_tests": {"status": "passed", "passed": 28, "failed": 0, "skipped": 0},
             "bench": {"rows": {row["id"]: row for row in rows}}}
    folder = tmp_path / "nvidia-h100-80gb-hbm3"
    folder.mkdir()
    (folder / "gpu-suite.json").write_text(json.dumps(state))
    section = readme_section(tmp_path, relative_to=tmp_path)
    eager_line = next(line for line in section.splitlines() if line.startswith("| gpt") and "2.00" in line)
    cells = [cell.strip() for cell in eager_line.split("|")[1:-1]]
    assert cells == ["gpt", "2.00", "5.00", "4.00", "6.00", "3.00", "1.20", "1024 / 1024 / 1024", "41.5", "0.12"]
    assert "Under `torch.compile`" in section and "nvidia-h100-80gb-hbm3/gpu-suite.md" in section
    assert "28 passed" in section and "790" in section and NO_GPU_YET not in section
    assert '"fp32" here: FP32 matmuls in IEEE FP32, FP32 convolutions in TF32' in section
    assert any(line.startswith("gpt/compfx-fp16+compile") and "3.00x FP32" in line for line in summary_lines(state))


def test_replace_section_touches_only_the_text_between_the_markers():
    text = f"a\n{gpu_readme.BEGIN}\nold\n{gpu_readme.END}\nb\n"
    assert gpu_readme.replace_section(text, "new") == f"a\n{gpu_readme.BEGIN}\nnew\n{gpu_readme.END}\nb\n"
    with pytest.raises(ValueError, match="exactly once"):
        gpu_readme.replace_section("no markers", "new")


def test_a_failed_fp8_part_stays_recorded_through_a_later_run_of_other_parts():
    from benchmarks import gpu_suite
    from benchmarks.gpu_bench import Settings

    failed = {"status": "failed", "why": "see the output tail", "output_tail": "CaptureError: ...", "run": 1}
    merged = {"suite": "benchmarks.gpu_suite", "format": 1, "smoke": False, "device_name": "GPU", "slug": "gpu",
              "runs": [{"run": 1}], "bench": {"rows": {}}, "fp8": failed}
    args = gpu_suite.parse_args(["--parts", "env,cuda-tests,bench"])
    state = gpu_suite._start_state(args, {"device_name": "GPU", "status": "ok"}, merged, Settings.for_run(False))
    assert state["fp8"] == failed and len(state["runs"]) == 2
    fresh = gpu_suite._start_state(args, {"device_name": "GPU", "status": "ok"}, None, Settings.for_run(False))
    assert fresh["fp8"]["status"] == "not measured"
