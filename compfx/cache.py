"""compfx's cache folder: plans the search saved, and op profiles the cost model measured.

Plans, found again by op-key fingerprint: the compile backend calls
:func:`find_plan` (and, for graphs that dynamo split at a graph break,
:func:`find_plan_covering`) when it is given no plan. One file per
``(fingerprint, low dtype)``: ``<fingerprint>-<dtype>.json``.

Profiles (:mod:`compfx.costmodel`), under ``profiles/``: one small JSON file
per key (op signature, dtype, device, torch version, ...), named by a hash of
the key and holding the key itself, so a file written for another key is never
read as this one's (:func:`read_entry`, :func:`write_entry`).

Every file is written atomically. Where the folder is, first match wins:

1. the ``cache_dir`` argument,
2. the ``COMPFX_CACHE_DIR`` environment variable,
3. ``$XDG_CACHE_HOME/compfx/plans``, else ``~/.cache/compfx/plans``
   (``%LOCALAPPDATA%\\compfx\\plans`` on Windows).

The cache is a convenience, never the source of truth: a damaged file is
logged and skipped (a damaged profile is measured again), not raised.

>>> import tempfile, torch, compfx
>>> from compfx import cache
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
>>> a = compfx.analyze(model, torch.randn(2, 4))
>>> folder = tempfile.mkdtemp()
>>> _ = cache.save_plan(compfx.Plan.amp(a), cache_dir=folder)
>>> cache.find_plan(a.fingerprint, low_dtype=a.low_dtype, cache_dir=folder) == compfx.Plan.amp(a)
True
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from .errors import PlanFileError
from .files import read_json, write_json_atomic
from .opkey import OpKey
from .plan import Plan
from .vocabulary import dtype_name

__all__ = ["CACHE_DIR_ENV", "default_cache_dir", "cache_folder", "plan_path", "save_plan", "find_plan",
           "find_plan_covering", "profile_folder", "entry_path", "read_entry", "write_entry"]

#: Environment variable that moves the plan cache.
CACHE_DIR_ENV = "COMPFX_CACHE_DIR"

log = logging.getLogger("compfx")


def default_cache_dir() -> Path:
    """``$COMPFX_CACHE_DIR``, else the user's cache directory + ``compfx/plans``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "compfx" / "plans"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "compfx" / "plans"


def cache_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` (``~`` expanded), or the default cache folder when it is None."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def plan_path(fingerprint: str, low_dtype: torch.dtype, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the plan for ``(fingerprint, low_dtype)`` lives in the cache."""
    return cache_folder(cache_dir) / f"{fingerprint}-{dtype_name(low_dtype)}.json"


def save_plan(plan: Plan, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Store ``plan`` under its fingerprint and low dtype (replacing an older one); returns the file."""
    path = plan_path(plan.fingerprint, plan.low_dtype, cache_dir=cache_dir)
    plan.save(path)
    log.info("compfx: saved plan %s to %s", plan.fingerprint, path)
    return path


def _load_or_skip(path: Path) -> Plan | None:
    try:
        return Plan.load(path)
    except PlanFileError as error:
        log.warning("compfx: ignoring damaged cached plan %s (%s); delete it to silence this.", path, error)
        return None


def find_plan(fingerprint: str, *, low_dtype: torch.dtype | None = None,
              cache_dir: str | os.PathLike | None = None) -> Plan | None:
    """The cached plan for ``fingerprint`` (any low dtype when ``low_dtype`` is None, newest first), or None."""
    folder = cache_folder(cache_dir)
    if low_dtype is not None:
        path = plan_path(fingerprint, low_dtype, cache_dir=folder)
        return _load_or_skip(path) if path.is_file() else None
    for path in _newest_first(folder.glob(f"{fingerprint}-*.json")):
        plan = _load_or_skip(path)
        if plan is not None:
            return plan
    return None


def find_plan_covering(keys: Iterable[OpKey], *, low_dtype: torch.dtype | None = None,
                       cache_dir: str | os.PathLike | None = None) -> Plan | None:
    """The newest cached plan that has an entry for every key in ``keys``, or None.

    For graphs that dynamo split at a graph break: such a graph holds part of
    the model, so its own fingerprint matches no saved plan, but the plan of
    the whole model covers its keys.
    """
    wanted = set(keys)
    if not wanted:
        return None
    for path in _newest_first(cache_folder(cache_dir).glob("*.json")):
        plan = _load_or_skip(path)
        if plan is not None and (low_dtype is None or plan.low_dtype == low_dtype) and wanted <= set(plan):
            return plan
    return None


def _newest_first(paths: Iterable[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True)


# -- profiles --------------------------------------------------------------------

def profile_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder for profile entries: ``profiles/`` inside the cache folder (``cache_dir`` or its default).

    >>> profile_folder("/tmp/c").as_posix()
    '/tmp/c/profiles'
    """
    return cache_folder(cache_dir) / "profiles"


def entry_path(folder: Path, key: Mapping[str, Any]) -> Path:
    """The file of the entry for ``key`` (a JSON-able mapping) in ``folder``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Path(folder) / f"{digest}.json"


def read_entry(path: Path, key: Mapping[str, Any], fmt: str) -> Mapping | None:
    """The entry at ``path`` when it holds ``key`` in format ``fmt``; None when missing, damaged or another key's."""
    if not path.exists():
        return None
    try:
        data = read_json(path, "cache entry")
    except PlanFileError:
        return None  # a damaged entry is measured again and overwritten
    if not isinstance(data, Mapping) or data.get("format") != fmt or data.get("key") != json.loads(json.dumps(key)):
        return None
    return data


def write_entry(path: Path, key: Mapping[str, Any], fmt: str, version: int, result: Mapping[str, Any]) -> None:
    """Write the entry for ``key`` (atomically): its format, version, the key itself and ``result``."""
    write_json_atomic(path, {"format": fmt, "version": version, "key": key, **result})
