"""The README's Python examples run, in order, as a reader would paste them (in an empty folder), and compfx's own
code causes no warning on them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import needs_torchao, warnings_from_compfx

README = Path(__file__).resolve().parent.parent / "README.md"

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_the_readme_has_exactly_two_setup_commands():
    text = README.read_text()
    for marker in ("demo-command", "test-command"):
        assert text.count(f"<!-- {marker} -->") == 1 and text.count(f"<!-- /{marker} -->") == 1


def _runs_fp8(block: str) -> bool:
    """An FP8 example: it runs torchao's float8 training (``compfx[fp8]``), so it runs on its own, where torchao is."""
    return "fp8=True" in block


def test_every_python_example_in_the_readme_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write search.jsonl and plan.json
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2
    namespace: dict = {}
    with warnings_from_compfx() as warned:
        for number, block in enumerate(blocks, 1):
            if _runs_fp8(block):
                continue  # test_the_readme_fp8_examples_run
            try:
                exec(compile(block, f"README.md python block {number}", "exec"), namespace)
            except Exception as error:  # pragma: no cover - the message says which block
                pytest.fail(f"README python block {number} failed: {type(error).__name__}: {error}\n{block}")
    assert (tmp_path / "search.jsonl").exists() and (tmp_path / "plan.json").exists()
    assert warned == []  # compfx's own code causes no warning on the README's examples


@needs_torchao
def test_the_readme_fp8_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [(number, block) for number, block in enumerate(python_blocks(README.read_text()), 1) if _runs_fp8(block)]
    assert blocks, "the README's FP8 section has an example"
    for number, block in blocks:
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), {})
        except Exception as error:  # pragma: no cover - the message says which block
            pytest.fail(f"README python block {number} failed: {type(error).__name__}: {error}\n{block}")
