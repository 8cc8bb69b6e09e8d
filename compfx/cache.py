"""compfx's cache folder: plans the search saved, and op profiles the cost model measured.

Plans, found again by op-key fingerprint: :func:`compfx.optimize` saves the
plan it chose (:func:`save_plan`, unless ``SearchConfig(cache_plan=False)``),
and the compile backend calls :func:`find_cached` when it is given no plan
(never :func:`find_plan_covering`, a lookup by op names that is only an
explicit opt-in).
One file per ``(fingerprint, low dtype)``: ``<fingerprint>-<dtype>.json``. In
the process that searched it, a plan is also remembered with the model it was
searched for (:func:`remember_plan`, :func:`searched_plan_of`): the backend
runs it for that model's graphs, a graph split off at a graph break included.

Profiles (:mod:`compfx.costmodel`), under ``profiles/``: one small JSON file
per key (op signature, dtype, device, torch version, ...), named by a hash of
the key and holding the key itself, so a file written for another key is never
read as this one's (:func:`read_entry`, :func:`write_entry`).

Where the folder is, first match wins:

1. the ``cache_dir`` argument,
2. the ``COMPFX_CACHE_DIR`` environment variable,
3. ``$XDG_CACHE_HOME/compfx/plans``, else ``~/.cache/compfx/plans``
   (``%LOCALAPPDATA%\\compfx\\plans`` on Windows).

What the cache guarantees:

* **Keys are checked, paths stay inside.** A fingerprint is a hash, 16 hex
  digits (:data:`FINGERPRINT_PATTERN`), and a low dtype one of
  :data:`~compfx.vocabulary.LOW_DTYPES`; anything else
  (``"../outside/pwned"``, an absolute path) is a
  :class:`~compfx.errors.CacheKeyError` before a file is touched, and every
  path is resolved and must lie inside the cache folder (a symlink pointing
  out is refused too), and nothing is read or written through a link inside
  it (a linked ``profiles/`` is warned about and not used).
* **Atomic files, bounded reads.** Every file is written atomically and read
  only up to :data:`MAX_ENTRY_BYTES` / :data:`~compfx.plan.MAX_PLAN_BYTES`.
* **The cache is a convenience, never the source of truth.** A damaged file
  (binary, not JSON, too large, nested too deep, another key's, a plan whose
  content contradicts its file name) is skipped with one warning per file and
  version of it, and rewritten when measured (or searched) again. A file
  deleted by another process between listing and reading is skipped silently.
* **Who searched it.** A cached plan records when, on which host and by which
  process it was searched (``searched``), the device type and the torch
  release; the compile backend says so whenever it runs it (:meth:`CachedPlan.describe`).
* **Two searches of one model never overwrite each other silently.** Saves
  to one folder take turns (a lock on ``<folder>/.lock``, where the OS has
  ``flock``). The newest search's plan is kept; one that replaces a
  *different* plan searched by another process warns, naming that search, and
  the file records it (``replaced``), so that the backend warns whenever it
  runs that file: it cannot tell which data each search used. A process runs
  the plan it searched itself for the model object it searched, whatever the
  file holds by then. Give concurrent searches of one architecture on different
  data their own ``SearchConfig(cache_dir=...)`` to keep both.
* **A path that cannot be a folder is refused at once.** ``cache_dir`` and
  ``$COMPFX_CACHE_DIR`` are expanded (``~``) and checked when the folder is
  asked for (:func:`cache_folder`): a NUL character, or a ``~user`` that does not
  exist, is a :class:`~compfx.errors.CacheKeyError`, never a ``RuntimeError``.
* **Leftovers are cleaned.** Temp files of writers killed mid-write
  (``.<name>.<random>.tmp`` beside a cache file's name) older than
  :data:`TEMP_MAX_AGE_S` are removed the first time a process writes to the folder.

>>> import tempfile, torch, compfx
>>> from compfx import cache
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
>>> a = compfx.analyze(model, torch.randn(2, 4))
>>> folder = tempfile.mkdtemp()
>>> _ = cache.save_plan(compfx.Plan.amp(a), cache_dir=folder)
>>> cache.find_plan(a.fingerprint, low_dtype=a.low_dtype, cache_dir=folder) == compfx.Plan.amp(a)
True
>>> cache.plan_path("../outside/pwned", torch.bfloat16, cache_dir=folder)
Traceback (most recent call last):
...
compfx.errors.CacheKeyError: plan fingerprint '../outside/pwned' is not a fingerprint compfx makes ...
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn

from .errors import CacheKeyError, FileWriteError, PlanFileError
from .files import TEMP_SUFFIX, read_json, write_json_atomic
from .opkey import OpKey
from .plan import FINGERPRINT_PATTERN, MAX_PLAN_BYTES, Plan
from .vocabulary import LOW_DTYPES, dtype_name

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: saves are atomic, but not serialised
    fcntl = None

__all__ = ["CACHE_DIR_ENV", "FINGERPRINT_PATTERN", "MAX_ENTRY_BYTES", "TEMP_MAX_AGE_S", "default_cache_dir",
           "cache_folder", "unwritable", "check_fingerprint", "plan_path", "save_plan", "find_plan", "find_cached",
           "find_plan_covering",
           "CachedPlan", "remember_plan", "searched_plan_of", "SearchedPlan", "profile_folder", "entry_path",
           "read_entry", "write_entry", "discard_entry", "remove_abandoned_temp_files"]

#: Environment variable that moves the plan cache.
CACHE_DIR_ENV = "COMPFX_CACHE_DIR"
#: A profile or cast-cost entry is a few hundred bytes; a larger file is not one compfx wrote.
MAX_ENTRY_BYTES = 1 << 20
#: A temp file this old is a leftover of a killed writer (a live one renames its file within seconds).
TEMP_MAX_AGE_S = 3600.0

_PLAN_NAME = re.compile(r"(?P<fingerprint>[0-9a-f]{16})-(?P<dtype>%s)\.json" % "|".join(dtype_name(d) for d in LOW_DTYPES))
_ENTRY_NAME = re.compile(r"[0-9a-f]{32}\.json")
# write_json_atomic's temp files for the two names above: ".<name>.<8 random chars>.tmp"
_TEMP_NAME = re.compile(r"\.(?:%s|%s)\.[a-z0-9_]{8}%s" % (_PLAN_NAME.pattern, _ENTRY_NAME.pattern,
                                                          re.escape(TEMP_SUFFIX)))

log = logging.getLogger("compfx")


def _expanded(text, source: str) -> Path:
    """``text`` as a folder path, ``~`` expanded; :class:`CacheKeyError` when it cannot be one."""
    if not isinstance(text, str) or not text:
        raise CacheKeyError(f"{source}={text!r}; expected a folder path (str or os.PathLike) or None for the default "
                            f"(${CACHE_DIR_ENV}, else ~/.cache/compfx/plans).")
    if "\0" in text:
        raise CacheKeyError(f"{source}={text!r} holds a NUL character, which no folder name can; give the folder's "
                            "path without it.")
    try:
        return Path(text).expanduser()
    except RuntimeError as error:  # "~nouser/c", or "~" without a home directory
        raise CacheKeyError(f"{source}={text!r} starts with a '~' that cannot be expanded ({error}: no such user, or "
                            "no home directory); give the folder's full path.") from error


def default_cache_dir() -> Path:
    """``$COMPFX_CACHE_DIR``, else the user's cache directory + ``compfx/plans``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return _expanded(configured, f"${CACHE_DIR_ENV}")
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "compfx" / "plans"
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError as error:
            raise CacheKeyError(f"this process has no home directory for the default plan cache ({error}); set "
                                f"${CACHE_DIR_ENV} or pass cache_dir=.") from error
    return Path(base) / "compfx" / "plans"


