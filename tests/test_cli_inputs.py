"""`--inputs MODULE:FUNCTION`: analyze, diagnose, plan show and search take a token model's inputs from the
user's function; the installed `compfx` command finds the user's module in the current folder, as
`python -m compfx` does; a bad function is one `compfx: error:` line and exit code 2."""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compfx
import compfx.search.config
from compfx.cli import _search_batches, main

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

MODELS = "cli_inputs_models"  # the user's module, in the folder the command runs in
MODELS_SOURCE = '''
import torch
import transformers

VOCAB = 64
CALLS = []


def gpt():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def batch():  # keyword inputs with the labels: the model returns its own loss
    CALLS.append(None)
    ids = torch.randint(0, VOCAB, (2, 8))
    return {"input_ids": ids, "labels": ids}


def ids():  # one positional input: token ids
    return torch.randint(0, VOCAB, (2, 8))


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, scale):
        return self.linear(x) * scale


def x_and_scale():  # two positional inputs
    return torch.randn(5, 4), torch.full((5, 1), 2.0)


def raises():
    raise RuntimeError("no data here,\\non two lines")


def text():
    return "tokens"


def empty():
    return {}


def int_keys():
    return {0: torch.zeros(2, 8, dtype=torch.long)}


def pair():
    ids = torch.randint(0, VOCAB, (2, 8))
    return ids, ids


NOT_A_FUNCTION = 3
'''

REPO = Path(compfx.__file__).resolve().parent.parent
CHEAP = dict(progress=False, warmup=0, repeats=1, stage1_budget=2, stage2_budget=1, stage2_check_batches=1,
             predictor=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The user's folder: a module with a model factory and example-input functions, and a plan for the model."""
    folder = tmp_path_factory.mktemp("user-folder")
    (folder / f"{MODELS}.py").write_text(MODELS_SOURCE)
    return folder


@pytest.fixture
def here(folder, monkeypatch) -> Path:
    """Run in the user's folder; sys.path is put back after (main() adds the current folder, as python -m does)."""
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return folder


@pytest.fixture(scope="module")
def plan_file(folder) -> Path:
    """The AMP plan of the model, as a file."""
    sys.path.insert(0, str(folder))
    try:
        module = __import__(MODELS)
    finally:
        sys.path.remove(str(folder))
    analysis = compfx.analyze(module.gpt(), module.batch())
    path = folder / "plan.json"
    compfx.Plan.amp(analysis).save(path)
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("function", ["batch", "ids"])
def test_analyze_captures_a_token_model_on_the_functions_inputs(here, capsys, function):
    code, out, err = run(capsys, "analyze", f"{MODELS}:gpt", "--inputs", f"{MODELS}:{function}")
    assert code == 0, err
    assert "transformer.wte:embedding#0" in out and "lm_head:linear#0" in out
    assert (":cross_entropy#0" in out) == (function == "batch")  # the labels reach the model's own loss


def test_random_float_inputs_are_refused_by_a_token_model_in_one_line(here, capsys):
    code, out, err = run(capsys, "analyze", f"{MODELS}:gpt", "--input-shape", "2,8")
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "indices" in err


def test_diagnose_runs_the_functions_inputs_under_a_plan_file(here, capsys, plan_file):
    code, out, err = run(capsys, "diagnose", f"{MODELS}:gpt", "--inputs", f"{MODELS}:batch", "--plan", plan_file)
    assert code == 0, err
    assert "lm_head:linear#0" in out and "origins: none" in out and "FP32 shadow" in out
    code, out, err = run(capsys, "diagnose", f"{MODELS}:gpt", "--inputs", f"{MODELS}:ids")  # Plan.amp, no labels
    assert code == 0, err
    assert "lm_head:linear#0" in out


@pytest.mark.parametrize("inputs", [["--inputs", f"{MODELS}:x_and_scale"],
                                    ["--input-shape", "5,4", "--input-shape", "5,1"]])
def test_diagnose_passes_every_positional_input_to_the_model(here, capsys, inputs):
    code, out, err = run(capsys, "diagnose", f"{MODELS}:Scaled", *inputs)
    assert code == 0, err
    assert "linear:linear#0" in out and ":mul#0" in out


def test_plan_show_checks_a_plan_against_a_token_model(here, capsys, plan_file):
    code, out, err = run(capsys, "plan", "show", plan_file, "--model", f"{MODELS}:gpt", "--inputs", f"{MODELS}:batch")
    assert code == 0, err
    assert f"the plan matches {MODELS}:gpt" in out and "lm_head:linear#0" in out


def test_search_on_a_token_model_calls_the_function_once_per_batch(here, capsys, monkeypatch):
    monkeypatch.setattr(compfx.search.config, "SearchConfig", functools.partial(compfx.SearchConfig, **CHEAP))
    models = __import__(MODELS)
    models.CALLS.clear()
    plan_path = here / "searched.json"
    code, out, err = run(capsys, "search", f"{MODELS}:gpt", "--inputs", f"{MODELS}:batch", "--batches", 2,
                         "--no-progress", "--plan", plan_path)
    assert code == 0, err
    assert len(models.CALLS) == 2 and "chosen plan" in out and f"plan written to {plan_path}" in out
    assert set(compfx.Plan.load(plan_path)) == set(compfx.analyze(models.gpt(), models.batch()).keys)


def test_search_batches_differ_and_repeat_with_the_seed(here):
    args = argparse.Namespace(inputs=f"{MODELS}:batch", batches=3, seed=7)
    first, again = _search_batches(args), _search_batches(args)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))
    assert not torch.equal(first[0]["input_ids"], first[1]["input_ids"])


