"""The Python examples of the README and of every docs page run, in order, as a reader would paste them (in an
empty folder, one namespace per page), and compfx's own code causes no warning on them. Blocks marked ``bash`` or
``text`` are commands and output, shown as they are (tests/test_docs.py checks that every block is marked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import needs_torchao, warnings_from_compfx

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def _runs_fp8(block: str) -> bool:
    """An FP8 example: it runs torchao's float8 training (``compfx[fp8]``), so it runs on its own, where torchao is."""
    return "fp8=True" in block


def _run(path: Path, blocks: list[tuple[int, str]], namespace: dict) -> None:
    for number, block in blocks:
        try:
            exec(compile(block, f"{path.name} python block {number}", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message says which block
            pytest.fail(f"{path.name} python block {number} failed: {type(error).__name__}: {error}\n{block}")


def _numbered(path: Path, *, fp8: bool) -> list[tuple[int, str]]:
    return [(number, block) for number, block in enumerate(python_blocks(path.read_text()), 1)
            if _runs_fp8(block) == fp8]


def test_the_readme_has_exactly_two_setup_commands():
    text = README.read_text()
    for marker in ("demo-command", "test-command"):
        assert text.count(f"<!-- {marker} -->") == 1 and text.count(f"<!-- /{marker} -->") == 1


def test_every_python_example_in_the_readme_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write search.jsonl, plan.json and a trainer's output folder
    blocks = _numbered(README, fp8=False)
    assert len(blocks) >= 4
    with warnings_from_compfx() as warned:
        _run(README, blocks, {})
    assert (tmp_path / "search.jsonl").exists() and (tmp_path / "plan.json").exists()
    assert warned == []  # compfx's own code causes no warning on the README's examples


@pytest.mark.parametrize("page", [page for page in DOCS if _numbered(page, fp8=False)], ids=lambda p: p.name)
def test_every_python_example_in_the_docs_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with warnings_from_compfx() as warned:
        _run(page, _numbered(page, fp8=False), {})
    assert warned == []  # nor on the docs' examples


def test_the_docs_have_python_examples():
    assert sum(len(python_blocks(page.read_text())) for page in DOCS) >= 8


@needs_torchao
@pytest.mark.parametrize("page", [page for page in (README, *DOCS) if _numbered(page, fp8=True)],
                         ids=lambda p: p.name)
def test_the_fp8_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _numbered(page, fp8=True)
    with warnings_from_compfx() as warned:
        for number, block in blocks:
            _run(page, [(number, block)], {})  # each on its own: torchao may be missing where the rest runs
    assert warned == []
