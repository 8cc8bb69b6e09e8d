"""JSON files that compfx writes: atomic writes, clear errors on corrupt reads. Never pickle."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import PlanFileError

__all__ = ["write_json_atomic", "read_json"]


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON to a temp file beside ``path``, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, _mode_for(path))  # mkstemp makes 0600; give the file the mode open() would have
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
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


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Read a JSON file, turning a missing, corrupt or truncated file into a PlanFileError."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as error:
        raise PlanFileError(f"{what} {path} does not exist.") from error
    except OSError as error:
        raise PlanFileError(f"could not read {what} {path}: {error}") from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanFileError(
            f"{what} {path} is not valid JSON ({error.msg} at line {error.lineno}); it may be corrupt or "
            "truncated. Delete it and run the search again."
        ) from error
