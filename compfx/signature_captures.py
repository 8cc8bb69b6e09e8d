"""The captures of one model per input signature, which every :class:`~compfx.planned_module.PlannedModule` of that
model shares, and what meeting a new signature cost (:class:`Specialization`).

A graph that :func:`compfx.capture` recorded (or dynamo exported) holds the example inputs' sizes as constants, so
a planned module meets each new input signature (batch size, sequence length, dtype, train/eval modes) by capturing
the model again there; a search runs many plans over the same batches, so each signature is captured once here and
each plan only rewrites it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable

import torch
import torch.nn as nn

from .analysis import Analysis, analyze_graph
from .errors import CaptureError
from .graph_capture import capture, describe_inputs
from .opkey import OpKey
from .vocabulary import Category

__all__ = ["Specialization", "SignatureCaptures"]


@dataclass(frozen=True)
class Specialization:
    """One input signature a :class:`PlannedModule` met after its first: what it cost, and how the plan fit.

    ``inputs`` describes the shapes; ``capture_seconds`` is 0 when another
    module of the same :class:`SignatureCaptures` had captured this signature
    already; ``unplanned`` are ops of this graph that the plan does not name
    (they follow), ``missing`` plan entries whose op this graph lacks,
    ``fp8_fallbacks`` the plan's FP8 ops that cannot run FP8 at these shapes,
    with why (they run low here: :func:`compfx.float8.fp8_fallbacks`).
    """

    inputs: str
    training: bool
    capture_seconds: float
    rewrite_seconds: float
    unplanned: tuple[OpKey, ...] = ()
    missing: int = 0
    fp8_fallbacks: tuple[tuple[OpKey, str], ...] = ()


class SignatureCaptures:
    """Captures of one model per input signature, shared by every :class:`PlannedModule` of that model.

    A search runs many plans over the same batches; each signature is captured
    and analysed once, and each plan only rewrites it. ``analysis`` is the
    first capture; its settings (method, leaf modules, modes, device, low
    dtype, categories) are reused for every other signature, so the op keys
    mean the same thing in each.
    """

    def __init__(self, model: nn.Module, analysis: Analysis, *, device: torch.device | None = None):
        self.model, self.analysis = model, analysis
        self.device = device if device is not None else analysis.device  # where the captures are made
        self.categories = {op.key: op.category for op in analysis.ops}
        self._by_signature: dict[Hashable, Analysis] = {}
        if device is None and analysis.example_signature is not None:
            self._by_signature[analysis.example_signature] = analysis

    def again(self, device: torch.device) -> "SignatureCaptures":
        """Captures made anew (none kept), with the same settings, of the model as it is now on ``device``."""
        return SignatureCaptures(self.model, self.analysis, device=device)

    def __len__(self) -> int:
        return len(self._by_signature)

    def get(self, signature: Hashable, args: tuple, kwargs: dict, modes: dict[str, bool]) -> tuple[Analysis, float]:
        """The analysis at ``signature`` (captured now, in ``modes``, each module's train/eval mode, if need be), and
        the seconds that capture took (0 if cached)."""
        found = self._by_signature.get(signature)
        if found is not None:
            return found, 0.0
        start = time.perf_counter()
        base = self.analysis
        training = modes.get("", True)
        try:
            gm = capture(self.model, (args, kwargs), method=base.capture_method, leaf_modules=base.leaf_modules,
                         modes=modes)
        except CaptureError as error:
            raise CaptureError(
                f"inputs {describe_inputs(args, kwargs)} ({'train' if training else 'eval'} mode) are a new input "
                f"signature, and capturing {type(self.model).__name__} again for them ({base.capture_method}, the "
                f"tracer of the first capture) failed: {error}. Use batches of shapes it captures at (e.g. "
                "DataLoader(..., drop_last=True) for a ragged last batch), or make forward capturable at these "
                "shapes.") from error
        analysis = analyze_graph(gm, device=self.device, low_dtype=base.low_dtype, fp8=base.fp8)
        self._by_signature[signature] = analysis
        return analysis, time.perf_counter() - start

    def categories_of(self, analysis: Analysis) -> dict[OpKey, Category]:
        """The first analysis's category for each op it has (overrides included), the default classification else."""
        return {op.key: self.categories.get(op.key, op.category) for op in analysis.ops}
