"""How the search searches: :class:`SearchConfig`, and which of its settings decide the outcome.

Every field can change the plan the search picks unless its metadata says
``{DECIDES: False}`` (the progress bar; what state the model is left in). A
resumed search replays a log only when the settings that decide are the same
(:func:`decision_settings` writes them into the log's first line), so adding a
field here makes resume check it without more code. The decision rule is a
nested frozen config (:class:`~compfx.search.compare.DecisionRule`), written to
the log as its own fields; a field whose logged form differs from its value says
so in its metadata (``{LOGGED_AS: function}``), so that logs written before the
field changed type still resume; a field newer than the logs already written
is logged only when set (``{LOGGED_WHEN_SET: True}``), so that a log written
before it existed, when every search ran at its default, still resumes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..compile_options import CompileOptions
from ..errors import BadInputError
from ..plan import Plan
from ..vocabulary import Float8Recipe
from .compare import DecisionRule

__all__ = ["SearchConfig", "DECIDES", "LOGGED_AS", "LOGGED_WHEN_SET", "decision_settings", "CostFn"]

CostFn = Callable[[Plan, float], float]

#: Field metadata key: False on a field that cannot change which plan the search picks.
DECIDES = "decides"
#: Field metadata key: the function that gives a field's value as the log's first line writes it.
LOGGED_AS = "logged_as"
#: Field metadata key: True on a field logged only when it is not at its default (a log written before the field
#: existed has no entry for it, and resumes at the default).
LOGGED_WHEN_SET = "logged_when_set"
#: The most ``warmup``, ``repeats`` and the decision rule's ``rounds`` may be: each counts steps every sample or
#: duel takes, and the search takes dozens of those; a thousand is already a search of hours on a model whose step
#: takes a second.
MAX_STEPS = 1000
#: The seeds ``torch.manual_seed`` accepts.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


def _refuse(name: str, value, expected: str):
    raise BadInputError(f"SearchConfig({name}={value!r}); expected {expected}, not a {type(value).__name__}.")


def _on_or_off(predictor: bool) -> str:
    """``predictor`` as logs wrote it when it was the string ``"on"`` or ``"off"`` (they still resume)."""
    return "on" if predictor else "off"


#: SearchConfig's keywords before the decision rule was nested: now ``decision=DecisionRule(...)``'s fields.
_DECISION_KEYWORDS = ("margin", "confidence", "rounds")


def _accepts_old_keywords(cls):
    """Let ``cls(...)`` take the keywords of the release before for one release more, each with a
    DeprecationWarning that says what to write: the decision rule's fields given flat, and ``predictor="on"`` /
    ``"off"``. (``dataclasses.replace(config, margin=...)`` goes through here too.)"""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, **kwargs):
        flat = {name: kwargs.pop(name) for name in _DECISION_KEYWORDS if name in kwargs}
        if flat:
            given = ", ".join(f"{name}={value!r}" for name, value in flat.items())
            warnings.warn(f"SearchConfig({given}) is deprecated: the decision rule is one setting now, "
                          f"SearchConfig(decision=compfx.DecisionRule({given})).", DeprecationWarning, stacklevel=2)
            base = kwargs.get("decision", DecisionRule())
            kwargs["decision"] = dataclasses.replace(base, **flat) if isinstance(base, DecisionRule) else base
        predictor = kwargs.get("predictor")
        if isinstance(predictor, str) and predictor in ("on", "off"):
            warnings.warn(f"SearchConfig(predictor={predictor!r}) is deprecated: predictor is a bool now, "
                          f"SearchConfig(predictor={predictor == 'on'}).", DeprecationWarning, stacklevel=2)
            kwargs["predictor"] = predictor == "on"
        generated(self, **kwargs)

    cls.__init__ = __init__
    return cls


def _deprecated_read(config: "SearchConfig", name: str):
    warnings.warn(f"SearchConfig.{name} is deprecated: read config.decision.{name}.", DeprecationWarning, stacklevel=3)
    return getattr(config.decision, name)


@_accepts_old_keywords
@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How :func:`compfx.optimize` searches. Frozen, and checked when built: a bad value fails before any work.

    Every field's type is checked strictly: a bool is ``True`` or ``False`` (not
    ``"no"``), a number is a real int or float (not a bool), finite and in range.
    The settings that can change the decision are written into the search log,
    and a resumed search must use the same (:func:`decision_settings`).

    Args:
        threshold: the convergence guard: a plan is accepted when its epoch loss is below ``loss_0 * threshold``
            (``loss_0 + (threshold - 1) * |loss_0|``), loss_0 being the FP32 epoch's. The paper uses 1.01.
        decision: when a candidate replaces the incumbent (:class:`~compfx.search.compare.DecisionRule`:
            ``margin``, ``confidence``, ``rounds``): by default more than 3% faster at 95% confidence, on 7
            pairs of interleaved steps.
        stage1_budget: most Stage-1 samples after the FP32 baseline; past ``2**k`` the space is reduced (see
            :func:`compfx.search.stage1_space.stage1_plan_space`).
        stage2_budget: most Stage-2 candidates timed, the Stage-1 winner included.
        seed: the RNG seed every sample starts from.
        warmup: untimed steps before each timed sample (a Stage-1 epoch, a Stage-2 timing, a duel), so that
            one-off costs of a plan's first steps are not counted.
        repeats: timed steps per Stage-2 timing (their median counts).
        grad_scaler: scale the loss with ``torch.amp.GradScaler`` in every sample; ``None``: on for float16, off
            for bfloat16 (it has FP32's range).
        progress: a tqdm bar over samples.
        cost_fn: ``cost_fn(plan, seconds) -> float``, what the search minimises (default: the measured
            seconds). Stage 1 calls it on the running sum of per-batch seconds to prune; pruning is exact only if
            it never decreases as the seconds grow.
        keep_search_training: True leaves the model and optimizer in the state the chosen plan's Stage-1 epoch
            trained them to (that epoch is not wasted); False puts back the state they had before ``optimize``.
            A learning-rate scheduler is never stepped by the search: with True, the optimizer has taken an
            epoch of steps that your scheduler has not counted.
        stage2_check_batches: batches on which the Stage-2 winner's loss is checked against FP32's (0 skips
            the check).
        prune: False runs every Stage-1 sample to the end (to measure what pruning saves).
        per_device: under ``torch.distributed``, let ranks hold different plans (QSync's allocator, see
            :mod:`compfx.search.allocation`).
        memory_budget: the most activation bytes one forward of the chosen plan may save for backward (measured
            as :func:`compfx.memory.saved_activation_bytes` does, on the loader's first batch; per rank under
            ``torch.distributed``); plans over it are rejected before they run. None: no limit.
        predictor: the cost model. True profiles each op once (cached, see :mod:`compfx.costmodel`), skips
            Stage-1 candidates the profiles show cannot beat the incumbent by more than the margin (their
            predicted cost against the incumbent's), and, where the incumbent cannot be priced, those whose
            predicted cost exceeds ``predictor_margin`` times its measured cost. False measures every candidate
            (the exact CoMP search).
        predictor_margin: see ``predictor``.
        early_stop: with the cost model on, a Stage-1 sample stops once its pace, batch for batch against the
            incumbent's, projects its epoch cost more than this fraction over the most it may cost to challenge
            the incumbent under the decision rule (None: never; with ``predictor=False`` only exact pruning stops
            samples).
        cache_plan: save the chosen plan to the plan cache (:mod:`compfx.cache`), so that
            ``torch.compile(model, backend="compfx")`` runs it. Does not change the decision.
        cache_dir: the cache folder for that plan and for the cost model's profiles (None:
            ``$COMPFX_CACHE_DIR``, else ``~/.cache/compfx/plans``). Does not change the decision.
        fp8: Stage 1 also tries FP8 for ops that can run it (:mod:`compfx.float8`; needs ``compfx[fp8]``).
            Where float8 GEMMs are emulated (no GPU of compute capability 8.9+) FP8 is slow, so give a
            ``cost_fn`` that prices it as the target hardware would.
        fp8_recipe: FP8's scaling, torchao's recipe name: ``"tensorwise"``, ``"rowwise"`` or
            ``"rowwise_with_gw_hp"``.
        verify_capture: before searching, check that the captured graph trains exactly as the model does
            (:func:`compfx.graph_capture.verify.verify_capture`: one forward and backward of each; a graph that
            would train differently is refused with :class:`~compfx.errors.CaptureError`). False skips the
            check, at the risk of training something other than the model; it does not change the decision.
        search_pinned: ops inside the model's own ``torch.autocast(enabled=False)`` blocks are pinned to FP32
            (``OpInfo.pinned``), as autocast keeps them; the search never lowers them unless this is True,
            which searches them as the op kinds they are.
        compile: measure every plan (FP32's, AMP's, the candidates, the duels, the step comparison and the loss
            check) as the program :func:`compfx.compile_with_plan` trains, under these
            :class:`~compfx.compile_options.CompileOptions`; ``True`` is ``CompileOptions()`` (Inductor), ``None``
            or ``False`` measures the eager planned modules. Each plan is compiled in untimed warm-up (the
            report's ``compile`` part); the chosen plan records the options (``plan.compile_options``), and
            ``result.module`` is its compiled program. Off (None) by default, on every device: each plan measured
            costs a compile, seconds to a minute with Inductor (on a CPU, gcc builds every kernel), which
            outweighs the samples of a small model, and a model that trains eagerly is measured best eagerly.
            Turn it on when you train under ``torch.compile``: fusion removes most of the casts an eager plan
            pays for, so the compiled ranking of plans can differ from the eager one (on a GPU most of all). A
            ``cost_fn`` sees the plan's ``compile_options`` too. With ``CompileOptions(regions="auto")`` each repeated
            block compiles as a region of its own, shared by the plans measured (a candidate that changes one
            block compiles that block's region alone), so the compile cost does not grow with depth.
        tie_blocks: the same op in every repeat of a block (``blocks.0``, ``blocks.1``, ... holding the same ops)
            is one Stage-1 decision, so Stage 1's candidates do not grow with depth; then each tied decision is
            tried on its own in the first and in the last repeat, where precision matters most
            (:mod:`compfx.search.tied_blocks`).

    Raises:
        BadInputError: a value of the wrong type or out of range, named with what was expected.

    The decision rule's fields given flat (``SearchConfig(margin=0.05)``) and
    ``predictor="on"``/``"off"`` still work for one release, with a
    DeprecationWarning that says what to write instead.

    Example::

        >>> import compfx
        >>> config = compfx.SearchConfig(decision=compfx.DecisionRule(margin=0.05), predictor=False)
        >>> config.decision.margin, config.decision.rounds, config.predictor
        (0.05, 7, False)
        >>> compfx.SearchConfig(prune="no")
        Traceback (most recent call last):
        ...
        compfx.errors.BadInputError: SearchConfig(prune='no'); expected True or False, not a str.
    """

    threshold: float = 1.01
    decision: DecisionRule = field(default_factory=DecisionRule)
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
    predictor: bool = field(default=True, metadata={LOGGED_AS: _on_or_off})
    predictor_margin: float = 1.25
    early_stop: float | None = 0.05
    cache_plan: bool = field(default=True, metadata={DECIDES: False})
    cache_dir: str | os.PathLike | None = field(default=None, metadata={DECIDES: False})
    fp8: bool = False
    fp8_recipe: str = "tensorwise"
    verify_capture: bool = field(default=True, metadata={DECIDES: False})
    search_pinned: bool = False
    compile: CompileOptions | bool | None = None
    tie_blocks: bool = field(default=False, metadata={LOGGED_WHEN_SET: True})

    def __post_init__(self):
        self._real("threshold", low=1, example="1.01 (accept plans whose loss is within 1% of FP32's)")
        for name, low in (("stage1_budget", 1), ("stage2_budget", 1), ("stage2_check_batches", 0)):
            self._int(name, low)
        for name, low in (("warmup", 0), ("repeats", 1)):  # steps of every sample
            self._int(name, low, MAX_STEPS, "steps per sample; more only makes a search that does not end")
        if not isinstance(self.decision, DecisionRule):
            _refuse("decision", self.decision, "a compfx.DecisionRule(margin=..., confidence=..., rounds=...)")
        if self.decision.rounds > MAX_STEPS:
            raise BadInputError(f"SearchConfig: DecisionRule(rounds={self.decision.rounds}); expected at most "
                                f"{MAX_STEPS} pairs of steps per duel; more only makes a search that does not end.")
        try:
            self.decision.check_rounds()
        except BadInputError as error:
            raise BadInputError(f"SearchConfig: {error}.") from None
        self._int("seed", _SEED_MIN, _SEED_MAX, "what torch.manual_seed accepts")
        for name in ("progress", "keep_search_training", "prune", "per_device", "predictor", "cache_plan", "fp8",
                     "verify_capture", "search_pinned", "tie_blocks"):
            if not isinstance(getattr(self, name), bool):
                _refuse(name, getattr(self, name), "True or False")
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, bool):
            _refuse("grad_scaler", self.grad_scaler, "None, True or False")
        if self.cost_fn is not None and not callable(self.cost_fn):
            raise BadInputError(f"SearchConfig(cost_fn={self.cost_fn!r}); expected a callable (plan, seconds) -> float.")
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
        if not (self.compile is None or isinstance(self.compile, (bool, CompileOptions))):
            _refuse("compile", self.compile, "None or False (eager), True (torch.compile with Inductor) or a "
                    "compfx.CompileOptions(...)")
        object.__setattr__(self, "compile", CompileOptions.of(self.compile))
        if self.compile is not None:
            self.compile.check_available()  # an inner backend this process cannot run fails now, not mid-search

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

    # the decision rule's fields, read flat: deprecated, as is giving them flat (_with_old_keywords)
    margin = property(lambda self: _deprecated_read(self, "margin"))
    confidence = property(lambda self: _deprecated_read(self, "confidence"))
    rounds = property(lambda self: _deprecated_read(self, "rounds"))

    @property
    def rule(self) -> DecisionRule:
        """Deprecated: the decision rule is the field ``decision`` now."""
        warnings.warn("SearchConfig.rule is deprecated: read config.decision.", DeprecationWarning, stacklevel=2)
        return self.decision

    def scaler_on(self, low_dtype: torch.dtype) -> bool:
        return self.grad_scaler if self.grad_scaler is not None else low_dtype == torch.float16


