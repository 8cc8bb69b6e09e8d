"""Run a command in its own process group and stop it at a deadline: a hung kernel or a slow compile cannot eat
the rest of a time-boxed run.

The deadline is asked again while the command runs, so a caller can move it (the GPU suite gives each benchmark
row its own limit, read from the row the worker says it has started). At the deadline the whole process group is
killed (Inductor's compile workers too), and the result says so. Output goes to a log file, never to the
caller's terminal, so a chatty compile cannot push the summary out of a short output tail.

>>> import sys, tempfile, time
>>> log = Path(tempfile.mkdtemp()) / "boxed.log"
>>> end = time.time() + 60
>>> done = run_boxed([sys.executable, "-c", "print('hello')"], log_path=log, deadline=lambda: end)
>>> done.returncode, done.timed_out, "hello" in done.tail()
(0, False, True)
>>> end = time.time() + 0.5
>>> slow = run_boxed([sys.executable, "-c", "import time; time.sleep(60)"], log_path=log, deadline=lambda: end)
>>> slow.timed_out, slow.seconds < 30
(True, True)
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["Boxed", "run_boxed", "tail_of"]

_POLL_S = 0.2


@dataclass(frozen=True)
class Boxed:
    """How a boxed command ended: its return code (None when it was killed), seconds, and its log."""

    returncode: int | None
    seconds: float
    timed_out: bool
    log_path: Path

    def tail(self, chars: int = 4000) -> str:
        return tail_of(self.log_path, chars)


def tail_of(path: str | os.PathLike, chars: int = 4000) -> str:
    """The last ``chars`` characters of a text file ('' when it does not exist)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - chars))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _ended(process: subprocess.Popen) -> bool:
    """True once the command has exited; it is not reaped yet, so its process-group id stays its own."""
    if not hasattr(os, "waitid"):  # no waitid (macOS): poll() reaps it, so leftovers are not killed
        return process.poll() is not None
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the group this module started (the command and whatever it left running), then reap the command."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def run_boxed(argv: Sequence[str], *, log_path: str | os.PathLike, deadline: Callable[[], float],
              env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None) -> Boxed:
    """Run ``argv`` until it ends or ``time.time()`` passes ``deadline()`` (asked every 0.2 s); stdout and
    stderr are appended to ``log_path``."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=None if env is None else dict(env), cwd=cwd, start_new_session=True)
        try:
            while not _ended(process):
                if time.time() >= deadline():
                    _kill_group(process)
                    return Boxed(None, time.time() - start, True, log_path)
                time.sleep(_POLL_S)
        except BaseException:  # Ctrl-C or an error here: never leave the command running
            _kill_group(process)
            raise
        seconds = time.time() - start
        if hasattr(os, "waitid"):  # it has ended, unreaped; children it left behind (compile workers) go with it
            _kill_group(process)
        process.wait()
    return Boxed(process.returncode, seconds, False, log_path)
