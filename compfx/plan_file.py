"""The plan file's format, and the checks of what a file holds that need no :class:`~compfx.plan.Plan`.

:mod:`compfx.plan` reads and writes plans (``Plan.to_dict``, ``from_dict``, ``save``, ``load``); this module says
what a plan file is: its versions and keys, how it begins (:func:`is_plan_file`, which ``Plan.save`` reads before it
replaces a file), and the checks of its fields (op keys written one way, the cache's search records, the torch
release it was written under, a device type, the padded ops). Every check fails with a
:class:`~compfx.errors.PlanFileError` that names the file.
"""

from __future__ import annotations

import re
import warnings
from typing import Mapping

import torch

from .errors import PlanFileError
from .opkey import OpKey

__all__ = ["FORMAT", "FINGERPRINT_PATTERN", "MAX_PLAN_BYTES", "REQUIRED_KEYS", "OPTIONAL_KEYS_OF_VERSION",
           "PLAN_VERSION", "is_plan_file", "is_device_type", "check_op_keys", "check_search_record",
           "check_torch_version", "padded_from_file"]

FORMAT = "compfx-plan"
#: What a model's fingerprint is (:attr:`compfx.analyze.Analysis.fingerprint`): 16 lowercase hex digits of a sha256.
#: Anything else (``"../outside"``) names no model, and could name a path when the plan cache files it.
FINGERPRINT_PATTERN = re.compile(r"[0-9a-f]{16}")
#: A plan file is about 40 bytes per op; anything larger than this is not a plan compfx wrote.
MAX_PLAN_BYTES = 32 << 20
#: Top-level keys of a plan file: those every file has, and those each version may have (a cached plan says who
#: searched it, which other search's plan it replaced, and the parameter shapes of its model: see
#: :mod:`compfx.cache`; version 2 adds the plan's rules, version 3 the compile options it was searched under). Any
#: other key is refused. compfx writes the lowest version that holds what a file has, so a compfx that reads only
#: older versions still reads every file it can, and reads every version up to :data:`PLAN_VERSION` (a newer file
#: may mean something else).
REQUIRED_KEYS = ("format", "version", "low_dtype", "fingerprint", "ops")
OPTIONAL_KEYS_OF_VERSION = {
    1: ("torch_version", "device_type", "fp8_recipe", "padded", "searched", "replaced", "parameter_shapes"),
    2: ("torch_version", "device_type", "fp8_recipe", "padded", "searched", "replaced", "parameter_shapes", "rules"),
    3: ("torch_version", "device_type", "fp8_recipe", "padded", "searched", "replaced", "parameter_shapes", "rules",
        "compile"),
}
#: The newest plan-file version this compfx reads and writes.
PLAN_VERSION = max(OPTIONAL_KEYS_OF_VERSION)
#: What ``searched`` and ``replaced`` hold: when, on which host, by which process (and how many ops differ).
_SEARCH_FIELDS = {"at": str, "host": str, "pid": int, "differing_ops": int}


def is_plan_file(head: bytes) -> bool:
    """Whether the first bytes of a file are those of a compfx plan file (what :meth:`Plan.save` may replace): a
    JSON object whose first key is ``"format"``, naming compfx's plan format, as every plan file compfx writes
    begins. A search log, which quotes plans further in, or a checkpoint is not one.

    >>> is_plan_file(b'{ "format": "compfx-plan", "version": 1'), is_plan_file(b'{"stage": 1, "format": "compfx-plan"')
    (True, False)
    """
    return _PLAN_FILE_START.match(head) is not None


#: How every plan file compfx writes begins (``to_dict`` puts ``format`` first; a UTF-8 BOM is allowed).
_PLAN_FILE_START = re.compile(rb'(?:\xef\xbb\xbf)?\s*\{\s*"format"\s*:\s*"%s"' % FORMAT.encode())


def is_device_type(name) -> bool:
    """A torch device type without an index ('cpu', 'cuda', 'mps', ...)."""
    if not isinstance(name, str) or not name.isidentifier():
        return False
    try:
        return torch.device(name).type == name
    except (RuntimeError, ValueError):
        return False


def check_op_keys(ops: Mapping, source: str) -> None:
    """Every op key written the one way compfx writes it, so that no two spellings name one op."""
    bad = []
    for text in ops:
        try:
            canonical = str(OpKey.parse(text))
        except ValueError:
            canonical = None
        if canonical != text or not text.isascii():
            bad.append(text)
    if bad:
        raise PlanFileError(f"{source} has op key(s) {bad[:3]} not written as compfx writes them ('module:kind#index', "
                            "the index in ASCII digits without leading zeros, e.g. '0:linear#0'); two spellings "
                            "could name one op. Fix the key(s), or search again.")


def check_search_record(record, name: str, source: str) -> None:
    """``searched`` / ``replaced``: absent, or a mapping of the fields the plan cache writes, of their types."""
    if record is None:
        return
    wrong = not isinstance(record, Mapping) or any(
        key not in _SEARCH_FIELDS or type(value) is not _SEARCH_FIELDS[key] for key, value in record.items())
    if wrong:
        raise PlanFileError(f"{source} has {name} {record!r}; expected what the plan cache writes there (a mapping of "
                            f"{', '.join(f'{k}: {t.__name__}' for k, t in _SEARCH_FIELDS.items())}). Fix the file "
                            "or search again.")


_warned_versions: set[str] = set()


def check_torch_version(version, source: str) -> None:
    """A str; when it is another torch release than this one, warn once per file (the plan applies, its
    measurements were taken under that release)."""
    if version is None:
        return
    if not isinstance(version, str) or not version:
        raise PlanFileError(f"{source} has torch_version {version!r}; expected the torch version string it was "
                            "written under. Fix the file or search again.")
    if _release(version) != _release(str(torch.__version__)) and source not in _warned_versions:
        _warned_versions.add(source)
        warnings.warn(f"{source} was written under torch {version}; this is torch {torch.__version__}. Its "
                      "precisions apply as they are, but they were measured under that release: search again to "
                      "choose by measurements under this one.", UserWarning, stacklevel=4)


def _release(version: str) -> str:
    """'2.13.0+cu130' -> '2.13.0': builds of one release run the same kernels' code."""
    return version.split("+", 1)[0].strip()


def padded_from_file(value, source: str) -> frozenset:
    """The ``padded`` list of a plan file as OpKeys (a file without one pads nothing)."""
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise PlanFileError(f"{source} has padded {value!r}; expected a list of op keys. Fix the file or search "
                            "again.")
    check_op_keys(value, source)
    if len(set(value)) != len(value):
        raise PlanFileError(f"{source} names an op in 'padded' more than once; fix the file or search again.")
    return frozenset(OpKey.parse(k) for k in value)
