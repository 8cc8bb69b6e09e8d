"""Stage 3 of the pipeline: a precision plan, one precision per operator.

A :class:`Plan` maps every :class:`~compfx.opkey.OpKey` of an analysis to

* ``"low"``: run in the analysis' low dtype (fp16 or bf16),
* ``"fp32"``: run in FP32,
* ``"follow"``: no casts of its own; the op runs on whatever dtypes reach it
  (what autocast does for ops on neither list). Ops with one compute dtype
  (whitelist/blacklist) are given their widest input dtype.

CoMP writes a plan as a bitstring over ``analysis.ops``: ``'0'`` = low,
``'1'`` = FP32. compfx adds ``'f'`` for follow.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import Iterator, Mapping

import torch

from .errors import PlanFileError, PlanMismatchError
from .files import read_json, write_json_atomic
from .opkey import OpKey

__all__ = ["Plan", "PRECISIONS", "BIT_OF", "PRECISION_OF_BIT", "dtype_name"]

PRECISIONS = ("low", "fp32", "follow")
BIT_OF = {"low": "0", "fp32": "1", "follow": "f"}
PRECISION_OF_BIT = {bit: precision for precision, bit in BIT_OF.items()}
_FORMAT = "compfx-plan"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling plan files, caches and logs use."""
    return str(dtype).replace("torch.", "")


class Plan(Mapping[OpKey, str]):
    """Immutable mapping OpKey -> ``"low" | "fp32" | "follow"`` for one model.

    >>> import torch, compfx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> a = compfx.analyze(model, torch.randn(3, 4))
    >>> compfx.Plan.amp(a).bitstring(a)
    '0f0'
    >>> compfx.Plan.from_bitstring(a, "101").bitstring(a)
    '101'
    """

    __slots__ = ("_entries", "low_dtype", "fingerprint")

    def __init__(self, entries: Mapping[OpKey, str], *, low_dtype: torch.dtype, fingerprint: str):
        for key, precision in entries.items():
            if not isinstance(key, OpKey):
                raise PlanMismatchError(f"plan key {key!r} is not an OpKey")
            if precision not in PRECISIONS:
                raise PlanMismatchError(f"precision {precision!r} for {key} is unknown; expected one of {PRECISIONS}")
        if low_dtype not in _DTYPES.values():
            raise PlanMismatchError(f"low_dtype={low_dtype}; expected torch.float16 or torch.bfloat16")
        object.__setattr__(self, "_entries", MappingProxyType(dict(entries)))
        object.__setattr__(self, "low_dtype", low_dtype)
        object.__setattr__(self, "fingerprint", fingerprint)

    def __setattr__(self, name, value):
        raise AttributeError("Plan is immutable; use plan.with_precisions(...)")

    # -- Mapping -------------------------------------------------------------
    def __getitem__(self, key: OpKey) -> str:
        return self._entries[key]

    def __iter__(self) -> Iterator[OpKey]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (dict(self._entries) == dict(other._entries) and self.low_dtype == other.low_dtype
                and self.fingerprint == other.fingerprint)

    def __hash__(self) -> int:
        return hash((frozenset(self._entries.items()), self.low_dtype, self.fingerprint))

    def __repr__(self) -> str:
        counts = {p: sum(v == p for v in self._entries.values()) for p in PRECISIONS}
        return (f"Plan({len(self)} ops: {counts['low']} low, {counts['fp32']} fp32, {counts['follow']} follow; "
                f"low_dtype={dtype_name(self.low_dtype)})")

    # -- constructors --------------------------------------------------------
    @classmethod
    def uniform(cls, analysis, precision: str) -> "Plan":
        """Every op at one precision."""
        return cls({op.key: precision for op in analysis.ops}, low_dtype=analysis.low_dtype,
                   fingerprint=analysis.fingerprint)

    @classmethod
    def fp32(cls, analysis) -> "Plan":
        """Every op in FP32: numerically the original model."""
        return cls.uniform(analysis, "fp32")

    @classmethod
    def amp(cls, analysis) -> "Plan":
        """What ``torch.autocast`` does: whitelist low, blacklist FP32, the rest follow."""
        precision = {"whitelist": "low", "blacklist": "fp32", "other": "follow"}
        return cls({op.key: precision[op.category] for op in analysis.ops}, low_dtype=analysis.low_dtype,
                   fingerprint=analysis.fingerprint)

    @classmethod
    def from_bitstring(cls, analysis, bits: str) -> "Plan":
        """CoMP's string form: one character per ``analysis.ops`` entry ('0' low, '1' FP32, 'f' follow)."""
        if not isinstance(bits, str) or len(bits) != len(analysis.ops):
            length = len(bits) if isinstance(bits, str) else type(bits).__name__
            raise PlanMismatchError(
                f"bitstring has length {length}, but the model has {len(analysis.ops)} ops; "
                "expected one character per op of analysis.ops."
            )
        bad = sorted(set(bits) - set(PRECISION_OF_BIT))
        if bad:
            raise PlanMismatchError(f"bitstring contains {bad}; expected only '0' (low), '1' (fp32) or 'f' (follow).")
        return cls({op.key: PRECISION_OF_BIT[b] for op, b in zip(analysis.ops, bits)},
                   low_dtype=analysis.low_dtype, fingerprint=analysis.fingerprint)

    def with_precisions(self, updates: Mapping[OpKey, str]) -> "Plan":
        """A copy with some ops changed; every updated key must already be in the plan."""
        unknown = [str(k) for k in updates if k not in self._entries]
        if unknown:
            raise PlanMismatchError(f"with_precisions() got keys not in this plan: {unknown[:5]}")
        return Plan({**self._entries, **updates}, low_dtype=self.low_dtype, fingerprint=self.fingerprint)

    # -- views ---------------------------------------------------------------
    def bitstring(self, analysis) -> str:
        self.validate(analysis)
        return "".join(BIT_OF[self._entries[op.key]] for op in analysis.ops)

    def validate(self, analysis) -> None:
        """Raise :class:`PlanMismatchError` unless this plan covers exactly ``analysis.ops``."""
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

    # -- files ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": 1,
            "low_dtype": dtype_name(self.low_dtype),
            "fingerprint": self.fingerprint,
            "torch_version": torch.__version__,
            "ops": {str(k): v for k, v in self._entries.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "plan") -> "Plan":
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            raise PlanFileError(f"{source} is not a compfx plan (no '\"format\": \"{_FORMAT}\"' entry).")
        try:
            low_dtype = _DTYPES[data["low_dtype"]]
            entries = {OpKey.parse(k): v for k, v in data["ops"].items()}
            return cls(entries, low_dtype=low_dtype, fingerprint=str(data["fingerprint"]))
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            if isinstance(error, PlanMismatchError):
                raise PlanFileError(f"{source} holds an invalid plan: {error}") from error
            raise PlanFileError(f"{source} is a damaged compfx plan ({type(error).__name__}: {error}).") from error

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a plan written by :meth:`save`; a corrupt file raises :class:`PlanFileError`."""
        return cls.from_dict(read_json(path, "plan file"), source=f"plan file {os.fspath(path)}")
