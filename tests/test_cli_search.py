"""`compfx search`, `compfx report LOG`, `compfx plan show`: a search from the shell, its report from the log alone,
a plan file printed; every mistake is one `compfx: error:` line and exit code 2, never a traceback."""

import json
import subprocess
import sys

import pytest

from compfx.cli import main
from compfx.plan import Plan

SEARCH = ["search", "compfx.examples:mlp", "--input-shape", "16,64", "--classes", "10", "--batches", "3",
          "--no-progress"]


def _compfx(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "compfx", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One search from the shell (a subprocess), its log and plan file."""
    folder = tmp_path_factory.mktemp("cli-search")
    log, plan = folder / "search.jsonl", folder / "plan.json"
    done = _compfx(*SEARCH, "--log", str(log), "--plan", str(plan))
    assert done.returncode == 0, done.stderr
    return done, log, plan


def test_search_then_report_prints_the_chosen_plan(searched):
    done, log, plan_path = searched
    plan = Plan.load(plan_path)
    chosen = "".join(str(p.code) for p in plan.values())  # the CoMP string, in the analysis's op order
    assert f"chosen plan    {chosen}" in done.stdout and f"plan written to {plan_path}" in done.stdout
    report = _compfx("report", str(log))
    assert report.returncode == 0, report.stderr
    assert f"chosen plan    {chosen}" in report.stdout
    assert "0:linear#0" in report.stdout and "stage 1" in report.stdout and "step time" in report.stdout
    # the same report the search printed, from the log alone (the table, the plan, the sample counts)
    assert report.stdout.splitlines()[:8] == done.stdout.splitlines()[:8]


def test_plan_show_prints_the_plan_and_checks_it_against_a_model(searched, capsys):
    _, _, plan_path = searched
    plan = Plan.load(plan_path)
    assert main(["plan", "show", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert plan.fingerprint in out and "bfloat16" in out
    rows = [line.split() for line in out.splitlines()]
    assert all([str(i), str(key), str(precision)] in rows for i, (key, precision) in enumerate(plan.items()))
    assert main(["plan", "show", str(plan_path), "--model", "compfx.examples:mlp", "--input-shape", "16,64"]) == 0
    out = capsys.readouterr().out
    assert "the plan matches compfx.examples:mlp" in out and "whitelist" in out


def test_report_of_an_unfinished_search_says_so(searched, tmp_path, capsys):
    _, log, _ = searched
    lines = log.read_text().splitlines()
    assert "result" in json.loads(lines[-1])["extra"]
    cut = tmp_path / "interrupted.jsonl"
    cut.write_text("\n".join(lines[:-1]) + "\n")  # what a search stopped before its end leaves
    assert main(["report", str(cut)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compfx: error:") and "no finished search" in err and "resume=True" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["report", "{tmp}/missing.jsonl"], "does not exist"),
        (["plan", "show", "{tmp}/missing.json"], "does not exist"),
        (["plan", "show", "{plan}", "--model", "compfx.examples:cnn", "--input-shape", "8,1,8,8"],
         "does not match the model"),
        (["plan", "show", "{plan}", "--model", "compfx.examples:mlp"], "--model needs --input-shape"),
        (["search", "compfx.examples:no_such_model", "--input-shape", "16,64", "--classes", "3"], "could not load"),
        (["search", "compfx.examples:mlp", "--data", "compfx.examples:no_such_loader"], "could not load"),
        (["search", "compfx.examples:mlp", "--data", "compfx.examples:cnn", "--input-shape", "16,64"], "not both"),
        (["search", "compfx.examples:mlp", "--input-shape", "16,64"], "needs --classes"),
        (["search", "compfx.examples:mlp", "--input-shape", "16,3", "--classes", "3", "--no-progress"],
         "the model failed on the loader's first batch"),
        (["search", "compfx.examples:mlp", "--input-shape", "16,64", "--classes", "3", "--log", "{tmp}"],
         "is a folder"),
        (["search", "compfx.examples:mlp", "--input-shape", "16,64", "--classes", "3", "--loss", "hinge"],
         "--loss 'hinge'"),
    ],
)
def test_bad_paths_and_factories_exit_2_with_one_line(searched, tmp_path, capsys, argv, says):
    _, _, plan_path = searched
    argv = [a.format(tmp=tmp_path, plan=plan_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("compfx: error:") and says in err and err.count("\n") == 1, err


def test_a_bad_path_from_the_shell_is_not_a_traceback(tmp_path):
    done = _compfx("report", str(tmp_path / "missing.jsonl"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("compfx: error: search log") and done.stderr.count("\n") == 1
