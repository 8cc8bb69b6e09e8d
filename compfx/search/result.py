"""What :func:`compfx.optimize` returns: the module that runs the chosen plan, and what the search learned."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn

from ..plan import Plan
from ..vocabulary import SampleStatus, Stage
from .log import SearchLog

__all__ = ["SearchResult"]


@dataclass
class SearchResult:
    """The outcome of one search.

    * ``module``: the model rewritten to run ``plan``. It shares the model's
      Parameters, so the optimizer given to ``optimize`` keeps training it.
    * ``plan``: the chosen :class:`~compfx.plan.Plan`; ``stage1_plan``: the Stage-1 winner.
    * ``analysis``: the :class:`~compfx.analyze.Analysis` the plans are over.
    * ``log``: every sample and note (:class:`~compfx.search.log.SearchLog`).
    * ``stage1_mode``, ``loss0`` (the FP32 epoch's loss), ``fp32_epoch_seconds``,
      ``search_seconds`` (wall time of the search), ``step_seconds`` (median step
      of ``"fp32"``, ``"amp"`` and ``"chosen"`` on the same batches).
    * ``plan_path``: the plan-cache file the plan was saved to (None when it was
      not: ``SearchConfig(cache_plan=False)``, per-device plans, an unwritable
      cache); ``plan_cache`` says which, in words.

    ``report()`` renders it as text.
    """

    module: nn.Module
    plan: Plan
    stage1_plan: Plan
    analysis: object
    log: SearchLog
    stage1_mode: str
    loss0: float
    fp32_epoch_seconds: float
    search_seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)
    plan_path: Path | None = None
    plan_cache: str = ""

    def report(self, tablefmt: str = "simple") -> str:
        """The per-op table, then the search and the timing summary (see :mod:`compfx.report`)."""
        from ..report import render_report  # report reads this class: imported when used

        return render_report(self, tablefmt)

    @property
    def samples_run(self) -> int:
        return len([r for r in self.log.samples() if r.stage in (Stage.STAGE1, Stage.STAGE2)])

    @property
    def samples_pruned(self) -> int:
        return len([r for r in self.log.samples() if r.status is SampleStatus.PRUNED])

    @property
    def samples_skipped(self) -> int:
        return len([r for r in self.log.samples() if r.status is SampleStatus.SKIPPED])

    def __repr__(self) -> str:
        return (f"SearchResult(plan={self.plan!r}, {len(self.log.samples())} samples, "
                f"search {self.search_seconds:.2f} s)")