def decision_settings(config: SearchConfig) -> dict:
    """The settings that can change the search's decision, as JSON values (for the log's first line).

    Derived from the fields: each field that decides, as its JSON value (or its
    ``LOGGED_AS`` form); a nested config (the decision rule) as its own fields,
    under their own names, as logs wrote them before it was nested. ``cost_fn``
    is recorded by its qualified name and a digest of its code
    (:func:`_code_digest`): a resumed search must use the same function, and two
    lambdas, which share the name ``<lambda>``, are told apart by what they compute.

    >>> settings = decision_settings(SearchConfig(progress=False))
    >>> "progress" in settings, settings["threshold"], settings["margin"], settings["predictor"], settings["cost_fn"]
    (False, 1.01, 0.03, 'on', None)
    """
    settings = {}
    for f in dataclasses.fields(config):
        if not f.metadata.get(DECIDES, True):
            continue
        value = getattr(config, f.name)
        if f.metadata.get(LOGGED_WHEN_SET) and value == f.default:
            continue
        if isinstance(value, DecisionRule):  # logged flat, under its fields' own names, as before it was nested
            settings.update(decision_settings(value))
        else:
            settings[f.name] = _json_value(f.metadata.get(LOGGED_AS, _same)(value))
    return settings


def _same(value):
    return value


def _json_value(value):
    if isinstance(value, CompileOptions):
        return value.to_dict()
    if callable(value):
        name = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
        code = _code_digest(value)
        return f"{name} (code {code})" if code else name
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # inf and nan are not JSON
    return json.loads(json.dumps(value))


def _code_digest(function) -> str | None:
    """A short digest of what a Python function computes: its bytecode, constants and names, and the values its
    closure holds (numbers and strings; other objects by type); None for a callable without Python code (a
    builtin, a callable object, whose name alone is recorded)."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if code is None:
        return None
    held = [getattr(cell, "cell_contents", None) for cell in (getattr(function, "__closure__", None) or ())]
    held += list(getattr(function, "__defaults__", None) or ())
    values = [v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__qualname__ for v in held]
    text = repr((code.co_code, _constants(code), code.co_names, values))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _constants(code) -> tuple:
    """``code``'s constants, nested code objects (a lambda inside it) by their own constants and bytecode."""
    return tuple((c.co_code, _constants(c), c.co_names) if hasattr(c, "co_code")
                 else tuple(sorted(map(repr, c))) if isinstance(c, frozenset) else c  # a set's order varies by run
                 for c in code.co_consts)
