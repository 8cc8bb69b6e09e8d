"""What :func:`compfx.optimize` returns: the module that runs the chosen plan, and what the search learned."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import PlanFileError
from ..opkey import OpKey
from ..plan import Plan
from ..vocabulary import Category, SampleStatus, Stage
from .compare import StepComparison
from .log import RESULT, SearchLog
from .report import render_report

__all__ = ["SearchResult", "LoggedAnalysis", "LoggedOp", "RESULT"]


@dataclass(frozen=True)
class LoggedOp:
    """What the report shows of one op, as a finished search's log holds it."""

    key: OpKey
    category: Category
    tc_eligible: bool
    fp8_eligible: bool = False
    pad_eligible: bool = False
    pinned: bool = False


@dataclass(frozen=True)
class LoggedAnalysis:
    """The part of an :class:`~compfx.analysis.Analysis` a report needs, read back from a log (no graph, no model)."""

    ops: tuple[LoggedOp, ...]
    low_dtype: torch.dtype
    fingerprint: str
    fp8: bool = False  # whether FP8 eligibility was analysed (the report's FP8 column)

    @property
    def keys(self) -> tuple[OpKey, ...]:
        return tuple(op.key for op in self.ops)


@dataclass
class SearchResult:
    """The outcome of one search.

    * ``module``: the model rewritten to run ``plan``. It shares the model's
      Parameters, so the optimizer given to ``optimize`` keeps training it. After
      a compiled search (``SearchConfig(compile=...)``) it is the plan's compiled
      program, ``compfx.compile_with_plan(model, plan)``, compiled already.
    * ``plan``: the chosen :class:`~compfx.plan.Plan`; ``stage1_plan``: the Stage-1 winner.
    * ``analysis``: the :class:`~compfx.analysis.Analysis` the plans are over.
    * ``log``: every sample and note (:class:`~compfx.search.log.SearchLog`).
    * ``stage1_mode``, ``loss0`` (the FP32 epoch's loss), ``fp32_epoch_seconds``,
      ``search_seconds`` (wall time of the whole ``optimize`` call: what the
      search cost the user), ``step_seconds`` (median step of ``"fp32"``,
      ``"amp"`` and ``"chosen"``, from ``step_comparison``).
    * ``step_comparison``: the :class:`~compfx.search.compare.StepComparison`
      the report quotes: FP32's, AMP's and the chosen plan's steps, round by
      round, taken in one interleaved phase after the search on the same
      batches, with each plan's saved activation bytes.
    * ``cost_breakdown``: where ``search_seconds`` went, in seconds per part
      (``capture``, ``profiling``, ``rewrites``, ``compile`` (a compiled search's
      compiles, in untimed warm-up), ``samples``, ``step comparison``,
      ``other``); the parts add up to ``search_seconds``.
    * ``plan_path``: the plan-cache file the plan was saved to (None when it was
      not: ``SearchConfig(cache_plan=False)``, per-device plans, an unwritable
      cache); ``plan_cache`` says which, in words.

    ``report()`` renders it as text. The log of a finished search ends with
    :meth:`log_summary`, so :meth:`from_log` renders the same report later
    (``compfx report LOG``), without the model (``module`` is then None).
    """

    module: nn.Module | None
    plan: Plan
    stage1_plan: Plan
    analysis: object
    log: SearchLog
    stage1_mode: str
    loss0: float
    fp32_epoch_seconds: float
    search_seconds: float
    step_seconds: dict[str, float] = field(default_factory=dict)
    step_comparison: StepComparison | None = None
    plan_path: Path | None = None
    plan_cache: str = ""
    cost_breakdown: dict[str, float] = field(default_factory=dict)

    def report(self, tablefmt: str = "simple") -> str:
        """The per-op table, then the search and the timing summary (see :mod:`compfx.search.report`)."""
        return render_report(self, tablefmt)

    @property
    def samples_run(self) -> int:
        return len([r for r in self.log.samples() if r.stage in (Stage.STAGE1, Stage.STAGE2)])

    @property
    def samples_pruned(self) -> int:
        return len([r for r in self.log.samples() if r.status is SampleStatus.PRUNED])

    @property
    def fixed_seconds(self) -> float:
        """What the search cost besides its samples: capture, profiling, rewrites, the step comparison, the rest."""
        return self.search_seconds - self.cost_breakdown.get("samples", 0.0)

    @property
    def samples_skipped(self) -> int:
        return len([r for r in self.log.samples() if r.status is SampleStatus.SKIPPED])

    def log_summary(self) -> dict:
        """What ``compfx report LOG`` needs to render this result again, as JSON (the log's last note holds it)."""
        return {"plan": self.plan.to_dict(), "stage1_plan": self.stage1_plan.to_dict(),
                "ops": [[str(op.key), str(op.category), bool(op.tc_eligible), bool(getattr(op, "fp8_eligible", False)),
                         bool(getattr(op, "pad_eligible", False)), bool(getattr(op, "pinned", False))]
                        for op in self.analysis.ops], "fp8": bool(getattr(self.analysis, "fp8", False)),
                "stage1_mode": self.stage1_mode, "loss0": self.loss0, "fp32_epoch_seconds": self.fp32_epoch_seconds,
                "search_seconds": self.search_seconds, "step_seconds": dict(self.step_seconds),
                "step_comparison": self.step_comparison.to_dict() if self.step_comparison is not None else None,
                "plan_path": str(self.plan_path or ""), "plan_cache": self.plan_cache,
                "cost_breakdown": dict(self.cost_breakdown)}

    @classmethod
    def from_log(cls, log: SearchLog, source: str = "search log") -> "SearchResult":
        """The result a finished search wrote into its log (``module`` is None: a log holds no model).

        The last :data:`RESULT` note wins (a resumed search writes one more).
        A log without one (an interrupted search, an older compfx) is a
        :class:`~compfx.errors.PlanFileError`.
        """
        found = [r.extra[RESULT] for r in log.notes() if RESULT in r.extra]
        if not found:
            raise PlanFileError(f"{source} holds {len(log.samples())} samples but no finished search (it was "
                                "interrupted, or written by an older compfx), so there is no chosen plan to report. "
                                "Finish it with compfx.optimize(..., log=<this log>, resume=True).")
        data = found[-1]
        try:
            plan = Plan.from_dict(data["plan"], source=f"{source} (chosen plan)")
            ops = tuple(LoggedOp(OpKey.parse(key), Category(category), bool(tc), bool(fp8), *(bool(x) for x in later))
                        for key, category, tc, fp8, *later in data["ops"])  # later: pad_eligible, pinned (newer logs)
            analysis = LoggedAnalysis(ops, plan.low_dtype, plan.fingerprint, fp8=bool(data["fp8"]))
            return cls(module=None, plan=plan, stage1_plan=Plan.from_dict(data["stage1_plan"], source=source),
                       analysis=analysis, log=log, stage1_mode=str(data["stage1_mode"]), loss0=float(data["loss0"]),
                       fp32_epoch_seconds=float(data["fp32_epoch_seconds"]),
                       search_seconds=float(data["search_seconds"]),
                       step_seconds={str(k): float(v) for k, v in data["step_seconds"].items()},
                       step_comparison=(StepComparison.from_dict(data["step_comparison"])
                                        if data.get("step_comparison") else None),
                       plan_path=Path(data["plan_path"]) if data["plan_path"] else None,
                       plan_cache=str(data["plan_cache"]),
                       cost_breakdown={str(k): float(v) for k, v in data.get("cost_breakdown", {}).items()})
        except PlanFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PlanFileError(f"{source}: its result note is damaged ({type(error).__name__}: {error}); expected "
                                "what compfx.optimize writes. Search again.") from error

    def __repr__(self) -> str:
        return (f"SearchResult(plan={self.plan!r}, {len(self.log.samples())} samples, "
                f"search {self.search_seconds:.2f} s)")
