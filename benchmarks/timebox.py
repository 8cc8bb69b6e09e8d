"""Run a command in its own process group and stop it at a deadline: a hung kernel or a slow compile cannot eat
the rest of a time-boxed run.

The deadline is asked again while the command runs, so a caller can move it (the GPU suite gives each benchmark
row its own limit, read from the row the worker says it has started). At the deadline the whole process group is
killed (Inductor's compile workers too), and the result says so. Output goes to a log file, never to the
caller's terminal, so a chatty compile cannot push the summary out of a short output tail.

Deadlines are read on a clock: the wall clock by default, or a :class:`CpuClock`, which counts the CPU seconds
of the processes this one started. Work on the CPU alone (the GPU suite's smoke run) takes about as many CPU
seconds beside other jobs as on a quiet machine, only more wall seconds, so its limits hold under load.

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
>>> clock = CpuClock()
>>> waiting = run_boxed([sys.executable, "-c", "import time; time.sleep(1)"], log_path=log, clock=clock,
...                     deadline=lambda: 0.5)  # half a CPU second: sleeping uses none
>>> waiting.timed_out
False
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["Boxed", "CpuClock", "run_boxed", "tail_of"]

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


class CpuClock:
    """Seconds since it was made, counted as CPU seconds: what the processes this process started have used
    (the ones still running, read from ``/proc``, and the ones it has reaped), or ``floor`` times the wall
    seconds, whichever is more.

    A command that only computes uses about as many CPU seconds on a loaded machine as on a quiet one, so a
    limit on this clock does not come nearer when other jobs take the CPU; one that hangs without using the CPU
    still reaches its limit, ``1 / floor`` times later than on the wall clock. Where ``/proc`` cannot be read
    (not Linux) it is the wall clock. It never goes back.
    """

    def __init__(self, floor: float = 0.1):
        self.floor = floor
        self._wall0 = time.time()
        self._cpu0 = _children_cpu_seconds()
        self._last = 0.0

    def __call__(self) -> float:
        wall = time.time() - self._wall0
        cpu = _children_cpu_seconds()
        counted = wall if cpu is None or self._cpu0 is None else max(cpu - self._cpu0, self.floor * wall)
        self._last = max(self._last, counted)
        return self._last


def _children_cpu_seconds() -> float | None:
    """CPU seconds (user and system) of this process's descendants: the reaped ones (``RUSAGE_CHILDREN``) and
    the live ones (``/proc/<pid>/stat``, with the children they reaped); None without ``/proc``."""
    import resource

    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    parent, ticks = {}, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):  # gone since the listing
            continue
        parent[pid] = int(fields[1])
        ticks[pid] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    live, frontier = 0, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            live += ticks[child]
            frontier.append(child)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return live / tick + reaped.ru_utime + reaped.ru_stime


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the group this module started (the command and whatever it left running), then reap the command."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def run_boxed(argv: Sequence[str], *, log_path: str | os.PathLike, deadline: Callable[[], float],
              env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
              clock: Callable[[], float] = time.time) -> Boxed:
    """Run ``argv`` until it ends or ``clock()`` passes ``deadline()`` (asked every 0.2 s); stdout and stderr are
    appended to ``log_path``. ``seconds`` in the result are wall seconds, whatever the clock."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=None if env is None else dict(env), cwd=cwd, start_new_session=True)
        try:
            while not _ended(process):
                if clock() >= deadline():
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
