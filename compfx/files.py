"""JSON files that compfx writes: atomic writes, bounded reads, clear errors on bad files. Never pickle.

Writes go to a temp file beside the target (``.<name>.<random>.tmp``), which
is then renamed over it, so a reader sees the old file or the new one, never
half of one. Reads are bounded: the size is checked before a byte is parsed,
and a file that is not UTF-8, not JSON, nested deeper than Python can parse or
holding an integer too long to convert is a :class:`~compfx.errors.PlanFileError`,
never a ``UnicodeDecodeError``, ``RecursionError`` or ``ValueError``. A JSON
object that names one key twice is refused too: readers disagree on which
value counts (Python's ``json`` keeps the last), so such a file has no one meaning.

Nothing of the user's is damaged and nothing hangs: a path is checked before it
is used (a str or ``os.PathLike`` without NUL bytes, :func:`checked_path`); files
are opened without blocking and read only when they are regular files (a FIFO
with no writer, a device or a folder is refused, never waited on); a write
never goes through or over a symbolic link, nor over a FIFO or device, and a
caller can refuse to replace a file that is not one of its own
(``write_json_atomic(..., replaces=...)``). :func:`check_writable` checks all
of that before long work starts, so a bad output path fails at once.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "x.json"
>>> _ = write_json_atomic(path, {"a": 1})
>>> read_json(path, "plan file", max_bytes=100)
{'a': 1}
>>> read_json(path, "plan file", max_bytes=4)
Traceback (most recent call last):
...
compfx.errors.PlanFileError: plan file ... is 13 bytes, more than the 4 a plan file can be; it is not one compfx wrote. Delete it or pass the right file.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import BadInputError, FileWriteError, PlanFileError

__all__ = ["write_json_atomic", "read_json", "read_bounded", "read_head", "parse_json", "checked_path",
           "check_writable", "file_kind", "unique_keys", "DuplicateKeyError", "TEMP_SUFFIX"]

#: Suffix of the temp file a write goes to before it is renamed over its target.
TEMP_SUFFIX = ".tmp"

#: How many leading bytes :func:`read_head` reads to tell whose a file is.
HEAD_BYTES = 64 << 10


def checked_path(path, what: str) -> Path:
    """``path`` as a :class:`~pathlib.Path` when it can name a file; :class:`~compfx.errors.BadInputError` otherwise.

    A path is a non-empty str or ``os.PathLike`` without NUL bytes (the OS
    cannot take one; Python would raise ``ValueError`` at the first use).

    >>> checked_path("plan.json", "plan file").name
    'plan.json'
    >>> checked_path(None, "plan file")
    Traceback (most recent call last):
    ...
    compfx.errors.BadInputError: plan file path None is not a path; expected a str or os.PathLike naming a file, e.g. "plan.json".
    """
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(text, str) or not text:
        raise BadInputError(f"{what} path {path!r} is not a path; expected a str or os.PathLike naming a file, "
                            'e.g. "plan.json".')
    if "\0" in text:
        raise BadInputError(f"{what} path {text!r} holds a NUL character, which no file name can; pass the path "
                            "without it.")
    return Path(text)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for refusals).

    >>> file_kind(stat.S_IFIFO)
    'a FIFO (named pipe)'
    """
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _refuse_existing(path: Path, what: str, replaces: Callable[[bytes], bool] | None, hint: str) -> None:
    """FileWriteError when ``path`` is a link, a folder, a FIFO or device, or (given ``replaces``) not one of ours."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as error:  # e.g. a file where a folder of the path should be
        raise FileWriteError(f"could not write {what} {path}: {error.strerror or error}; expected the path of a file "
                             f"(not a folder) in a folder this process can write. {hint}") from error
    if stat.S_ISLNK(info.st_mode):
        raise FileWriteError(f"{what} {path} is a symbolic link; compfx writes neither through a link (its target "
                             f"may be a file of yours) nor over it. {hint} (a regular file's, e.g. the link's target "
                             f"{os.path.realpath(path)} if that is the file to write)")
    if not stat.S_ISREG(info.st_mode):
        raise FileWriteError(f"{what} {path} is {file_kind(info.st_mode)}, not a file compfx can write; expected the "
                             f"path of a regular file (not a folder). {hint}")
    if replaces is not None and info.st_size and not replaces(read_head(path, what)):
        raise FileWriteError(f"{path} exists and is not a {what} compfx wrote; compfx does not overwrite it. {hint} "
                             "(or delete the file first if it is yours to lose)")


def check_writable(path, what: str, *, replaces: Callable[[bytes], bool] | None = None,
                   hint: str = "Pass another path.") -> Path:
    """Check, before long work starts, that ``path`` can be written as ``what``; return it as a Path.

    Refused (:class:`~compfx.errors.BadInputError` for a malformed path,
    :class:`~compfx.errors.FileWriteError` otherwise): a symbolic link, an
    existing folder, FIFO or device, an existing file ``replaces`` does not
    recognise, and a path whose nearest existing folder is not a folder or
    cannot be written. Nothing is created.
    """
    path = checked_path(path, what)
    _refuse_existing(path, what, replaces, hint)
    folder = path.parent
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise FileWriteError(f"cannot write {what} {path}: {folder} is not a folder. {hint}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FileWriteError(f"cannot write {what} {path}: this process may not write in {folder}; fix the folder's "
                             f"permissions. {hint}")
    return path


def write_json_atomic(path: str | os.PathLike, data: Any, what: str = "file", *, durable: bool = True,
                      replaces: Callable[[bytes], bool] | None = None) -> Path:
    """Write ``data`` as JSON to a temp file beside ``path``, then rename over it.

    ``durable`` flushes the file to disk (fsync) before the rename, so that a
    power loss cannot leave an empty file behind; a cache entry, which is
    measured again when it is missing or damaged, skips it (an fsync costs
    milliseconds per file, and a search writes dozens). Any failure (a folder in the way, no permission, a full disk) is a
    :class:`~compfx.errors.FileWriteError` naming ``what`` and the path; the
    temp file is removed and an existing file at ``path`` is left as it was.
    A symbolic link, a FIFO or a device at ``path`` is refused, and so is an
    existing file that ``replaces(first bytes)`` does not recognise as one this
    writer may replace (given ``replaces``).
    """
    path = checked_path(path, what)
    tmp = None
    try:
        _refuse_existing(path, what, replaces, "Pass another path.")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
        os.chmod(tmp, _mode_for(path))  # mkstemp makes 0600; give the file the mode open() would have
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as error:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise FileWriteError(
            f"could not write {what} {path}: {error.strerror or error}; expected the path of a file (not a "
            "folder) in a folder this process can write. Pass another path, or fix the folder's permissions."
        ) from error
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _mode_for(path: Path) -> int:
    """An existing file's permission bits, or what ``open(path, "w")`` would create (0666 less the umask)."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)  # the only way to read the umask is to set it
        os.umask(umask)
        return 0o666 & ~umask


