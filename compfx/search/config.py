"""How the search searches: :class:`SearchConfig`, and which of its settings decide the outcome.

Every field can change the plan the search picks unless its metadata says
``{DECIDES: False}`` (the progress bar; what state the model is left in). A
resumed search replays a log only when the settings that decide are the same
(:func:`decision_settings` writes them into the log's first line), so adding a
field here makes resume check it without more code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import BadInputError
from ..plan import Plan

__all__ = ["SearchConfig", "DECIDES", "decision_settings", "CostFn"]

CostFn = Callable[[Plan, float], float]

#: Field metadata key: False on a field that cannot change which plan the search picks.
DECIDES = "decides"


@dataclass(frozen=True)
class SearchConfig:
    """How :func:`compfx.optimize` searches. Frozen, and checked when built: a bad value fails before any work.

    * ``threshold``: a plan is accepted when its epoch loss is below
      ``loss_0 * threshold`` (``loss_0 + (threshold - 1) * |loss_0|``), loss_0
      being the FP32 epoch's. The paper uses 1.01.
    * ``stage1_budget``: most Stage-1 samples after the FP32 baseline; past
      ``2**k`` the space is reduced (see :func:`compfx.search.stage1.stage1_plan_space`).
    * ``stage2_budget``: most Stage-2 candidates timed, the Stage-1 winner included.
    * ``seed``: the RNG seed every sample starts from.
    * ``warmup``: untimed steps before each timed sample (a Stage-1 epoch or a
      Stage-2 timing), so that one-off costs of a plan's first steps are not
      counted; ``repeats``: timed steps per Stage-2 timing (their median counts).
    * ``grad_scaler``: scale the loss with ``torch.amp.GradScaler`` in every
      sample; ``None`` = on for float16, off for bfloat16 (it has FP32's range).
    * ``progress``: a tqdm bar over samples.
    * ``cost_fn(plan, seconds) -> float``: what the search minimises (default:
      the measured seconds). Stage 1 calls it on the running sum of per-batch
      seconds to prune; pruning is exact only if it never decreases as the
      seconds grow.
    * ``keep_search_training``: True leaves the model and optimizer in the state
      the chosen plan's Stage-1 epoch trained them to (that epoch is not wasted);
      False puts back the state they had before ``optimize``.
    * ``stage2_check_batches``: batches on which the Stage-2 winner's loss is
      checked against FP32's (0 skips the check).
    * ``prune``: False runs every Stage-1 sample to the end (to measure what pruning saves).
    * ``per_device``: under ``torch.distributed``, let ranks hold different plans
      (QSync's allocator, see :mod:`compfx.search.allocation`); ``memory_budget``: this
      rank's limit on activation bytes saved for backward per step (None: no limit).
    * ``predictor``: ``"on"`` profiles each op once (cached, see :mod:`compfx.costmodel`),
      runs Stage-1 candidates cheapest-predicted first and skips those whose
      predicted cost exceeds ``predictor_margin`` times the best measured accepted
      cost; ``"off"`` measures every candidate (the exact CoMP search).
    * ``early_stop``: with the cost model on, a Stage-1 sample stops once its
      pace, batch for batch against the best plan's, projects its epoch cost
      more than this fraction over the best accepted cost (None: never; with
      ``predictor="off"`` only exact pruning stops samples).
    """

    threshold: float = 1.01
    stage1_budget: int = 64
    stage2_budget: int = 32
    seed: int = 0
    warmup: int = 1
    repeats: int = 5
    grad_scaler: bool | None = None
    progress: bool = field(default=True, metadata={DECIDES: False})
    cost_fn: CostFn | None = None
    keep_search_training: bool = field(default=True, metadata={DECIDES: False})
    stage2_check_batches: int = 4
    prune: bool = True
    per_device: bool = False
    memory_budget: int | None = None
    predictor: str = "on"
    predictor_margin: float = 1.25
    early_stop: float | None = 0.05

    def __post_init__(self):
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold >= 1):
            raise BadInputError(f"SearchConfig(threshold={self.threshold!r}); expected a finite number >= 1, "
                                "e.g. 1.01 (accept plans whose loss is within 1% of FP32's).")
        for name, low in (("stage1_budget", 1), ("stage2_budget", 1), ("warmup", 0), ("repeats", 1),
                          ("stage2_check_batches", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise BadInputError(f"SearchConfig({name}={value!r}); expected an int >= {low}.")
        if not isinstance(self.seed, int):
            raise BadInputError(f"SearchConfig(seed={self.seed!r}); expected an int.")
        if self.cost_fn is not None and not callable(self.cost_fn):
            raise BadInputError(f"SearchConfig(cost_fn={self.cost_fn!r}); expected a callable (plan, seconds) -> float.")
        if self.predictor not in ("on", "off"):
            raise BadInputError(f"SearchConfig(predictor={self.predictor!r}); expected \"on\" or \"off\".")
        if not (isinstance(self.predictor_margin, (int, float)) and not isinstance(self.predictor_margin, bool)
                and self.predictor_margin >= 1):
            raise BadInputError(f"SearchConfig(predictor_margin={self.predictor_margin!r}); expected a number >= 1, "
                                "e.g. 1.25 (skip plans predicted 25% costlier than the best measured); "
                                "math.inf only reorders.")
        if self.early_stop is not None and not (isinstance(self.early_stop, (int, float))
                                                and not isinstance(self.early_stop, bool) and self.early_stop >= 0):
            raise BadInputError(f"SearchConfig(early_stop={self.early_stop!r}); expected a fraction >= 0, e.g. 0.05 "
                                "(stop a sample projected 5% over the best plan), or None.")
        if self.grad_scaler not in (None, True, False):
            raise BadInputError(f"SearchConfig(grad_scaler={self.grad_scaler!r}); expected None, True or False.")
        budget = self.memory_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise BadInputError(f"SearchConfig(memory_budget={budget!r}); expected a positive int (bytes of "
                                "activations saved for backward per step on this rank) or None.")
        if budget is not None and not self.per_device:
            raise BadInputError("SearchConfig(memory_budget=...) is a per-rank limit used by the per-device "
                                "allocator; set per_device=True as well, or leave memory_budget=None.")

    def scaler_on(self, low_dtype: torch.dtype) -> bool:
        return self.grad_scaler if self.grad_scaler is not None else low_dtype == torch.float16


def decision_settings(config: SearchConfig) -> dict:
    """The settings that can change the search's decision, as JSON values (for the log's first line).

    ``cost_fn`` is recorded by its qualified name: a resumed search must use
    the same function (a changed body under the same name cannot be told).

    >>> settings = decision_settings(SearchConfig(progress=False))
    >>> "progress" in settings, settings["threshold"], settings["cost_fn"]
    (False, 1.01, None)
    """
    return {f.name: _json_value(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.metadata.get(DECIDES, True)}


def _json_value(value):
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # inf and nan are not JSON
    return json.loads(json.dumps(value))
