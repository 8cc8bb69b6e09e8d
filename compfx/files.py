"""JSON files that compfx writes: atomic writes, bounded reads, clear errors on bad files. Never pickle.

Writes go to a temp file beside the target (``.<name>.<random>.tmp``), which
is then renamed over it, so a reader sees the old file or the new one, never
half of one. Reads are bounded: the size is checked before a byte is parsed,
and a file that is not UTF-8, not JSON, nested deeper than Python can parse or
holding an integer too long to convert is a :class:`~compfx.errors.PlanFileError`,
never a ``UnicodeDecodeError``, ``RecursionError`` or ``ValueError``.

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
import tempfile
from pathlib import Path
from typing import Any

from .errors import FileWriteError, PlanFileError

__all__ = ["write_json_atomic", "read_json", "read_bounded", "parse_json", "TEMP_SUFFIX"]

#: Suffix of the temp file a write goes to before it is renamed over its target.
TEMP_SUFFIX = ".tmp"


def write_json_atomic(path: str | os.PathLike, data: Any, what: str = "file", *, durable: bool = True) -> Path:
    """Write ``data`` as JSON to a temp file beside ``path``, then rename over it.

    ``durable`` flushes the file to disk (fsync) before the rename, so that a
    power loss cannot leave an empty file behind; a cache entry, which is
    measured again when it is missing or damaged, skips it (an fsync costs
    milliseconds per file, and a search writes dozens). Any failure (a folder in the way, no permission, a full disk) is a
    :class:`~compfx.errors.FileWriteError` naming ``what`` and the path; the
    temp file is removed and an existing file at ``path`` is left as it was.
    """
    path = Path(path)
    tmp = None
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory", str(path))
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
    """The bytes of ``path``, refused (:class:`PlanFileError`) when missing, unreadable or over ``max_bytes``.

    The size is checked before reading, and never more than ``max_bytes + 1``
    bytes are read, so a file that grows meanwhile cannot slip through either.
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            data = handle.read(max_bytes + 1) if size <= max_bytes else b""
    except FileNotFoundError as error:
        raise PlanFileError(f"{what} {path} does not exist.") from error
    except OSError as error:
        raise PlanFileError(f"could not read {what} {path}: {error.strerror or error}; expected a file "
                            "this process can read. Check the path.") from error
    if size > max_bytes or len(data) > max_bytes:
        raise PlanFileError(f"{what} {path} is {max(size, len(data))} bytes, more than the {max_bytes} a {what} "
                            "can be; it is not one compfx wrote. Delete it or pass the right file.")
    return data


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
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanFileError(
            f"{source} is not valid JSON ({error.msg} at line {error.lineno}); it may be corrupt or "
            "truncated. Delete it and run the search again."
        ) from error
    except (RecursionError, ValueError) as error:  # nesting too deep; an integer too long to convert
        kind = "nested too deeply" if isinstance(error, RecursionError) else f"not parseable ({error})"
        raise PlanFileError(f"{source} is {kind}; compfx never writes such a file. Delete it and run the "
                            "search again.") from error
