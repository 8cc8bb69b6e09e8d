"""Graph passes: each takes a GraphModule and returns one (or reads it). Importable as ``compfx.passes``.

This folder sits at the repository root (the required layout) and installs as ``compfx.passes``
(``pyproject.toml``'s ``package-dir``).

* :func:`insert_casts` (``insert_casts.py``): give every keyed op the precision of its plan entry.
* :func:`restore_output_dtypes` (``restore_output_dtypes.py``): return the outputs in the model's own dtypes.
* :func:`pad_shapes` (``pad_shapes.py``): zero-pad the plan's padded ops to the Tensor Core multiple, slice back.
* :func:`float8_matmuls` (``float8.py``): run the plan's ``fp8`` ops through torchao's float8 training matmul.
* :func:`follow_dtype_limits` (``follow_dtype_limits.py``): a ``torch.finfo(x.dtype)`` literal follows ``x``'s new dtype.
* :func:`propagate_dtypes` (``propagate_dtypes.py``): refresh ``meta["val"]`` after dtypes changed.
* :func:`cast_report` / :func:`casts_in` / :func:`count_casts` (``cast_report.py``): the casts in a graph
  (Campo's "casts per plan" metric); :func:`count_autocast_casts` counts the ones real ``torch.autocast``
  performs, for comparison.

:func:`apply_precisions` runs the rewrite passes in order; :func:`compfx.apply` and the compile backend call it.
The rules the passes apply (what a cast is, which inputs are cast, who shares a cast) live in
:mod:`compfx.cast_policy`.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.fx as fx

from compfx.opkey import OpKey
from compfx.vocabulary import Category, Float8Recipe, Precision

from .float8 import Float8Matmul, float8_matmuls
from .cast_report import CastInfo, CastReport, cast_report, casts_in, count_autocast_casts, count_casts
from .follow_dtype_limits import follow_dtype_limits
from .insert_casts import insert_casts
from .pad_shapes import pad_shapes
from .propagate_dtypes import propagate_dtypes
from .restore_output_dtypes import output_dtypes, restore_output_dtypes

__all__ = ["apply_precisions", "insert_casts", "pad_shapes", "float8_matmuls", "Float8Matmul", "follow_dtype_limits",
           "restore_output_dtypes", "output_dtypes", "propagate_dtypes",
           "cast_report", "casts_in", "count_casts", "count_autocast_casts", "CastReport", "CastInfo"]


def apply_precisions(gm: fx.GraphModule, precisions: Mapping[OpKey, Precision | str], *, low_dtype: torch.dtype,
                     categories: Mapping[OpKey, Category | str] | None = None,
                     default_precision: Precision | str | None = None,
                     restore_outputs: bool = True, fp8_recipe: Float8Recipe | str | None = None,
                     padded: Iterable[OpKey] = ()) -> fx.GraphModule:
    """:func:`insert_casts`, :func:`pad_shapes` (the ``padded`` ops), :func:`float8_matmuls` (ops at ``fp8``,
    scaled by ``fp8_recipe``), :func:`follow_dtype_limits`, then (unless ``restore_outputs`` is False)
    :func:`restore_output_dtypes`; returns ``gm``. Padding is after the casts, so operands are padded in the dtype
    the op computes in.

    >>> import torch, compfx
    >>> from compfx.passes import apply_precisions
    >>> gm = compfx.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.randn(2, 4))
    >>> gm = apply_precisions(gm, {n.meta["compfx_key"]: "low" for n in compfx.graph_capture.op_nodes(gm)}, low_dtype=torch.bfloat16)
    >>> gm(torch.randn(2, 4)).dtype, compfx.passes.count_casts(gm)
    (torch.float32, 4)
    """
    dtypes = output_dtypes(gm)
    insert_casts(gm, precisions, low_dtype=low_dtype, categories=categories, default_precision=default_precision)
    pad_shapes(gm, [key for key in padded if precisions.get(key) != Precision.FP8])  # the float8 path pads nothing
    float8_matmuls(gm, precisions, recipe=fp8_recipe)
    follow_dtype_limits(gm)
    return restore_output_dtypes(gm, dtypes) if restore_outputs else gm
