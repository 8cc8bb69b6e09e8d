"""The words every stage shares, defined once: precisions, op categories, search stages, sample statuses, dtypes.

They are string-valued enums, so plan files, logs and tables stay readable
(``Precision.LOW == "low"``, ``json.dumps(Precision.LOW) == '"low"'``) and a
misspelt value fails where it is parsed, not three stages later.

>>> Precision("low") is Precision.LOW, Precision.LOW == "low", f"{Precision.FP32}"
(True, True, 'fp32')
>>> [p.code for p in Precision], Precision.from_code("f")
(['0', '1', 'f', '8'], <Precision.FOLLOW: 'follow'>)
>>> dtype_name(torch.bfloat16), short_dtype_name(torch.bfloat16), dtype_from_name("float16")
('bfloat16', 'bf16', torch.float16)
"""

from __future__ import annotations

from enum import Enum

import torch

from .errors import BadInputError

__all__ = [
    "Precision", "Float8Recipe", "Category", "Stage", "SampleStatus",
    "LOW_DTYPES", "dtype_name", "short_dtype_name", "dtype_from_name", "check_low_dtype", "default_low_dtype",
]


class _StrEnum(str, Enum):
    """A str whose value is the text: prints, formats and serialises as that text."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls, value, what: str):
        """``cls(value)``, or a :class:`BadInputError` that lists the valid values."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in cls)
            raise BadInputError(f"{what}={value!r}; expected one of {valid}.") from None


class Precision(_StrEnum):
    """What a plan asks of one op.

    * ``LOW``: run in the plan's low dtype (fp16 or bf16);
    * ``FP32``: run in FP32;
    * ``FOLLOW``: no casts of its own; the op runs on whatever dtypes reach it
      (what autocast does for ops on neither of its lists);
    * ``FP8``: a matmul run through torchao's float8 training path (FP32 in
      and out, operands scaled to float8 inside; see :mod:`compfx.float8`),
      valid only for ops the analysis marks ``fp8_eligible``.

    ``code`` is the op's character in CoMP's plan string ('0' low, '1' FP32; compfx adds 'f' and '8').
    """

    LOW = "low"
    FP32 = "fp32"
    FOLLOW = "follow"
    FP8 = "fp8"

    @property
    def code(self) -> str:
        return _CODES[self]

    @classmethod
    def from_code(cls, code: str) -> "Precision":
        return _PRECISION_OF_CODE[code]

    @classmethod
    def codes(cls) -> str:
        return "".join(_CODES.values())


_CODES = {Precision.LOW: "0", Precision.FP32: "1", Precision.FOLLOW: "f", Precision.FP8: "8"}
_PRECISION_OF_CODE = {code: precision for precision, code in _CODES.items()}


class Float8Recipe(_StrEnum):
    """How an FP8 op scales its operands: torchao's ``Float8LinearRecipeName`` values, which plan files carry.

    * ``TENSORWISE``: one dynamic scale per tensor (the fastest kernel; one outlier
      sets the scale for every value);
    * ``ROWWISE``: one scale per row, rounded down to a power of two;
    * ``ROWWISE_WITH_GW_HP``: rowwise, with the weight gradient kept in high precision.
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"


class Category(_StrEnum):
    """Where autocast puts an op kind: its lower-precision list, its FP32 list, or neither."""

    WHITELIST = "whitelist"
    BLACKLIST = "blacklist"
    OTHER = "other"


class Stage(_StrEnum):
    """Which part of :func:`compfx.optimize` wrote a search-log record."""

    STAGE1 = "stage1"  # CoMP Stage 1: one epoch per plan
    STAGE2 = "stage2"  # CoMP Stage 2 (Algorithm 2): timed steps per plan
    CHECK = "check"  # compfx's loss check of the Stage-2 winner
    COMPARE = "compare"  # step times of FP32, AMP and the chosen plan, for the report
    SEARCH = "search"  # notes about the run itself (resumed, interrupted, cost model off)
    DISTRIBUTED = "distributed"  # notes about rank agreement and per-device plans
    GUARD = "guard"  # compfx.Guard: a plan repaired during training, after the search


class SampleStatus(_StrEnum):
    """The outcome of one search sample (``NOTE``: a line that is not a sample, only a reason)."""

    ACCEPTED = "accepted"  # a valid plan (it may still lose to a cheaper one)
    REJECTED = "rejected"  # ran to the end but failed the loss guard
    PRUNED = "pruned"  # stopped early: it could no longer win or be accepted
    ERROR = "error"  # the model failed under the plan
    SKIPPED = "skipped"  # not run: the cost model predicted it could not win
    NOTE = "note"


# -- dtypes --------------------------------------------------------------------

#: The dtypes a plan's "low" can mean.
LOW_DTYPES = (torch.float16, torch.bfloat16)

_SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_DTYPES_BY_NAME = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                   "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling plan files, caches, logs and reports use."""
    return str(dtype).replace("torch.", "")


def short_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``: used in the names of inserted cast nodes."""
    return _SHORT_NAMES.get(dtype, dtype_name(dtype))


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype :func:`dtype_name` spells ``name`` (floating dtypes only); KeyError for any other name."""
    return _DTYPES_BY_NAME[name]


def check_low_dtype(dtype, what: str = "low_dtype", error: type[Exception] = BadInputError) -> torch.dtype:
    """``dtype`` when it is one of :data:`LOW_DTYPES`; otherwise ``error`` naming ``what`` and the valid choices."""
    if dtype not in LOW_DTYPES:
        raise error(f"{what}={dtype}; compfx expected torch.float16 or torch.bfloat16.")
    return dtype


def default_low_dtype(device: torch.device) -> torch.dtype:
    """fp16 on CUDA (the paper's setting), bf16 elsewhere (what CPU autocast uses)."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16
