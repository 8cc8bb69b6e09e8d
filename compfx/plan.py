"""Stage 3 of the pipeline: a precision plan, one :class:`~compfx.vocabulary.Precision` per operator.

Three forms of one plan:

* :class:`Plan`: OpKey -> Precision, for one model (its fingerprint) and one
  low dtype. What ``apply``, the backend and plan files take.
* :class:`Assignment`: one Precision per op of ``analysis.ops``, by position.
  What the search works on: its stages cut the model into segments by position.
* the CoMP plan string, ``str(assignment)``: one character per op ('0' low,
  '1' FP32, 'f' follow, '8' FP8; see :attr:`Precision.code`). A view for logs and
  reports, and :meth:`Plan.from_bitstring`.

A plan with ``fp8`` ops also carries how they scale (``plan.fp8_recipe``, a
:class:`~compfx.vocabulary.Float8Recipe`); its file says so too.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Iterable, Iterator, Mapping

import torch

from .errors import PlanFileError, PlanMismatchError
from .files import read_json, write_json_atomic
from .opkey import OpKey
from .vocabulary import LOW_DTYPES, Category, Float8Recipe, Precision, check_low_dtype, dtype_from_name, dtype_name

__all__ = ["Plan", "Assignment", "AMP_PRECISION", "PLAN_VERSION", "MAX_PLAN_BYTES"]

_FORMAT = "compfx-plan"
#: The plan-file version this compfx writes; it reads no other (a newer file may mean something else).
PLAN_VERSION = 1
#: A plan file is about 40 bytes per op; anything larger than this is not a plan compfx wrote.
MAX_PLAN_BYTES = 32 << 20

#: What ``torch.autocast`` does with each category: its lists run low or FP32, the rest follow.
AMP_PRECISION = MappingProxyType({Category.WHITELIST: Precision.LOW, Category.BLACKLIST: Precision.FP32,
                                  Category.OTHER: Precision.FOLLOW})


class Assignment(tuple):
    """One :class:`Precision` per op, by position in ``analysis.ops``: the search's form of a plan.

    ``str()`` is the CoMP plan string.

    >>> a = Assignment.parse("0f1")
    >>> a[0] is Precision.LOW, str(a), str(a.replaced([1], Precision.LOW))
    (True, '0f1', '001')
    """

    __slots__ = ()

    def __new__(cls, precisions: Iterable = ()):
        return super().__new__(cls, tuple(map(Precision, precisions)))

    @classmethod
    def parse(cls, code: str) -> "Assignment":
        """The assignment a CoMP plan string spells; :class:`PlanMismatchError` on other characters."""
        if not isinstance(code, str):
            raise PlanMismatchError(f"a plan string must be a str like '0f1'; got {type(code).__name__}.")
        bad = sorted(set(code) - set(Precision.codes()))
        if bad:
            raise PlanMismatchError(f"plan string {code!r} contains {bad}; expected only '0' (low), '1' (fp32), "
                                    "'f' (follow) or '8' (fp8).")
        return cls(Precision.from_code(c) for c in code)

    def replaced(self, positions: Iterable[int], precision) -> "Assignment":
        """A copy with the ops at ``positions`` set to ``precision``."""
        chosen = list(self)
        for i in positions:
            chosen[i] = precision
        return Assignment(chosen)

    def __str__(self) -> str:
        return "".join(p.code for p in self)

    def __repr__(self) -> str:
        return f"Assignment({str(self)!r})"


class Plan(Mapping[OpKey, Precision]):
    """Immutable mapping OpKey -> :class:`Precision` for one model (its fingerprint) and one low dtype.

    ``fp8_recipe`` is how its ``fp8`` ops scale (default ``"tensorwise"``); it is
    None in a plan without ``fp8`` ops.

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> compfx.Plan.amp(a).bitstring(a)
    '0f0'
    >>> compfx.Plan.from_bitstring(a, "101").bitstring(a)
    '101'
    """

    __slots__ = ("_entries", "low_dtype", "fingerprint", "fp8_recipe")

    def __init__(self, entries: Mapping[OpKey, Precision | str], *, low_dtype: torch.dtype, fingerprint: str,
                 fp8_recipe: Float8Recipe | str | None = None):
        checked = {}
        for key, precision in entries.items():
            if not isinstance(key, OpKey):
                raise PlanMismatchError(f"plan key {key!r} is not an OpKey")
            try:
                checked[key] = Precision(precision)
            except ValueError:
                raise PlanMismatchError(f"precision {precision!r} for {key} is unknown; expected one of "
                                        f"{[p.value for p in Precision]}") from None
        check_low_dtype(low_dtype, error=PlanMismatchError)
        if not isinstance(fingerprint, str) or not fingerprint:
            raise PlanMismatchError(f"plan fingerprint {fingerprint!r} is not a non-empty str; expected the "
                                    "fingerprint of the model's analysis (analysis.fingerprint).")
        object.__setattr__(self, "_entries", MappingProxyType(checked))
        object.__setattr__(self, "low_dtype", low_dtype)
        object.__setattr__(self, "fingerprint", fingerprint)
        recipe = None
        if any(p is Precision.FP8 for p in checked.values()):  # a recipe only means something with FP8 ops
            recipe = Float8Recipe.parse(fp8_recipe or Float8Recipe.TENSORWISE, "fp8_recipe")
        object.__setattr__(self, "fp8_recipe", recipe)

    def __setattr__(self, name, value):
        raise AttributeError("Plan is immutable; use plan.with_precisions(...)")

    # Immutable, so a copy is the plan itself: modules holding one (a PlannedModule, the compile backend) are
    # deep-copied by users (EMA copies) and by libraries (Lightning deep-copies torch.compile's arguments).
    def __copy__(self) -> "Plan":
        return self

    def __deepcopy__(self, memo) -> "Plan":
        return self

    def __reduce__(self):  # pickling (spawned workers): the entries as a plain dict
        return (_rebuilt_plan, (dict(self._entries), self.low_dtype, self.fingerprint, self.fp8_recipe))

    # -- Mapping -------------------------------------------------------------
    def __getitem__(self, key: OpKey) -> Precision:
        return self._entries[key]

    def __iter__(self) -> Iterator[OpKey]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (dict(self._entries) == dict(other._entries) and self.low_dtype == other.low_dtype
                and self.fingerprint == other.fingerprint and self.fp8_recipe == other.fp8_recipe)

    def __hash__(self) -> int:
        return hash((frozenset(self._entries.items()), self.low_dtype, self.fingerprint, self.fp8_recipe))

    def __repr__(self) -> str:
        counts = ", ".join(f"{sum(v is p for v in self._entries.values())} {p}" for p in Precision)
        recipe = f", fp8_recipe={self.fp8_recipe}" if self.fp8_recipe else ""
        return f"Plan({len(self)} ops: {counts}; low_dtype={dtype_name(self.low_dtype)}{recipe})"

    # -- constructors --------------------------------------------------------
    @classmethod
    def uniform(cls, analysis, precision: Precision | str, *, fp8_recipe: Float8Recipe | str | None = None) -> "Plan":
        """Every op at one precision."""
        return cls({op.key: precision for op in analysis.ops}, low_dtype=analysis.low_dtype,
                   fingerprint=analysis.fingerprint, fp8_recipe=fp8_recipe)

    @classmethod
    def fp32(cls, analysis) -> "Plan":
        """Every op in FP32: numerically the original model."""
        return cls.uniform(analysis, Precision.FP32)

    @classmethod
    def amp(cls, analysis) -> "Plan":
        """What ``torch.autocast`` does: whitelist low, blacklist FP32, the rest follow; FP32 for the ops the
        model pins in its own ``autocast(enabled=False)`` blocks (``OpInfo.pinned``), where autocast casts nothing."""
        return cls({op.key: Precision.FP32 if getattr(op, "pinned", False) else AMP_PRECISION[op.category]
                    for op in analysis.ops}, low_dtype=analysis.low_dtype, fingerprint=analysis.fingerprint)

    @classmethod
    def from_assignment(cls, analysis, assignment: Iterable, *,
                        fp8_recipe: Float8Recipe | str | None = None) -> "Plan":
        """The plan that gives ``analysis.ops[i]`` the precision ``assignment[i]``."""
        assignment = Assignment(assignment)
        if len(assignment) != len(analysis.ops):
            raise PlanMismatchError(
                f"the plan has {len(assignment)} precisions, but the model has {len(analysis.ops)} ops; "
                "expected one per op of analysis.ops."
            )
        return cls({op.key: p for op, p in zip(analysis.ops, assignment)}, low_dtype=analysis.low_dtype,
                   fingerprint=analysis.fingerprint, fp8_recipe=fp8_recipe)

    @classmethod
    def from_bitstring(cls, analysis, bits: str, *, fp8_recipe: Float8Recipe | str | None = None) -> "Plan":
        """CoMP's string form: one character per ``analysis.ops`` entry ('0' low, '1' FP32, 'f' follow, '8' FP8)."""
        if isinstance(bits, str) and len(bits) != len(analysis.ops):
            raise PlanMismatchError(
                f"bitstring has length {len(bits)}, but the model has {len(analysis.ops)} ops; "
                "expected one character per op of analysis.ops."
            )
        return cls.from_assignment(analysis, Assignment.parse(bits), fp8_recipe=fp8_recipe)

    def with_precisions(self, updates: Mapping[OpKey, Precision | str]) -> "Plan":
        """A copy with some ops changed; every updated key must already be in the plan."""
        unknown = [str(k) for k in updates if k not in self._entries]
        if unknown:
            raise PlanMismatchError(f"with_precisions() got keys not in this plan: {unknown[:5]}")
        return Plan({**self._entries, **updates}, low_dtype=self.low_dtype, fingerprint=self.fingerprint,
                    fp8_recipe=self.fp8_recipe)

    # -- views ---------------------------------------------------------------
    def assignment(self, analysis) -> Assignment:
        """This plan by position in ``analysis.ops`` (validated against the analysis first)."""
        self.validate(analysis)
        return Assignment(self._entries[op.key] for op in analysis.ops)

    def bitstring(self, analysis) -> str:
        """CoMP's string form over ``analysis.ops``."""
        return str(self.assignment(analysis))

    def validate(self, analysis) -> None:
        """Raise :class:`PlanMismatchError` unless this plan covers exactly ``analysis.ops``.

        The fingerprint must be the analysis's too: a plan whose keys match
        but whose fingerprint does not was edited or built for another model.
        (:func:`compfx.apply` also checks the low dtype.)
        """
        expected = set(analysis.keys)
        missing = [str(k) for k in analysis.keys if k not in self._entries]
        unknown = [str(k) for k in self._entries if k not in expected]
        if missing or unknown:
            detail = []
            if unknown:
                detail.append(f"{len(unknown)} key(s) the model does not have (e.g. {unknown[:3]})")
            if missing:
                detail.append(f"no precision for {len(missing)} of the model's ops (e.g. {missing[:3]})")
            raise PlanMismatchError(
                "this plan does not match the model: " + "; ".join(detail) + ". It was probably made for "
                f"another model (plan fingerprint {self.fingerprint}, model {analysis.fingerprint}); "
                "run the search again or build the plan from this model's analysis."
            )
        if self.fingerprint != analysis.fingerprint:
            raise PlanMismatchError(
                f"this plan's fingerprint {self.fingerprint!r} is not the model's ({analysis.fingerprint!r}), although "
                "its op keys match: it was edited, or made for another model. Build the plan from this model's "
                "analysis (Plan.from_bitstring(analysis, ...)), or search again."
            )
        self._check_fp8(analysis)

    def _check_fp8(self, analysis) -> None:
        """Refuse ``fp8`` on an op the analysis did not mark FP8-eligible (:mod:`compfx.float8`)."""
        refused = [op for op in analysis.ops if self._entries[op.key] is Precision.FP8 and not op.fp8_eligible]
        if refused:
            detail = "; ".join(f"{op.key}: {op.fp8_reason}" for op in refused[:3])
            raise PlanMismatchError(
                f"this plan gives 'fp8' to {len(refused)} op(s) that cannot run FP8 ({detail}). Give them 'low' "
                "or 'fp32'" + ("" if analysis.fp8 else ", or analyse the model with analyze(..., fp8=True) so that "
                               "eligible ops are marked") + ".")

    # -- files ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": PLAN_VERSION,
            "low_dtype": dtype_name(self.low_dtype),
            "fingerprint": self.fingerprint,
            "torch_version": str(torch.__version__),  # a plain str: TorchVersion does not unpickle under weights_only
            "ops": {str(k): str(v) for k, v in self._entries.items()},
            **({"fp8_recipe": str(self.fp8_recipe)} if self.fp8_recipe else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "plan") -> "Plan":
        """The plan a :meth:`to_dict` mapping describes; anything else is a :class:`PlanFileError` naming ``source``.

        Checked before use: the format and ``version``, ``low_dtype`` among
        :data:`~compfx.vocabulary.LOW_DTYPES`' names, ``fingerprint`` a string,
        ``ops`` a mapping of op keys to precisions.
        """
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            raise PlanFileError(f"{source} is not a compfx plan (no '\"format\": \"{_FORMAT}\"' entry).")
        version = data.get("version")
        if type(version) is not int or version != PLAN_VERSION:
            raise PlanFileError(f"{source} has version {version!r}; this compfx reads plan version {PLAN_VERSION}. "
                                "Search again with this compfx (or use the compfx that wrote it).")
        low = data.get("low_dtype")
        names = [dtype_name(d) for d in LOW_DTYPES]
        if not isinstance(low, str) or low not in names:
            raise PlanFileError(f"{source} has low_dtype {low!r}; expected one of {names}. Fix the file or search "
                                "again.")
        fingerprint = data.get("fingerprint")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise PlanFileError(f"{source} has fingerprint {fingerprint!r}; expected the model's fingerprint, a "
                                "non-empty string (analysis.fingerprint). Fix the file or search again.")
        ops = data.get("ops")
        if not isinstance(ops, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ops.items()):
            raise PlanFileError(f"{source} has no 'ops' mapping of op keys to precisions (strings); it is damaged. "
                                "Search again.")
        try:
            entries = {OpKey.parse(k): v for k, v in ops.items()}
            recipe = data.get("fp8_recipe")
            if recipe is not None and recipe not in {r.value for r in Float8Recipe}:
                raise PlanFileError(f"{source} has fp8_recipe {recipe!r}; expected one of "
                                    f"{[r.value for r in Float8Recipe]}. Fix the file or search again.")
            return cls(entries, low_dtype=dtype_from_name(low), fingerprint=fingerprint, fp8_recipe=recipe)
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            if isinstance(error, PlanMismatchError):
                raise PlanFileError(f"{source} holds an invalid plan: {error}") from error
            raise PlanFileError(f"{source} is a damaged compfx plan ({type(error).__name__}: {error}).") from error

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically; :class:`~compfx.errors.FileWriteError` when it cannot be written."""
        write_json_atomic(path, self.to_dict(), "plan file")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a plan written by :meth:`save`.

        A missing, oversized (over :data:`MAX_PLAN_BYTES`, checked before
        reading), binary, corrupt or invalid file raises :class:`PlanFileError`.
        """
        data = read_json(path, "plan file", max_bytes=MAX_PLAN_BYTES)
        return cls.from_dict(data, source=f"plan file {os.fspath(path)}")


def _rebuilt_plan(entries, low_dtype, fingerprint, fp8_recipe) -> Plan:
    """A pickled :class:`Plan` again (see ``Plan.__reduce__``)."""
    return Plan(entries, low_dtype=low_dtype, fingerprint=fingerprint, fp8_recipe=fp8_recipe)
