"""Accuracy metrics the benchmarks report (compfx itself never scores its own predictions).

>>> median_abs_percentage_error([1.1, 0.9, 2.0], [1.0, 1.0, 2.0])
10.0
"""

from __future__ import annotations

import statistics
from typing import Sequence

from compfx.errors import BadInputError

__all__ = ["median_abs_percentage_error"]


def median_abs_percentage_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median of ``|predicted - measured| / measured`` in percent, rounded to 6 decimals.

    >>> median_abs_percentage_error([3.0], [2.0])
    50.0
    """
    if len(predicted) != len(measured) or not measured:
        raise BadInputError(f"got {len(predicted)} predictions and {len(measured)} measurements; expected equal, "
                            "non-zero counts.")
    return round(statistics.median(abs(p - m) / m * 100.0 for p, m in zip(predicted, measured)), 6)
