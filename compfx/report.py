"""The search report: which precision each op got, what the search cost, what the plan gains.

``result.report()`` renders the :class:`~compfx.search.SearchResult` that
:func:`compfx.optimize` returns (:func:`render_report`, from
:mod:`compfx.search.report`); :func:`render_log_report` renders the same
report from a finished search's log alone (``compfx report LOG``).
"""

from __future__ import annotations

from .search.log import SearchLog
from .search.report import op_table, predicted_records, prediction_error, prediction_table, render_report
from .search.result import SearchResult

__all__ = ["render_report", "render_log_report", "op_table", "prediction_table", "prediction_error",
           "predicted_records"]


def render_log_report(path, tablefmt: str = "simple") -> str:
    """The report of the search logged at ``path``, as ``result.report()`` rendered it (``compfx report LOG``).

    A finished search's last log line holds what the report needs besides the
    samples (:meth:`SearchResult.log_summary`); a log without it (an interrupted
    search) is a :class:`~compfx.errors.PlanFileError`.

    >>> import tempfile, os, torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    >>> loader = [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(2)]
    >>> path = os.path.join(tempfile.mkdtemp(), "search.jsonl")
    >>> result = compfx.optimize(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), log=path,
    ...                          loss_fn=lambda out, batch: torch.nn.functional.cross_entropy(out, batch[-1]),
    ...                          config=compfx.SearchConfig(progress=False, repeats=1, warmup=0, cache_plan=False))
    >>> render_log_report(path).splitlines()[:3] == result.report().splitlines()[:3]
    True
    """
    return render_report(SearchResult.from_log(SearchLog.read(path), source=f"search log {path}"), tablefmt)
