"""Rewrite the README's GPU section from the committed GPU suite results; never type GPU figures by hand.

The section is the text between ``<!-- gpu-results -->`` and ``<!-- /gpu-results -->`` in ``README.md``;
nothing outside the markers is touched. It is generated from every ``benchmarks/results/<gpu>/gpu-suite.json``
(smoke runs excluded) by :func:`benchmarks.gpu_report.readme_section`; with none committed it says that no GPU
has been measured yet and gives the command to run on a GPU. ``tests/test_gpu_suite.py`` checks that the
README holds exactly what this generates.

::

    python -m benchmarks.gpu_readme [RESULTS_ROOT] [--readme README.md] [--check]

>>> text = "intro\\n<!-- gpu-results -->\\nold\\n<!-- /gpu-results -->\\nrest\\n"
>>> print(replace_section(text, "new"))
intro
<!-- gpu-results -->
new
<!-- /gpu-results -->
rest
<BLANKLINE>
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .gpu_report import readme_section

__all__ = ["BEGIN", "END", "README", "RESULTS", "section_of", "replace_section", "generated_section", "main"]

BEGIN, END = "<!-- gpu-results -->", "<!-- /gpu-results -->"
ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
_SECTION = re.compile(re.escape(BEGIN) + r"\n(.*?)\n?" + re.escape(END), flags=re.DOTALL)


def section_of(text: str) -> str:
    """The text between the markers (ValueError unless each marker occurs exactly once, in order)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"the README must hold {BEGIN} and {END} exactly once each")
    found = _SECTION.search(text)
    if found is None:
        raise ValueError(f"{END} comes before {BEGIN} in the README")
    return found.group(1)


def replace_section(text: str, section: str) -> str:
    """``text`` with the text between the markers replaced by ``section``."""
    section_of(text)  # the same checks
    return _SECTION.sub(lambda _: f"{BEGIN}\n{section}\n{END}", text, count=1)


def generated_section(results_root: str | Path = RESULTS) -> str:
    """What belongs between the markers, from the results under ``results_root`` (paths relative to the repo)."""
    root = Path(results_root).resolve()
    return readme_section(root, relative_to=ROOT if root.is_relative_to(ROOT) else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_readme", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default=str(RESULTS), help="results root (default benchmarks/results)")
    parser.add_argument("--readme", default=str(README))
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's section is not what the "
                                                              "results generate; change nothing")
    args = parser.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    updated = replace_section(text, generated_section(args.results))
    if args.check:
        same = updated == text
        print("the README's GPU section is up to date" if same else
              "the README's GPU section differs from the results: run python -m benchmarks.gpu_readme")
        return 0 if same else 1
    if updated != text:
        readme.write_text(updated)
    print(f"{readme}: GPU section {'rewritten' if updated != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
