"""The docs are written for users: the README stays short, nothing in the project speaks of our own process, every
fenced block says what it is, links resolve, and the result tables are what their JSON generates."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
#: the README is a ten-minute read; detail goes to docs/
README_MAX_LINES = 220
#: a reader reaches the set-up commands and the quick start without scrolling far
QUICK_START_BY_LINE = 40
#: the text files the project is made of; JSON results hold data only, and are left out
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt"}

# What the project's text must never say. compfx is read by users, who cannot see our issue tracker, our git
# history's hashes, our rounds of work or the machinery that ran some of our measurements; such text means nothing
# to them and goes stale. Each pattern is narrow enough to leave the project's own vocabulary alone: op keys
# (``linear#0``), CoMP bitstrings (``0ff1f``), plan fingerprints (16 hex digits), comments (``# ...``).
FORBIDDEN = {
    "an issue number": re.compile(r"\b(?:issues?|PR|pull request)\s?#?[0-9]+\b", re.IGNORECASE),
    "a bare #number": re.compile(r"(?<![\w#&/'\"`])#[0-9]+\b"),
    "a commit hash": re.compile(r"\bcommit(?:ted)?:?\s+[0-9a-f]{7,40}\b", re.IGNORECASE),
    # (timing code speaks of rounds too: "the last round's median" is fine, "this round" of work is not)
    "a past round of work": re.compile(r"\buntil issue\b|\brounds? of work\b|\bthis stop\b|"
                                       r"\bthis round\b(?!'s| of (?:timing|steps))", re.IGNORECASE),
    "the remote-execution setup": re.compile(
        r"\bdevice tool\b|\bremote[- ]execution\b|\blease\b|\$OUT\b|\bfiles_(?:at|fetch)\b|\bbudget_left_s\b|"
        r"\bcall limits?\b|\breplies land\b|\bwheels?\b[^.\n]{0,30}\bcarr(?:y|ies|ied)\b|"
        r"\bcarr(?:y|ies|ied)\b[^.\n]{0,30}\bwheels?\b", re.IGNORECASE),
}


def forbidden_in(text: str) -> list[str]:
    """What ``text`` says that it must not: ``"<what>: <the words>"`` per hit."""
    return [f"{what}: {hit.group(0)!r}" for what, pattern in FORBIDDEN.items() for hit in pattern.finditer(text)]


def tracked_text_files() -> list[Path]:
    """The project's text files: git's tracked files where this is a checkout, else every file but caches."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / name for name in names.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if not {".git", "__pycache__", ".pytest_cache"} & set(p.parts)]
    return [p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file()]


