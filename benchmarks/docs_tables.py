"""Rewrite the result tables in README.md and docs/*.md from the committed JSON; never type a figure by hand.

A table lives between ``<!-- table: NAME -->`` and ``<!-- /table: NAME -->``; nothing outside the markers is
touched. Each NAME in :data:`TABLES` names a results file under ``benchmarks/results/`` and the function of its
benchmark that renders it, so a re-measured result and the docs cannot drift apart: ``tests/test_docs.py`` fails
when a table differs from what its JSON generates.

::

    python -m benchmarks.docs_tables            # rewrite every table from the JSON
    python -m benchmarks.docs_tables --check    # exit 1 if any table is not what its JSON generates

>>> text = "intro\\n<!-- table: x -->\\nold\\n<!-- /table: x -->\\nrest\\n"
>>> print(replace_tables(text, {"x": lambda: "new"}))
intro
<!-- table: x -->
new
<!-- /table: x -->
rest
<BLANKLINE>
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

__all__ = ["TABLES", "DOCUMENTS", "tables_in", "replace_tables", "main"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: The files whose tables are generated.
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_TABLE = re.compile(r"<!-- table: (?P<name>[\w-]+) -->\n(?P<body>.*?)\n?<!-- /table: (?P=name) -->", flags=re.DOTALL)


def _json(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _run_rows(path: str) -> str:
    from .report import comparison_table

    return comparison_table(_json(path)["rows"])


def _search_cost() -> str:
    from .search_cost import cases_table

    return cases_table(_json("cpu/search_cost.json")["fixed_cost_cases"])


def _search_cost_trainer() -> str:
    from .search_cost import trainer_table

    return trainer_table(_json("cpu/search_cost.json")["trainer"])


def _search_cost_trainer_default_threads() -> str:
    from .search_cost import trainer_table

    return trainer_table(_json("cpu/search_cost_trainer_default_threads.json")["trainer"])


def _decisions() -> str:
    from .decisions import markdown

    return markdown(_json("cpu/decisions.json"))


def _paper_interleaved() -> str:
    from .paper_interleaved import markdown

    return markdown(_json("amd-epyc/paper-interleaved.json"))


def _verify_cost() -> str:
    from .verify_cost import markdown

    return markdown(_json("cpu/verify_cost.json"))


def _capture_speed() -> str:
    from .capture_speed import markdown

    return markdown(_json("cpu/capture_speed.json"))


def _fidelity() -> str:
    from .fidelity import markdown

    return markdown(_json("cpu/fidelity.json")).strip()


def _guard_cost() -> str:
    from .guard_cost import markdown

    return markdown(_json("cpu/guard_cost.json")).strip()


def _compiled_search() -> str:
    from .compiled_search import markdown

    return markdown(_json("cpu/compiled_search.json")).strip()


#: table name -> what renders it from its results file
TABLES: dict[str, Callable[[], str]] = {
    "cpu-small-real": lambda: _run_rows("amd-epyc/small-real.json"),
    "cpu-paper-vgg16-resnet": lambda: _run_rows("amd-epyc/paper-synthetic-vgg16-resnet.json"),
    "cpu-paper-vgg16-resnet-run2": lambda: _run_rows("amd-epyc/paper-synthetic-vgg16-resnet-run2.json"),
    "cpu-paper-interleaved": _paper_interleaved,
    "cpu-search-cost": _search_cost,
    "cpu-search-cost-trainer": _search_cost_trainer,
    "cpu-search-cost-trainer-default-threads": _search_cost_trainer_default_threads,
    "cpu-decisions": _decisions,
    "cpu-verify-cost": _verify_cost,
    "cpu-capture-speed": _capture_speed,
    "cpu-fidelity": _fidelity,
    "cpu-guard-cost": _guard_cost,
    "cpu-compiled-search": _compiled_search,
}


def tables_in(text: str) -> dict[str, str]:
    """The tables of ``text``, by name, as they stand."""
    return {found["name"]: found["body"] for found in _TABLE.finditer(text)}


def replace_tables(text: str, tables: dict[str, Callable[[], str]] = TABLES) -> str:
    """``text`` with every table it holds regenerated (a name without a renderer is a ``KeyError``)."""
    def regenerate(found: re.Match) -> str:
        name = found["name"]
        if name not in tables:
            raise KeyError(f"no renderer for the table {name!r}; known: {sorted(tables)}")
        return f"<!-- table: {name} -->\n{tables[name]()}\n<!-- /table: {name} -->"

    return _TABLE.sub(regenerate, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.docs_tables", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is out of date; change nothing")
    args = parser.parse_args(argv)
    stale = []
    for path in DOCUMENTS:
        text = path.read_text()
        updated = replace_tables(text)
        if updated != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(updated)
    if args.check:
        print("every table is what its JSON generates" if not stale else
              f"out of date: {', '.join(map(str, stale))}; run python -m benchmarks.docs_tables")
        return 1 if stale else 0
    print(f"rewrote: {', '.join(map(str, stale))}" if stale else "every table was up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
