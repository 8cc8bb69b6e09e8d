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
import numbers
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import BadInputError
from ..plan import Plan
from ..vocabulary import Float8Recipe
from .compare import DecisionRule

__all__ = ["SearchConfig", "DECIDES", "decision_settings", "CostFn"]

CostFn = Callable[[Plan, float], float]

#: Field metadata key: False on a field that cannot change which plan the search picks.
DECIDES = "decides"
#: The seeds ``torch.manual_seed`` accepts.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


def _refuse(name: str, value, expected: str):
    raise BadInputError(f"SearchConfig({name}={value!r}); expected {expected}, not a {type(value).__name__}.")


@dataclass(frozen=True)
class SearchConfig:
    """How :func:`compfx.optimize` searches. Frozen, and checked when built: a bad value fails before any work.

    * ``threshold``: a plan is accepted when its epoch loss is below
      ``loss_0 * threshold`` (``loss_0 + (threshold - 1) * |loss_0|``), loss_0
      being the FP32 epoch's. The paper uses 1.01.
    * ``stage1_budget``: most Stage-1 samples after the FP32 baseline; past
      ``2**k`` the space is reduced (see :func:`compfx.search.stage1_space.stage1_plan_space`).
    * ``stage2_budget``: most Stage-2 candidates timed, the Stage-1 winner included.
    * ``seed``: the RNG seed every sample starts from.
    * ``warmup``: untimed steps before each timed sample (a Stage-1 epoch, a
      Stage-2 timing, a duel), so that one-off costs of a plan's first steps are
      not counted; ``repeats``: timed steps per Stage-2 timing (their median counts).
    * ``margin``, ``confidence``, ``rounds``: the decision rule
      (:mod:`compfx.search.compare`). A candidate replaces the incumbent (first
      AMP's plan, then FP32's, then the candidates in a fixed order) only when it
      is faster by more than ``margin`` (a fraction: 0.03 is 3%), at
      ``confidence``, on ``rounds`` pairs of interleaved steps on the same
      batches (up to three blocks of them while undecided); or, saving fewer
      activation bytes, when it is not slower by more than ``margin``. Ties keep
      the incumbent. ``rounds=0`` decides on the stages' own timings alone, and
      with ``margin=0`` that is CoMP's rule (the cheaper plan wins). The report's
      step comparison of FP32, AMP and the chosen plan takes ``rounds`` rounds too.
    * ``grad_scaler``: scale the loss with ``torch.amp.GradScaler`` in every
      sample; ``None`` = on for float16, off for bfloat16 (it has FP32's range).
    * ``progress``: a tqdm bar over samples.
    * ``cost_fn(plan, seconds) -> float``: what the search minimises (default:
      the measured seconds). Stage 1 calls it on the running sum of per-batch
      seconds to prune; pruning is exact only if it never decreases as the
      seconds grow.
    * ``keep_search_training``: True leaves the model and optimizer in the state
      the chosen plan's Stage-1 epoch trained them to (that epoch is not wasted);
      False puts back the state they had before ``optimize``. A learning-rate
      scheduler is never stepped by the search: with True, the optimizer has
      taken an epoch of steps that your scheduler has not counted.
    * ``stage2_check_batches``: batches on which the Stage-2 winner's loss is
      checked against FP32's (0 skips the check).
    * ``prune``: False runs every Stage-1 sample to the end (to measure what pruning saves).
    * ``per_device``: under ``torch.distributed``, let ranks hold different plans
      (QSync's allocator, see :mod:`compfx.search.allocation`).
    * ``memory_budget``: the most activation bytes one forward of the chosen
      plan may save for backward (measured as :func:`compfx.saved_activation_bytes`
      does, on the loader's first batch; per rank under ``torch.distributed``);
      plans over it are rejected before they run. None: no limit.
    * ``predictor``: ``"on"`` profiles each op once (cached, see :mod:`compfx.costmodel`),
      skips Stage-1 candidates the profiles show cannot beat the incumbent by
      more than ``margin`` (their predicted cost against the incumbent's), and,
      where the incumbent cannot be priced, those whose predicted cost exceeds
      ``predictor_margin`` times its measured cost; ``"off"`` measures every
      candidate (the exact CoMP search).
    * ``early_stop``: with the cost model on, a Stage-1 sample stops once its
      pace, batch for batch against the incumbent's, projects its epoch cost
      more than this fraction over the most it may cost to challenge the
      incumbent under the decision rule (None: never; with ``predictor="off"``
      only exact pruning stops samples).
    * ``cache_plan``: save the chosen plan to the plan cache (:mod:`compfx.cache`),
      so that ``torch.compile(model, backend="compfx")`` runs it; ``cache_dir``:
      the cache folder for that plan and for the cost model's profiles (None:
      ``$COMPFX_CACHE_DIR``, else ``~/.cache/compfx/plans``). Neither changes the decision.
    * ``fp8``: Stage 1 also tries FP8 for ops that can run it (:mod:`compfx.float8`;
      needs ``compfx[fp8]``), scaled by ``fp8_recipe`` (``"tensorwise"``,
      ``"rowwise"`` or ``"rowwise_with_gw_hp"``, torchao's recipe names). Where
      float8 GEMMs are emulated (no GPU of compute capability 8.9+) FP8 is slow,
      so give a ``cost_fn`` that prices it as the target hardware would.
    * ``verify_capture``: before searching, check that the captured graph trains
      exactly as the model does (:func:`compfx.capture.verify.verify_capture`: one
      forward and backward of each; a graph that would train differently is refused
      with :class:`~compfx.errors.CaptureError`). False skips the check, at the risk
      of training something other than the model; it does not change the decision.
    * ``search_pinned``: ops inside the model's own ``torch.autocast(enabled=False)``
      blocks are pinned to FP32 (``OpInfo.pinned``), as autocast keeps them; the
      search never lowers them unless this is True, which searches them as the
      op kinds they are.
    * ``tie_blocks``: the same op in every repeat of a block (``blocks.0``,
      ``blocks.1``, ... holding the same ops) is one Stage-1 decision, so
      Stage 1's candidates do not grow with depth; then each tied decision is
      tried on its own in the first and in the last repeat, where precision
      matters most (:mod:`compfx.search.tied_blocks`).

    Every field's type is checked strictly: a bool is ``True`` or ``False`` (not
    ``"no"``), a number is a real int or float (not a bool), finite and in range.

    >>> SearchConfig(prune="no")
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: SearchConfig(prune='no'); expected True or False, not a str.
    """

    threshold: float = 1.01
    margin: float = 0.03
    confidence: float = 0.95
    rounds: int = 7
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
    cache_plan: bool = field(default=True, metadata={DECIDES: False})
    cache_dir: str | os.PathLike | None = field(default=None, metadata={DECIDES: False})
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    verify_capture: bool = field(default=True, metadata={DECIDES: False})
    search_pinned: bool = False
    tie_blocks: bool = False

    def __post_init__(self):
        self._real("threshold", low=1, example="1.01 (accept plans whose loss is within 1% of FP32's)")
        for name, low in (("stage1_budget", 1), ("stage2_budget", 1), ("warmup", 0), ("repeats", 1),
                          ("stage2_check_batches", 0), ("rounds", 0)):
            self._int(name, low)
        self._real("margin", low=0, example="0.03 (a candidate must be more than 3% faster to replace the incumbent)")
        self._real("confidence", low=0, example="0.95 (the duel's interval covers the median ratio 95% of the time)")
        if not self.margin < 1:
            raise BadInputError(f"SearchConfig(margin={self.margin!r}); expected a fraction below 1, e.g. 0.03.")
        if not 0 < self.confidence < 1:
            raise BadInputError(f"SearchConfig(confidence={self.confidence!r}); expected a probability in (0, 1), "
                                "e.g. 0.95.")
        try:
            self.rule.check_rounds()
        except BadInputError as error:
            raise BadInputError(f"SearchConfig: {error}.") from None
        self._int("seed", _SEED_MIN, _SEED_MAX, "what torch.manual_seed accepts")
        for name in ("progress", "keep_search_training", "prune", "per_device", "cache_plan", "fp8", "verify_capture",
                     "search_pinned", "tie_blocks"):
            if not isinstance(getattr(self, name), bool):
                _refuse(name, getattr(self, name), "True or False")
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, bool):
            _refuse("grad_scaler", self.grad_scaler, "None, True or False")
        if self.cost_fn is not None and not callable(self.cost_fn):
            raise BadInputError(f"SearchConfig(cost_fn={self.cost_fn!r}); expected a callable (plan, seconds) -> float.")
        if not isinstance(self.predictor, str) or self.predictor not in ("on", "off"):
            raise BadInputError(f"SearchConfig(predictor={self.predictor!r}); expected \"on\" or \"off\".")
        self._real("predictor_margin", low=1, allow_inf=True,
                   example="1.25 (skip plans predicted 25% costlier than the best measured); math.inf only reorders")
        if self.early_stop is not None:
            self._real("early_stop", low=0, example="0.05 (stop a sample projected 5% over the best plan), or None")
        if self.memory_budget is not None:
            self._int("memory_budget", 1, what="bytes of activations saved for backward per step (per rank), "
                      "or None")
        object.__setattr__(self, "fp8_recipe", Float8Recipe.parse(self.fp8_recipe, "SearchConfig(fp8_recipe)"))
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            _refuse("cache_dir", self.cache_dir, "a folder path (str or os.PathLike) or None")

    def _int(self, name: str, low: int, high: int | None = None, what: str = "") -> None:
        """An integral field (not a bool) in [low, high], stored as a plain int."""
        value = getattr(self, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low \
                or (high is not None and value > high):
            bound = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
            raise BadInputError(f"SearchConfig({name}={value!r}); expected {bound}" + (f" ({what})" if what else "")
                                + ".")
        object.__setattr__(self, name, int(value))

    def _real(self, name: str, *, low: float, example: str, allow_inf: bool = False) -> None:
        """A real field (not a bool), finite (or +inf where allowed) and >= low, stored as a float."""
        value = getattr(self, name)
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value) \
            and (math.isfinite(value) or (allow_inf and value > 0)) and value >= low
        if not ok:
            finite = "a number" if allow_inf else "a finite number"
            raise BadInputError(f"SearchConfig({name}={value!r}); expected {finite} >= {low:g}, e.g. {example}.")
        object.__setattr__(self, name, float(value))

    @property
    def rule(self) -> DecisionRule:
        """The decision rule these settings make (:mod:`compfx.search.compare`)."""
        return DecisionRule(margin=self.margin, confidence=self.confidence, rounds=self.rounds)

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