def commit_hashes() -> set[str]:
    """Every commit of this repository's history (empty outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-list", "--all"], cwd=ROOT, capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    return set(out.split())


def test_the_readme_is_at_most_220_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def quick_start_line(text: str) -> int | None:
    """The line (1-based) where the first ``python`` block that calls compfx opens, or None without one."""
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip() == "```python":
            body = lines[number:]
            end = next((i for i, body_line in enumerate(body) if body_line.startswith("```")), len(body))
            if any("compfx." in body_line for body_line in body[:end]):
                return number
    return None


def test_the_quick_start_and_the_setup_commands_come_within_the_first_40_lines():
    text = README.read_text()
    opening = quick_start_line(text)
    assert opening is not None, "the README has no python example that runs compfx"
    assert opening <= QUICK_START_BY_LINE, (
        f"the README's quick start begins at line {opening}; move what comes before it below (at most line "
        f"{QUICK_START_BY_LINE})")
    for marker in ("<!-- demo-command -->", "<!-- test-command -->"):
        line = text[:text.index(marker)].count("\n") + 1
        assert line < opening, f"{marker} (line {line}) must come before the quick start (line {opening})"


@pytest.mark.parametrize("text, line", [
    ("```python\nimport compfx\ncompfx.optimize(m)\n```\n", 1),
    ("# t\n```python\nx = 1\n```\n```bash\npython -m compfx demo\n```\n\n```python\ncompfx.apply(m, p)\n```\n", 9),
    ("```python\nx = 1\n```\n", None),
])
def test_the_quick_start_is_the_first_python_block_that_calls_compfx(text, line):
    assert quick_start_line(text) == line


@pytest.mark.parametrize("text", [
    "Until issue 14 one cast was shared", "as issues 13 and 14 found", "fixed in PR #12", "see #13",
    "(#7)", "the run before (commit ed83a18) measured", "what this stop cut", "in this round",
    "the device tool's call limits", "which wheel files to carry", "under one lease", "written under $OUT",
])
def test_the_patterns_catch_what_they_are_for(text):
    assert forbidden_in(text), text


@pytest.mark.parametrize("text", [
    "'0:linear#0'", "encoder.0.attn:matmul#1", "`#٠` or `#０`", "x = 1  # 3 casts", "plan `0ff0fff1f1f`",
    "fingerprint 0123456789abcdef", "one call per batch", "the median of 5 rounds", "plans carry the recipe",
    "import a wheel's data", "&#39;", "https://example.org/#12", "the commit measured", "the last round's median", "in this round's steps",
])
def test_the_patterns_leave_the_projects_own_words_alone(text):
    assert forbidden_in(text) == [], text


def test_no_text_in_the_project_refers_to_issues_commits_past_rounds_or_the_remote_setup():
    files = [path for path in tracked_text_files() if path != Path(__file__).resolve()]  # this file holds examples
    assert README in files and len(files) > 50
    hashes = commit_hashes()
    found = []
    for path in files:
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {hit}" for hit in forbidden_in(text)]
        # any 7-40 hex digits naming a commit of this history, however it is introduced
        found += [f"{path.relative_to(ROOT)}: a commit of this history: {token!r}"
                  for token in set(re.findall(r"\b[0-9a-f]{7,40}\b", text))
                  if any(commit.startswith(token) for commit in hashes)]
    assert found == [], "\n".join(found)


# -- fenced blocks and links ---------------------------------------------------------------------

FENCE = re.compile(r"^```(.*)$", flags=re.MULTILINE)
#: what a block may be: python runs (tests/test_readme.py), json is parsed, bash and text are shown as they are
LANGUAGES = {"python", "bash", "text", "json"}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)


@pytest.mark.parametrize("path", [README, CONTRIBUTING, *DOCS], ids=lambda p: p.name)
def test_every_fenced_block_says_what_it_is(path):
    text = path.read_text()
    openings = FENCE.findall(text)[::2]  # fences alternate: opening, closing
    assert len(FENCE.findall(text)) % 2 == 0, f"{path.name}: a fenced block is not closed"
    assert all(language in LANGUAGES for language in openings), (
        f"{path.name}: fenced blocks must be marked {sorted(LANGUAGES)}; found {openings}")
    for language, body in fenced_blocks(text):
        if language == "json":
            json.loads(body)


def anchors(text: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings of ``text`` (GitHub's rule: lower case, punctuation
    dropped, spaces to hyphens)."""
    headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE),
                          flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", [README, CONTRIBUTING, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_names_a_file_and_heading_that_exist(path):
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text())
    missing = [link for link, _ in links if link and "://" not in link and not (path.parent / link).exists()]
    assert missing == [], f"{path.name} links to missing files: {missing}"
    broken = [f"{link}#{anchor}" for link, anchor in links if anchor and "://" not in link and link.endswith(".md")
              and anchor not in anchors((path.parent / link).read_text())]
    broken += [f"#{anchor}" for link, anchor in links if anchor and not link and anchor not in anchors(path.read_text())]
    assert broken == [], f"{path.name} links to missing headings: {broken}"


def test_the_result_tables_are_what_their_json_generates():
    from benchmarks.docs_tables import DOCUMENTS, TABLES, replace_tables, tables_in

    names = [name for path in DOCUMENTS for name in tables_in(path.read_text())]
    assert sorted(set(names)) == sorted(TABLES), "every table is shown once somewhere, and only generated ones"
    stale = [path.name for path in DOCUMENTS if replace_tables(path.read_text()) != path.read_text()]
    assert stale == [], f"run: python -m benchmarks.docs_tables ({', '.join(stale)} out of date)"
