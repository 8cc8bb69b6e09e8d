"""Graph passes: each takes a GraphModule and returns one. Importable as ``compfx.passes``.

* :func:`insert_casts`: give every keyed op the precision of its plan entry.
* :func:`cast_report` / :func:`count_casts`: count the dtype conversions in a graph
  (Campo's "casts per plan" metric); :func:`count_autocast_casts` counts the ones
  real ``torch.autocast`` performs, for comparison.
"""

from .cast_report import CastReport, cast_report, count_autocast_casts, count_casts, is_cast
from .insert_casts import CAST_META, AutocastRegion, insert_casts

__all__ = ["insert_casts", "AutocastRegion", "CAST_META", "cast_report", "count_casts", "count_autocast_casts",
           "CastReport", "is_cast"]
