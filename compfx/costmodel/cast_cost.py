"""The cast-cost fit: seconds of one dtype cast as ``alpha * numel + beta``, per (src, dst) dtype pair.

Casts are timed with :func:`compfx.measure.time_fastest` at a few sizes and a
line is fitted to them; the fit is cached through :mod:`compfx.cache` beside
the op profiles, keyed by the dtype pair, the sizes and the machine, and
trusted under the same rule as the profiles: a fit measured under other
conditions (:class:`~compfx.measure.Conditions`), or a damaged one, is fitted again.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..cache import discard_entry, entry_path, profile_folder, read_entry, write_entry
from ..errors import BadInputError, SearchError
from ..measure import Conditions, check_clock, device_name, environment_key, measure_conditions, time_fastest
from ..vocabulary import default_low_dtype, dtype_from_name, dtype_name

__all__ = ["CastCost", "fit_cast_cost", "DEFAULT_CAST_SIZES", "CAST_COST_FORMAT"]

#: ``format`` of a cast-cost cache entry.
CAST_COST_FORMAT = "compfx-cast-cost"
#: Version written into every entry and part of its key.
CACHE_VERSION = 1
#: Tensor sizes (elements) the fit times each cast at: small casts, where ``beta`` dominates, are most of a model's.
DEFAULT_CAST_SIZES = (1 << 8, 1 << 12, 1 << 16, 1 << 20)


@dataclass(frozen=True)
class CastCost:
    """Seconds of one dtype cast as ``alpha * numel + beta``, per (src, dst) dtype pair.

    >>> cost = CastCost({(torch.float32, torch.bfloat16): (1e-9, 2e-6)})
    >>> round(cost.seconds(torch.float32, torch.bfloat16, 1000), 9)
    3e-06
    """

    coefficients: Mapping[tuple[torch.dtype, torch.dtype], tuple[float, float]]
    device: str = ""

    def seconds(self, src: torch.dtype, dst: torch.dtype, numel: int) -> float:
        if src == dst:
            return 0.0
        if (src, dst) not in self.coefficients:
            known = ", ".join(f"{dtype_name(s)}->{dtype_name(d)}" for s, d in self.coefficients)
            raise SearchError(f"no cast cost fitted for {dtype_name(src)}->{dtype_name(dst)} (fitted: {known}); "
                              "call fit_cast_cost(device=..., pairs=...) with this pair.")
        alpha, beta = self.coefficients[(src, dst)]
        return alpha * numel + beta

    def to_dict(self) -> dict:
        return {"device": self.device,
                "pairs": [{"src": dtype_name(s), "dst": dtype_name(d), "alpha": a, "beta": b}
                          for (s, d), (a, b) in self.coefficients.items()]}

    @classmethod
    def from_dict(cls, data: Mapping) -> "CastCost":
        return cls({(dtype_from_name(p["src"]), dtype_from_name(p["dst"])): (float(p["alpha"]), float(p["beta"]))
                    for p in data["pairs"]}, str(data.get("device", "")))


def fit_cast_cost(
    *,
    device: torch.device | str = "cpu",
    pairs: Sequence[tuple[torch.dtype, torch.dtype]] | None = None,
    sizes: Sequence[int] = DEFAULT_CAST_SIZES,
    repeats: int = 3,
    clock: str = "wall",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    refresh: bool = False,
    conditions: Conditions | None = None,
) -> CastCost:
    """Fit ``alpha * numel + beta`` to measured cast times for each (src, dst) pair on ``device``.

    ``pairs`` defaults to FP32 <-> the device's default low dtype (fp16 on CUDA,
    bf16 elsewhere). The fit is least squares on relative error (rows weighted
    by 1/time), because small tensors, where ``beta`` dominates, are most of the
    casts in a model. Coefficients are clamped at 0. ``refresh=True`` measures
    again and overwrites the cached fit, as does a cached fit taken under other
    ``conditions`` than now's (default: :func:`~compfx.measure.measure_conditions`).

    >>> cost = fit_cast_cost(device="cpu", sizes=(256, 4096, 65536), use_cache=False)
    >>> cost.seconds(torch.float32, torch.bfloat16, 65536) > cost.seconds(torch.float32, torch.bfloat16, 256)
    True
    """
    device = torch.device(device)
    if pairs is None:
        low = default_low_dtype(device)
        pairs = ((torch.float32, low), (low, torch.float32))
    if len(set(sizes)) < 2:
        raise BadInputError(f"fit_cast_cost(sizes={tuple(sizes)}); fitting alpha*numel + beta needs at least two "
                            "distinct sizes.")
    check_clock(clock, device=device)
    folder = profile_folder(cache_dir) if use_cache else None
    if folder is not None and conditions is None:
        conditions = measure_conditions(device=device, clock=clock)
    sizes = sorted(set(sizes))
    coefficients = {}
    for src, dst in pairs:
        key = {"cast": [dtype_name(src), dtype_name(dst)], "sizes": sizes,
               **environment_key(device=device, clock=clock), "version": CACHE_VERSION}
        path = entry_path(folder, key) if folder is not None else None
        cached = read_entry(path, key, CAST_COST_FORMAT) if path is not None and not refresh else None
        fit = _usable_fit(path, cached, conditions) if cached is not None else None
        if fit is None:
            times = [_time_cast(src, dst, n, device, repeats, clock) for n in sizes]
            fit = _fit_line(sizes, times)
            if path is not None:
                write_entry(path, key, CAST_COST_FORMAT, CACHE_VERSION,
                            {"alpha": fit[0], "beta": fit[1], "times": times,
                             "conditions": conditions.to_dict() if conditions is not None else None})
        coefficients[(src, dst)] = fit
    return CastCost(coefficients, device_name(device))


def _usable_fit(path, cached, conditions: Conditions | None) -> tuple[float, float] | None:
    """A cached fit's (alpha, beta) when it is well formed and measured under conditions like now's."""
    alpha, beta = cached.get("alpha"), cached.get("beta")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in (alpha, beta)):
        discard_entry(path, f"its alpha {alpha!r} / beta {beta!r} are not what compfx writes")
        return None
    if conditions is not None:
        recorded = Conditions.from_dict(cached.get("conditions"))
        if recorded is None or recorded.differ(conditions) is not None:
            return None
    return float(alpha), float(beta)


def _time_cast(src: torch.dtype, dst: torch.dtype, numel: int, device: torch.device, repeats: int,
               clock: str) -> float:
    source = torch.randn(numel, device=device).to(src)
    return time_fastest(lambda: source.to(dst), device=device, repeats=repeats, warmup=1, block_s=5e-4,
                        budget_s=5e-3, clock=clock)


def _fit_line(sizes: Sequence[int], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` of ``times ~ alpha * sizes + beta`` on relative error, clamped at 0."""
    x = torch.tensor(sizes, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    weight = 1.0 / y.clamp_min(1e-12)
    design = torch.stack([x, torch.ones_like(x)], dim=1) * weight[:, None]
    solution = torch.linalg.lstsq(design, (y * weight)[:, None]).solution.squeeze(1)
    return max(float(solution[0]), 0.0), max(float(solution[1]), 0.0)