def read_bounded(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The bytes of ``path``, refused (:class:`PlanFileError`) when missing, unreadable, not a regular file or
    over ``max_bytes``.

    The file is opened without blocking (a FIFO with no writer would otherwise
    wait forever) and must be a regular file; the size is checked before
    reading, and never more than ``max_bytes + 1`` bytes are read, so a file
    that grows meanwhile cannot slip through either.
    """
    path = checked_path(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as error:
        raise PlanFileError(f"{what} {path} does not exist.") from error
    except OSError as error:
        raise PlanFileError(f"could not read {what} {path}: {error.strerror or error}; expected a file "
                            "this process can read. Check the path.") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PlanFileError(f"{what} {path} is {file_kind(info.st_mode)}, not a regular file; compfx reads "
                                f"{what}s from regular files only (it would wait forever on a FIFO). Pass the path "
                                "of the file.")
        size = info.st_size
        data = _read_at_most(fd, max_bytes + 1) if size <= max_bytes else b""
    except OSError as error:
        raise PlanFileError(f"could not read {what} {path}: {error.strerror or error}; expected a file "
                            "this process can read. Check the path.") from error
    finally:
        os.close(fd)
    if size > max_bytes or len(data) > max_bytes:
        raise PlanFileError(f"{what} {path} is {max(size, len(data))} bytes, more than the {max_bytes} a {what} "
                            "can be; it is not one compfx wrote. Delete it or pass the right file.")
    return data


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_head(path: str | os.PathLike, what: str, limit: int = HEAD_BYTES) -> bytes:
    """The first ``limit`` bytes of a regular file (to tell whose it is), read as :func:`read_bounded` reads."""
    path = checked_path(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise PlanFileError(f"could not read {what} {path}: {error.strerror or error}.") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PlanFileError(f"{what} {path} is {file_kind(info.st_mode)}, not a regular file.")
        return _read_at_most(fd, limit)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike, what: str = "file", *, max_bytes: int = 32 << 20) -> Any:
    """Read a JSON file; a missing, oversized, binary, corrupt or truncated file is a :class:`PlanFileError`."""
    data = read_bounded(path, what, max_bytes)
    return parse_json(data, f"{what} {Path(path)}")


def parse_json(data: bytes | str, source: str) -> Any:
    """``json.loads`` whose every failure is a :class:`PlanFileError` naming ``source``."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as error:
        raise PlanFileError(f"{source} is not UTF-8 text (byte {error.start} is 0x{data[error.start]:02x}); it "
                            "is not a file compfx wrote, or it is damaged. Delete it and run the search again.") \
            from error
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKeyError as error:
        raise PlanFileError(f"{source} names the key {error.key!r} twice in one object; readers disagree on which "
                            "value counts, and compfx never writes such a file. Remove one of them, or search "
                            "again.") from error
    except json.JSONDecodeError as error:
        raise PlanFileError(
            f"{source} is not valid JSON ({error.msg} at line {error.lineno}); it may be corrupt or "
            "truncated. Delete it and run the search again."
        ) from error
    except (RecursionError, ValueError) as error:  # nesting too deep; an integer too long to convert
        kind = "nested too deeply" if isinstance(error, RecursionError) else f"not parseable ({error})"
        raise PlanFileError(f"{source} is {kind}; compfx never writes such a file. Delete it and run the "
                            "search again.") from error


class DuplicateKeyError(ValueError):
    """A JSON object names ``key`` twice (raised while parsing; :func:`parse_json` turns it into a PlanFileError)."""

    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json``'s ``object_pairs_hook``: the object as a dict, refusing a key named twice.

    >>> json.loads('{"a": 1, "a": 2}', object_pairs_hook=unique_keys)
    Traceback (most recent call last):
    ...
    compfx.files.DuplicateKeyError: duplicate key 'a'
    """
    data = dict(pairs)
    if len(data) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return data