def cache_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` (``~`` expanded), or the default cache folder when it is None; a path that cannot be a
    folder (not a path, a NUL character, an unknown ``~user``) is a :class:`CacheKeyError`."""
    if cache_dir is None:
        return default_cache_dir()
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise CacheKeyError(f"cache_dir={cache_dir!r}; expected a folder path (str or os.PathLike) or None for "
                            f"the default (${CACHE_DIR_ENV}, else ~/.cache/compfx/plans).")
    return _expanded(os.fspath(cache_dir), "cache_dir")


def unwritable(folder: Path) -> str | None:
    """Why this process cannot write files into ``folder`` (it, or its nearest existing parent); None when it
    can. Nothing is created.

    >>> import tempfile, pathlib
    >>> unwritable(pathlib.Path(tempfile.mkdtemp()) / "new" / "cache") is None
    True
    """
    existing = Path(folder)
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"this process may not write in {existing}"
    return None


def check_fingerprint(fingerprint) -> str:
    """``fingerprint`` when it is one compfx makes (:data:`FINGERPRINT_PATTERN`); else :class:`CacheKeyError`.

    >>> check_fingerprint("0123456789abcdef")
    '0123456789abcdef'
    """
    if not isinstance(fingerprint, str) or not FINGERPRINT_PATTERN.fullmatch(fingerprint):
        raise CacheKeyError(
            f"plan fingerprint {fingerprint!r} is not a fingerprint compfx makes (16 hex digits, "
            "analysis.fingerprint), so it cannot name a file in the plan cache. Use a plan built from the "
            "model's analysis, or fix the plan file's 'fingerprint'.")
    return fingerprint


def _inside(folder: Path, path: Path) -> Path:
    """``path`` when it resolves (symlinks followed) inside ``folder``; else :class:`CacheKeyError`."""
    root, resolved = folder.resolve(), path.resolve()
    if resolved != root and root not in resolved.parents:
        raise CacheKeyError(f"cache file {path} resolves to {resolved}, outside the cache folder {root}; compfx "
                            "only reads and writes inside it. Remove the link, or pick another cache_dir.")
    return path


def _linked(folder: Path) -> bool:
    """Is ``folder`` a symbolic link (said once)? The cache folder itself may be one (a cache on another disk); a
    folder inside it may not: ``profiles/`` linked elsewhere would have compfx write, and clean up temp files,
    in a folder of the link's choosing. The cache is then not used there: entries are measured, not kept."""
    if not os.path.islink(folder):
        return False
    if str(folder) not in _warned_links:
        _warned_links.add(str(folder))
        log.warning("compfx: the cache folder %s is a symbolic link (to %s); compfx neither reads nor writes through "
                    "a link inside its cache, so measurements are not kept there. Remove the link (compfx makes the "
                    "folder), or pick another cache_dir.", folder, os.path.realpath(folder))
    return True


_warned_links: set[str] = set()


def plan_path(fingerprint: str, low_dtype: torch.dtype, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the plan for ``(fingerprint, low_dtype)`` lives in the cache (both checked: see the module doc)."""
    check_fingerprint(fingerprint)
    if low_dtype not in LOW_DTYPES:
        raise CacheKeyError(f"low_dtype={low_dtype!r}; the plan cache holds plans for "
                            f"{[dtype_name(d) for d in LOW_DTYPES]} only.")
    folder = cache_folder(cache_dir)
    return _inside(folder, folder / f"{fingerprint}-{dtype_name(low_dtype)}.json")


def save_plan(plan: Plan, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Store ``plan`` under its fingerprint and low dtype (replacing an older one); returns the file.

    The file records this search (``searched``: when, host, process) and, where
    the plan records them (:meth:`Plan.with_parameter_shapes`), the shapes of the parameters
    the model's forward reads (:func:`compfx.analysis.parameter_shapes`): the compile backend runs the plan
    only for a graph that reads parameters of those shapes, not for another
    model whose ops are named alike (the same layers at other widths). Saves
    to one folder take turns; replacing a *different* plan that another process
    searched warns and is recorded in the file (``replaced``; see the module
    docstring). A fingerprint that is not a hash is refused
    (:class:`CacheKeyError`); a folder that cannot be written is a
    :class:`~compfx.errors.FileWriteError`.
    """
    if not isinstance(plan, Plan):
        raise CacheKeyError(f"save_plan() takes a compfx.Plan; got {type(plan).__name__}.")
    path = plan_path(plan.fingerprint, plan.low_dtype, cache_dir=cache_dir)
    remove_abandoned_temp_files(path.parent)
    searched = _this_search()
    with _folder_lock(path.parent):
        data = {**plan.to_dict(), "searched": searched}
        previous = _load_or_skip(path) if path.is_file() else None
        if previous is not None:
            differing = _differing_ops(previous.plan, plan)
            if not differing:
                data.update({"replaced": previous.replaced} if previous.replaced else {})
            elif (previous.searched.get("host"), previous.searched.get("pid")) != (searched["host"], searched["pid"]):
                data["replaced"] = {**previous.searched, "differing_ops": differing}
                log.warning("compfx: the plan cache file %s held a different plan for this model (%d op(s) differ), %s; "
                            "it is replaced by this search's plan. torch.compile(backend=\"compfx\") runs the newest "
                            "and warns that it replaced another; to keep both, give each search its own "
                            "SearchConfig(cache_dir=...), or pass the plan: compfx.compile_with_plan(model, plan).",
                            path, differing, previous.describe(with_file=False))
        write_json_atomic(path, data, "cached plan")
    log.info("compfx: saved plan %s to %s", plan.fingerprint, path)
    return path


def _this_search() -> dict:
    return {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "pid": os.getpid()}


def _differing_ops(old: Plan, new: Plan) -> int:
    keys = set(old) | set(new)
    return sum(old.get(k) != new.get(k) for k in keys) + int(old.fp8_recipe != new.fp8_recipe and not keys)


#: The file in a cache folder whose lock serialises saves (see the module docstring).
LOCK_NAME = ".lock"
#: How long a save waits for another process's save before it goes on without the lock (and says so).
LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive lock on ``folder/.lock`` while the body runs (none where the OS has no ``flock``)."""
    if fcntl is None:
        yield
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(_inside(folder, folder / LOCK_NAME),
                     os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as error:
        raise FileWriteError(f"could not write the plan cache {folder}: {error.strerror or error}; expected a folder "
                             "this process can write. Pass another cache_dir, or fix its permissions.") from error
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    log.warning("compfx: another process has held the plan cache lock %s for %.0f s; saving without "
                                "it.", folder / LOCK_NAME, LOCK_WAIT_S)
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock


# -- reading, whatever another process or a damaged file does ------------------------------

_warned: set[tuple[str, int, int]] = set()  # (path, mtime_ns, size): one warning per version of a damaged file


def _warn_once(path: Path, what: str, reason: str) -> None:
    try:
        stat = path.stat()
        version = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        version = (str(path), 0, 0)
    if version not in _warned:
        _warned.add(version)
        log.warning("compfx: ignoring damaged %s %s (%s); it is rewritten when measured or searched again, or "
                    "delete it.", what, path, reason)


@dataclass(frozen=True)
class CachedPlan:
    """A plan read from the cache, with its file and what the file says about the search that made it."""

    plan: Plan
    path: Path
    searched: Mapping = field(default_factory=dict)  # at, host, pid ({} in files of older compfx versions)
    torch_version: str | None = None
    replaced: Mapping | None = None  # the other process's search this one replaced, when their plans differ
    parameter_shapes: list | None = None  # of the model it was searched for (None in older files)

    def describe(self, *, with_file: bool = True) -> str:
        """Where it came from, in words: file, when, host and process, device type, torch release.

        >>> import torch
        >>> plan = Plan({}, low_dtype=torch.bfloat16, fingerprint="0123456789abcdef", device_type="cpu")
        >>> CachedPlan(plan, Path("p.json"), {"at": "2025-01-02T03:04:05+00:00", "host": "h", "pid": 7}, "2.13.0").describe()
        'p.json, searched 2025-01-02T03:04:05+00:00 by process 7 on h, on cpu, under torch 2.13.0'
        """
        parts = [str(self.path)] if with_file else []
        searched = self.searched
        parts.append(f"searched {searched.get('at', 'at an unrecorded time')}"
                     + (f" by process {searched['pid']} on {searched.get('host', '?')}" if "pid" in searched else ""))
        parts.append(f"on {self.plan.device_type or 'an unrecorded device'}")
        parts.append(f"under torch {self.torch_version or 'unrecorded'}")
        if self.plan.compile_options is not None:  # the program it was measured as, which it compiles as
            parts.append(f"measured compiled ({self.plan.compile_options.describe()})")
        return ", ".join(parts)


def _load_or_skip(path: Path) -> CachedPlan | None:
    """The plan in ``path``; None (one warning) when it is damaged or contradicts its name; None when it vanished.

    Callers pick files by name (:func:`_plan_files`, :func:`plan_path`), so a
    plan whose content matches its name is the one they asked for.
    """
    try:
        data = read_json(path, "cached plan", max_bytes=MAX_PLAN_BYTES)
        plan = Plan.from_dict(data, source=f"cached plan {path}")
    except PlanFileError as error:
        if isinstance(error.__cause__, FileNotFoundError):
            return None  # deleted by another process since it was listed: not damage
        _warn_once(path, "cached plan", str(error))
        return None
    held = f"{plan.fingerprint}-{dtype_name(plan.low_dtype)}.json"
    if held != path.name:
        _warn_once(path, "cached plan", f"it holds the plan of {held}, not of its own name")
        return None
    return CachedPlan(plan, path, dict(data.get("searched") or {}), data.get("torch_version"), data.get("replaced"),
                      data.get("parameter_shapes"))


def find_plan(fingerprint: str, *, low_dtype: torch.dtype | None = None,
              cache_dir: str | os.PathLike | None = None) -> Plan | None:
    """The cached plan for ``fingerprint`` (any low dtype when ``low_dtype`` is None, newest first), or None."""
    found = find_cached(fingerprint, low_dtype=low_dtype, cache_dir=cache_dir)
    return found.plan if found is not None else None


def find_cached(fingerprint: str, *, low_dtype: torch.dtype | None = None,
                cache_dir: str | os.PathLike | None = None) -> CachedPlan | None:
    """:func:`find_plan` with the plan's file and what it says about its search (a :class:`CachedPlan`)."""
    check_fingerprint(fingerprint)
    folder = cache_folder(cache_dir)
    if low_dtype is not None:
        try:
            path = plan_path(fingerprint, low_dtype, cache_dir=folder)
        except CacheKeyError as error:
            if low_dtype not in LOW_DTYPES:
                raise  # the caller's argument is wrong
            _warn_once(folder / f"{fingerprint}-{dtype_name(low_dtype)}.json", "cached plan", str(error))
            return None  # a link out of the folder: never followed
        return _load_or_skip(path)
    for path in _newest_first(_plan_files(folder, fingerprint)):
        plan = _load_or_skip(path)
        if plan is not None:
            return plan
    return None


def find_plan_covering(keys: Iterable[OpKey], *, low_dtype: torch.dtype | None = None,
                       cache_dir: str | os.PathLike | None = None) -> Plan | None:
    """The newest cached plan that has an entry for every key in ``keys``, or None: an explicit opt-in.

    A lookup by op names alone: any cached model whose ops include these names
    matches, another model's too (a smaller model, the same layers at other
    widths, a piece of another model). The compile backend never uses it (see
    :mod:`compfx.compile_backend`); call it only where you know the keys are a piece
    of a model you searched, and pass the plan to ``compfx.backend`` yourself.
    """
    wanted = set(keys)
    if not wanted:
        return None
    for path in _newest_first(_plan_files(cache_folder(cache_dir), low_dtype=low_dtype)):
        found = _load_or_skip(path)
        if found is not None and wanted <= set(found.plan):
            return found.plan
    return None


def _plan_files(folder: Path, fingerprint: str | None = None, low_dtype: torch.dtype | None = None) -> list[Path]:
    """The files in ``folder`` named as plans (of ``fingerprint``, in ``low_dtype``), inside it; none when the folder
    is missing. Other plans' files are not read: only a file whose content contradicts its name is damaged."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as error:
        log.warning("compfx: cannot list the plan cache %s (%s); no cached plan is used.", folder, error)
        return []
    paths = []
    for name in names:
        match = _PLAN_NAME.fullmatch(name)
        if match and (fingerprint is None or match["fingerprint"] == fingerprint) \
                and (low_dtype is None or match["dtype"] == dtype_name(low_dtype)):
            try:
                paths.append(_inside(folder, folder / name))
            except CacheKeyError as error:
                _warn_once(folder / name, "cached plan", str(error))
    return paths


def _newest_first(paths: Iterable[Path]) -> list[Path]:
    """Newest first; a file deleted meanwhile (another process) is left out."""
    stamped = []
    for path in paths:
        try:
            stamped.append((path.stat().st_mtime, path))
        except OSError:
            continue
    return [path for _, path in sorted(stamped, key=lambda item: item[0], reverse=True)]


# -- plans searched in this process -------------------------------------------------

@dataclass(frozen=True)
class SearchedPlan:
    """A plan this process searched, with the model it was searched for and the file it was saved to (or None)."""

    plan: Plan
    model: nn.Module
    path: Path | None
    at: str = ""  # when it was remembered (the search's end), ISO 8601


_searched: dict[int, tuple] = {}  # id(parameter) -> (parameter ref, model ref, plan, path, at)


def remember_plan(model: nn.Module, plan: Plan, path: Path | None) -> None:
    """Remember that this process searched ``plan`` for ``model`` (:func:`searched_plan_of` finds it by the model's
    parameters; nothing keeps the model alive)."""
    model_ref, at = weakref.ref(model), _this_search()["at"]
    for parameter in model.parameters():
        _searched[id(parameter)] = (weakref.ref(parameter), model_ref, plan, path, at)


def searched_plan_of(tensors: Iterable) -> SearchedPlan | None:
    """The plan this process searched for the model whose parameters are among ``tensors``, or None.

    >>> import torch
    >>> model = torch.nn.Linear(2, 2)
    >>> plan = Plan({}, low_dtype=torch.bfloat16, fingerprint="0123456789abcdef")
    >>> remember_plan(model, plan, None)
    >>> searched_plan_of([torch.zeros(1), model.weight]).model is model, searched_plan_of([torch.zeros(1)])
    (True, None)
    """
    for tensor in tensors:
        entry = _searched.get(id(tensor))
        if entry is None:
            continue
        parameter_ref, model_ref, plan, path, at = entry
        model = model_ref()
        if parameter_ref() is tensor and model is not None:
            return SearchedPlan(plan, model, path, at)
        if parameter_ref() is None or model is None:
            del _searched[id(tensor)]  # the model is gone; its id may be reused
    return None


# -- leftovers ---------------------------------------------------------------------

_cleaned: set[Path] = set()  # folders cleaned by this process


def remove_abandoned_temp_files(folder: str | os.PathLike, *, min_age_s: float = TEMP_MAX_AGE_S,
                                 force: bool = False) -> list[Path]:
    """Remove temp files that writers killed mid-write left in ``folder``; returns what was removed.

    Only compfx's own temp names for cache files (``.<fingerprint>-<dtype>.json.<random>.tmp``,
    ``.<entry hash>.json.<random>.tmp``), only files older than ``min_age_s``
    (a writer that is alive renames its temp file within seconds), and once per
    folder and process unless ``force``.

    >>> import tempfile, pathlib, os
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> old = folder / ".0123456789abcdef-bfloat16.json.abcd1234.tmp"
    >>> _ = old.write_text("{"); os.utime(old, (0, 0))
    >>> (folder / "notes.tmp").write_text("mine") and None
    >>> [p.name for p in remove_abandoned_temp_files(folder)], sorted(p.name for p in folder.iterdir())
    (['.0123456789abcdef-bfloat16.json.abcd1234.tmp'], ['notes.tmp'])
    """
    folder = Path(folder)
    if folder in _cleaned and not force:
        return []
    _cleaned.add(folder)
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not _TEMP_NAME.fullmatch(name):
            continue
        path = folder / name
        try:
            if path.is_symlink() or not path.is_file() or now - path.stat().st_mtime < min_age_s:
                continue
            path.unlink()
            removed.append(path)
        except OSError:
            continue  # another process removed or renamed it meanwhile
    if removed:
        log.info("compfx: removed %d temp file(s) left by interrupted writers in %s", len(removed), folder)
    return removed


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
    """The entry at ``path`` when it holds ``key`` in format ``fmt``; None when missing, damaged or another key's.

    A damaged entry (binary, not JSON, too large, not a mapping) is warned
    about once; the caller measures again and overwrites it.
    """
    try:
        if _linked(path.parent):
            return None
        data = read_json(_inside(path.parent, path), "cache entry", max_bytes=MAX_ENTRY_BYTES)
    except CacheKeyError as error:
        _warn_once(path, "cache entry", str(error))
        return None
    except PlanFileError as error:
        if not isinstance(error.__cause__, FileNotFoundError):
            _warn_once(path, "cache entry", str(error))
        return None  # measured again and overwritten
    if not isinstance(data, Mapping):
        _warn_once(path, "cache entry", f"a JSON {type(data).__name__}, not an entry")
        return None
    if data.get("format") != fmt or data.get("key") != json.loads(json.dumps(key)):
        return None  # another key's entry (a hash collision) or another format: not damage
    return data


def discard_entry(path: Path, reason: str) -> None:
    """Say (once) that the entry at ``path`` cannot be used (``reason``); the caller measures it again."""
    _warn_once(path, "cache entry", reason)


def write_entry(path: Path, key: Mapping[str, Any], fmt: str, version: int, result: Mapping[str, Any]) -> bool:
    """Write the entry for ``key`` (atomically): its format, version, the key itself and ``result``.

    Returns False (and warns) when the cache cannot be written: the
    measurement is still used, it is only not kept.
    """
    try:
        if _linked(path.parent):
            return False
        remove_abandoned_temp_files(path.parent)
        # not durable: a lost or damaged entry is measured again, and fsyncing each costs more than most ops
        write_json_atomic(_inside(path.parent, path), {"format": fmt, "version": version, "key": key, **result},
                          "cache entry", durable=False)
        return True
    except (FileWriteError, CacheKeyError) as error:
        _warn_once(path, "cache entry", f"not written: {error}")
        return False
