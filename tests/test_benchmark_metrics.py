"""The metrics the benchmarks report."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import compfx
from benchmarks.metrics import median_abs_percentage_error


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0.01, 10)), min_size=1, max_size=9))
def test_median_abs_percentage_error_matches_its_definition(pairs):
    predicted, measured = zip(*pairs)
    errors = sorted(abs(p - m) / m * 100 for p, m in pairs)
    middle = len(errors) // 2
    expected = errors[middle] if len(errors) % 2 else (errors[middle - 1] + errors[middle]) / 2
    assert median_abs_percentage_error(predicted, measured) == pytest.approx(expected, abs=5e-7)  # 6 decimals


@pytest.mark.parametrize("predicted, measured", [([], []), ([1.0], [1.0, 2.0])])
def test_median_abs_percentage_error_refuses_mismatched_counts(predicted, measured):
    with pytest.raises(compfx.BadInputError, match="equal"):
        median_abs_percentage_error(predicted, measured)