BAD = {
    "no such module": (["analyze", "--inputs", "no_such_module_xyz:batch"], "could not load it (ModuleNotFoundError"),
    "no such function": (["analyze", "--inputs", f"{MODELS}:missing"], "could not load it (AttributeError"),
    "not a function": (["analyze", "--inputs", f"{MODELS}:NOT_A_FUNCTION"], "is not a function (its type is int)"),
    "no function name": (["analyze", "--inputs", MODELS], "expected MODULE:FUNCTION"),
    "the function raises": (["analyze", "--inputs", f"{MODELS}:raises"],
                            f"{MODELS}:raises() failed (RuntimeError: no data here, on two lines)"),
    "a string": (["analyze", "--inputs", f"{MODELS}:text"], "returned a str; expected the model's inputs"),
    "an empty dict": (["diagnose", "--inputs", f"{MODELS}:empty"], "returned an empty dict"),
    "int keys": (["plan", "show", "PLAN", "--model", "--inputs", f"{MODELS}:int_keys"], "a dict with non-string keys"),
    "a search tuple": (["search", "--inputs", f"{MODELS}:pair", "--no-progress"], "reads a tuple batch as"),
    "a named loss": (["search", "--inputs", f"{MODELS}:batch", "--loss", "cross_entropy"], "takes the target from"),
    "two sources": (["search", "--inputs", f"{MODELS}:batch", "--data", f"{MODELS}:batch"], "got --data and --inputs"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_inputs_function_is_one_error_line_and_exit_code_2(here, capsys, plan_file, case):
    argv, message = BAD[case]
    argv = [str(plan_file) if a == "PLAN" else a for a in argv]
    model_at = argv.index("--model") + 1 if "--model" in argv else 1  # the model factory goes after the command
    argv.insert(model_at, f"{MODELS}:gpt")
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("compfx: error: ") and message in err, err


@pytest.mark.parametrize("command", ["analyze", "diagnose"])
def test_inputs_and_input_shape_are_one_or_the_other(here, capsys, command):
    for argv in ([command, f"{MODELS}:gpt", "--inputs", f"{MODELS}:batch", "--input-shape", "2,8"],
                 [command, f"{MODELS}:gpt"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and "--input-shape" in capsys.readouterr().err


def _installed_command() -> str:
    beside = Path(sys.executable).parent / "compfx"
    found = str(beside) if beside.is_file() else shutil.which("compfx")
    if found is None:
        pytest.skip("the compfx command is not installed here (pip install -e . installs it)")
    return found


def test_the_installed_command_finds_the_users_module_in_the_current_folder(folder, tmp_path):
    # PYTHONPATH: this checkout's compfx, whichever checkout the installed command was installed from; the user's
    # folder is not on it, so only the current folder can provide the module.
    env = {**os.environ, "PYTHONPATH": str(REPO), "COMPFX_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([_installed_command(), "analyze", f"{MODELS}:gpt", "--inputs", f"{MODELS}:batch"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "lm_head:linear#0" in done.stdout
