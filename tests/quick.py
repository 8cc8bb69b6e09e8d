"""The one quick ``SearchConfig`` of the tests: a search that shows what a test checks, in as few steps as it can.

Each test passes its own settings as overrides (``quick_config(stage1_budget=2, predictor=False)``), so what it
depends on is written where it is used.
"""

from __future__ import annotations

from compfx.search import SearchConfig

__all__ = ["QUICK", "quick_config"]

#: what every quick search shares: no progress bar, no untimed warm-up step, one timed step per timing
QUICK = {"progress": False, "warmup": 0, "repeats": 1}


def quick_config(**overrides) -> SearchConfig:
    """:data:`QUICK` with ``overrides`` (any :class:`~compfx.search.SearchConfig` field) over it."""
    return SearchConfig(**{**QUICK, **overrides})
