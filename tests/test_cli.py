"""`python -m compfx analyze`: prints the analysis table; bad input exits with code 2 and says why."""

import subprocess
import sys

import pytest

from compfx.cli import main


def test_analyze_prints_a_table(capsys):
    assert main(["analyze", "compfx.examples:cnn", "--input-shape", "8,1,8,8"]) == 0
    out = capsys.readouterr().out
    assert "op key" in out and "category" in out
    assert "features.0:conv2d#0" in out and "head.3:linear#0" in out
    assert "ops on cpu (low dtype bfloat16)" in out


def test_analyze_for_a_gpu_target(capsys):
    assert main(["analyze", "compfx.examples:mlp", "--input-shape", "8,64", "--device", "cuda",
                 "--capability", "8,0"]) == 0
    out = capsys.readouterr().out
    assert "dims are multiples of 8" in out and "out_features=10 is not a multiple of 8" in out


@pytest.mark.parametrize(
    "spec, says",
    [
        ("compfx.examples", "needs the form MODULE:FACTORY"),
        ("compfx.no_such_module:cnn", "could not load"),
        ("compfx.examples:no_such_factory", "could not load"),
    ],
)
def test_bad_model_spec_exits_2_with_a_clear_message(capsys, spec, says):
    assert main(["analyze", spec, "--input-shape", "8,1,8,8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compfx: error:") and says in err and spec in err


def test_bad_shape_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["analyze", "compfx.examples:cnn", "--input-shape", "8,x"])
    assert info.value.code == 2
    assert "is not a shape like 8,3,32,32" in capsys.readouterr().err


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "compfx", "analyze", "compfx.examples:cnn", "--input-shape", "8,1,8,8"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "features.0:conv2d#0" in result.stdout


def test_an_error_is_one_line_even_when_its_message_quotes_several(monkeypatch, capsys):
    from compfx import cli
    from compfx.errors import CaptureError

    def fails(args):
        raise CaptureError("the model failed at\n    x = model(x)\nin forward")

    monkeypatch.setattr(cli, "_cmd_analyze", fails)
    assert cli.main(["analyze", "compfx.examples:mlp", "--input-shape", "2,16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("compfx: error: the model failed at x = model(x) in forward")
