"""The search log: one JSON object per line, one line per sample, flushed as it is written.

A log survives a crash or Ctrl-C up to the last finished sample, and
``SearchLog.read(path)`` turns it back into records. Each record names its
:class:`~compfx.vocabulary.Stage`, the plan it sampled (the CoMP string of an
:class:`~compfx.plan.Assignment`) and its :class:`~compfx.vocabulary.SampleStatus`.
Records with status ``note`` are not samples: they say why the search did what
it did (the Stage-1 space was reduced, the Stage-2 check fell back, ...).

Resume: the first line of a log written by :func:`compfx.optimize` carries, in
``extra["search"]``, the model's fingerprint and every setting that can change
a decision (:func:`compfx.search.config.decision_settings`).
``SearchLog.open(path, header, resume=True)`` reads an existing log, refuses
one written for another model or other settings, drops a last line cut short
by a crash, and keeps appending to it. :class:`~compfx.search.evaluator.Replay` then serves the outcome
of every sample already logged -- Stage-1 epochs batch by batch (loss and
seconds), Stage-2 timings, the Stage-2 check -- instead of running it again
(:class:`compfx.search.evaluator.ReplayingEvaluator`), so a resumed search makes
the same decisions as one that was never interrupted.

Tamper evidence: every line written to a file carries a ``digest``, the
SHA-256 of the previous line's digest and of this line's record as canonical
JSON (sorted keys, no spaces), so each digest depends on every record before
it. Reading a log recomputes the chain: a record changed after it was written
(a scaled loss, an edited plan), a line inserted, removed or moved, is refused
with a :class:`~compfx.errors.LogIntegrityError` that names the first line that
does not match. Cutting lines off the end is not detectable by a chain, but it
is harmless: it is what a crash does, and a resume runs those samples again.
The chain detects changes; it is not a signature (whoever can write the file
can recompute it).

Logs written before digests cannot be checked: ``SearchLog.read`` reads them
with a warning (for reports), and a resume refuses them, because it would
replay their records as measurements.

One writer at a time, and nothing else overwritten: a log file is opened
without following a symbolic link and without blocking, must be a regular
file, and is locked (``flock``, where the OS has it) for as long as it is open,
so a second search or guard writing the same path is refused
(:class:`~compfx.errors.FileWriteError`) instead of interleaving lines. A new
log replaces an existing file only when that file is a search log (or empty);
:meth:`SearchLog.append_to` (what :class:`compfx.Guard` uses) adds to an
existing log, continuing its digest chain, and never truncates it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

from ..errors import FileWriteError, LogIntegrityError, PlanFileError, PlanMismatchError
from ..files import check_writable, checked_path, file_kind, read_bounded, read_head, unique_keys

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks; one writer per log is then the user's to keep
    fcntl = None
from ..vocabulary import SampleStatus, Stage

__all__ = ["SampleRecord", "SearchLog", "REPLAYED_STAGES", "HEADER", "BATCHES", "STOPPED_EARLY", "DUEL",
           "SAVED_BYTES", "PRUNED_AT", "BATCH_VERDICT", "CANNOT_WIN", "NOTHING_CAN_WIN", "SEGMENT_NOT_ENUMERATED",
           "INCUMBENT_AGAIN", "DIGEST",
           "RESULT",
           "record_digest", "MAX_LOG_BYTES", "is_search_log"]

#: key, in the ``extra`` of a log's first line, of what the search was run on (fingerprint and settings)
HEADER = "search"
#: key of a live Stage-1 record's ``extra``: [loss, seconds] per batch, which a resumed search replays
BATCHES = "batches"
#: key of a Stage-1 record's ``extra`` on a sample stopped early on pace (see SearchConfig.early_stop)
STOPPED_EARLY = "stopped_early"
#: key, in a note's ``extra``, of one duel of the decision rule (:mod:`compfx.search.compare`): the two plans, the
#: seconds of each round, and the verdict; a resumed search replays the seconds
DUEL = "duel"
#: key of a sample's ``extra``: the activation bytes one forward of its plan saves for backward
SAVED_BYTES = "saved_bytes"
#: key of an accepted Stage-1 sample's ``extra``: why its batches, compared with the incumbent's, did not support a duel
BATCH_VERDICT = "batch_verdict"
#: key of a skipped sample's ``extra``: the bar its predicted cost did not get below (see Stage 1's ``cannot_win``)
CANNOT_WIN = "cannot_win"
#: key of a pruned Stage-1 sample's ``extra``: the cost it reached, at which it could no longer win
PRUNED_AT = "pruned_at"
#: key of a note's ``extra``: the search stopped a stage because the profiles show no plan left can win (how many)
NOTHING_CAN_WIN = "nothing_can_win"
#: key of a Stage-2 note's ``extra``: a segment whose ``2**ops`` plans did not all fit ``stage2_budget`` (its
#: boundaries, how many ops lie inside, how many plans were tried)
SEGMENT_NOT_ENUMERATED = "segment_not_enumerated"
#: key of a Stage-1 record's ``extra`` on the incumbent's epoch run again for a candidate to be compared with, not a
#: new sample: the candidate whose epoch it took turns with, or "alone"
INCUMBENT_AGAIN = "incumbent_again"
#: key, in the ``extra`` of the note that ends a finished search's log, of what the report needs (see
#: ``SearchResult.log_summary``)
RESULT = "result"
#: key, in each line of a log file, of the chained digest of that line's record (see the module docstring)
DIGEST = "digest"
#: A log holds a few numbers per batch and sample; a larger file is not one compfx wrote.
MAX_LOG_BYTES = 256 << 20


def is_search_log(head: bytes) -> bool:
    """Whether a file's first bytes are those of a search log compfx wrote (a JSON object with stage and status).

    >>> is_search_log(b'{"stage": "search", "plan": "", "status": "note"}\\n'), is_search_log(b"my notes")
    (True, False)
    """
    first = head.split(b"\n", 1)[0]
    try:
        data = json.loads(first)
    except ValueError:
        return len(first) == len(head) and b'"stage"' in first and b'"status"' in first  # a first line over the head
    return isinstance(data, dict) and "stage" in data and "status" in data


def record_digest(previous: str, data: dict) -> str:
    """The digest of a log line: SHA-256 over the previous line's digest ("" first) and ``data`` as canonical JSON.

    >>> first = record_digest("", {"stage": "search", "plan": ""})
    >>> len(first), record_digest(first, {"plan": "", "stage": "search"}) == record_digest(first, {"stage": "search", "plan": ""})
    (64, True)
    """
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(f"{previous}\n{canonical}".encode()).hexdigest()


@dataclass(frozen=True)
class SampleRecord:
    """One line of the log: ``plan`` is the sampled plan's CoMP string ("" for notes)."""

    stage: Stage
    plan: str
    status: SampleStatus
    loss: float | None = None
    cost: float | None = None
    seconds: float | None = None  # measured step time: epoch sum (stage 1) or median step (stage 2)
    batches: int = 0
    reason: str = ""
    duration: float = 0.0  # wall seconds the sample took, set-up and restore included
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        # ValueError (a damaged log line) on a stage or status compfx does not write
        object.__setattr__(self, "stage", Stage(self.stage))
        object.__setattr__(self, "status", SampleStatus(self.status))

    @property
    def is_sample(self) -> bool:
        return self.status is not SampleStatus.NOTE

    def to_dict(self) -> dict:
        """The record as the JSON object of its log line (NaN/inf as strings: they are not JSON)."""
        return json.loads(json.dumps({k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v)
                                      for k, v in asdict(self).items()}))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict) -> "SampleRecord":
        """The record a log line's JSON object holds; ValueError/TypeError when it is not one compfx writes."""
        if not isinstance(data, dict):
            raise ValueError(f"a log line is a JSON object; got a {type(data).__name__}")
        data = dict(data)
        if "bitstring" in data:  # logs written before the plan field had its name
            data["plan"] = data.pop("bitstring")
        for name in ("loss", "cost", "seconds"):
            if isinstance(data.get(name), str):
                data[name] = float(data[name])
        record = cls(**data)
        _check_types(record)
        return record

    @classmethod
    def from_json(cls, line: str) -> "SampleRecord":
        return cls.from_dict(json.loads(line))


def _check_types(record: SampleRecord) -> None:
    """A parsed record's fields have the types compfx writes (TypeError naming the field otherwise)."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    checks = {"plan": isinstance(record.plan, str), "reason": isinstance(record.reason, str),
              "extra": isinstance(record.extra, dict), "duration": number(record.duration),
              "batches": isinstance(record.batches, int) and not isinstance(record.batches, bool),
              **{name: getattr(record, name) is None or number(getattr(record, name))
                 for name in ("loss", "cost", "seconds")}}
    wrong = [name for name, ok in checks.items() if not ok]
    if wrong:
        raise TypeError(f"field {wrong[0]!r} is a {type(getattr(record, wrong[0])).__name__}, not what compfx writes")


#: the stages whose samples a resumed search replays from the log instead of running them again
REPLAYED_STAGES = (Stage.STAGE1, Stage.STAGE2, Stage.CHECK)


def _holds_measurements(record: SampleRecord) -> bool:
    """Does ``record`` hold what a resumed search replays instead of measuring again (a sample of a replayed stage
    that ran, a duel)? Notes and skipped samples a resumed search writes again, in microseconds, and the step
    comparison it times again."""
    ran = record.status not in (SampleStatus.NOTE, SampleStatus.SKIPPED) and record.stage in REPLAYED_STAGES
    return ran or DUEL in record.extra


class SearchLog:
    """Records of one search, kept in memory and, given a path, appended to a JSON Lines file.

    >>> log = SearchLog()
    >>> log.append(SampleRecord(Stage.STAGE1, "11", SampleStatus.ACCEPTED, loss=0.5, cost=1.0))
    >>> [r.plan for r in log.samples()]
    ['11']
    """

    def __init__(self, path: str | os.PathLike | None = None, *, append: bool = False, keep_bytes: int | None = None):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise PlanFileError(f"log={path!r}; expected the path of a JSON Lines file (str or os.PathLike), a "
                                "SearchLog, or None.")
        self.path = checked_path(path, "search log") if path is not None else None
        self.records: list[SampleRecord] = []
        self._file = None
        self._header: dict | None = None  # goes into the first line written
        self._digest = ""  # the digest of the last line written (see record_digest)
        self.verified = True  # False: read from a log without digests (see the module docstring)
        if self.path is not None:
            self._file = _open_for_writing(self.path, append, keep_bytes)

    @staticmethod
    def check_path(log, *, resume: bool = False) -> None:
        """Refuse, before a search starts, a ``log=`` it could not write (see the module docstring).

        A path must be writable as a new log (a link, folder, FIFO or device, or
        an existing file that is not a search log, is refused); with ``resume``,
        an existing log must be a regular file.
        """
        if log is None or isinstance(log, SearchLog):
            return
        if not isinstance(log, (str, os.PathLike)):
            raise PlanFileError(f"log={log!r}; expected the path of a JSON Lines file (str or os.PathLike), a "
                                "SearchLog, or None.")
        path = checked_path(log, "search log")
        if resume and path.exists() and not path.is_symlink():
            read_head(path, "search log", 0)  # refuses a FIFO or device without blocking
            return
        check_writable(path, "search log", replaces=is_search_log, hint=_HINT)

    @classmethod
    def append_to(cls, path: str | os.PathLike) -> "SearchLog":
        """A log that adds to the search log at ``path`` (created when missing), continuing its digest chain.

        The existing records are read and verified first; a file that is not a
        search log, or a log without digests, is refused and left as it was. A
        last line cut short by a crash is dropped, as on resume.
        """
        path = checked_path(path, "search log")
        if not os.path.lexists(path) or (path.is_file() and not path.is_symlink() and path.stat().st_size == 0):
            return cls(path)
        if not path.is_symlink() and path.is_file() and not is_search_log(read_head(path, "search log")):
            raise PlanFileError(f"{path} exists and is not a search log compfx wrote; compfx does not add to it. Pass "
                                "the search's log, or a new path.")
        previous, good_bytes = cls._read(path)
        if not previous.verified:
            raise LogIntegrityError(f"search log {path} has no digests (an older compfx wrote it); lines added to it "
                                    "could not be chained. Pass a new log path.")
        opened = cls(path, append=True, keep_bytes=good_bytes)  # a last line cut short by a crash is dropped
        opened.records, opened._digest = previous.records, previous._digest
        return opened

    @classmethod
    def open(cls, log: "str | os.PathLike | SearchLog | None", header: dict, *, resume: bool = False) -> "SearchLog":
        """The log a search writes to, starting with a header note; with ``resume``, the records already there.

        ``header`` holds ``fingerprint`` (the model's) and the settings that must
        match for a resumed search to reach the same decision.
        """
        if resume and log is None:
            raise PlanFileError("resume=True needs log=<path of the search log to resume>; got log=None.")
        if resume and not isinstance(log, SearchLog) and Path(log).exists():
            previous, good_bytes = cls._read(Path(log))
            if previous.records:
                return cls._reopen(Path(log), header, previous, good_bytes)
        opened = log if isinstance(log, SearchLog) else cls(log)
        if not opened.records:
            opened._header = dict(header)
        return opened

    @classmethod
    def _reopen(cls, path: Path, header: dict, previous: "SearchLog", good_bytes: int) -> "SearchLog":
        if not previous.verified:
            raise LogIntegrityError(
                f"search log {path} has no digests (a compfx from before tamper-evident logs wrote it), so its "
                "records cannot be checked, and a resumed search would replay them as measured. Search again "
                "without resume=True (its samples are run again), or resume with a log this compfx wrote.")
        _check_header(path, previous, header)
        opened = cls(path, append=True, keep_bytes=good_bytes)  # drops a last line cut short by a crash
        opened.records = previous.records
        opened._digest = previous._digest
        opened.note(Stage.SEARCH, "resumed", samples_in_log=len(previous.samples()))
        return opened

    def append(self, record: SampleRecord) -> None:
        if self._header is not None:
            record = replace(record, extra={**record.extra, HEADER: self._header})
            self._header = None
        self.records.append(record)
        if self._file is not None:
            data = record.to_dict()
            self._digest = record_digest(self._digest, data)
            self._file.write(json.dumps({**data, DIGEST: self._digest}) + "\n")
            self._file.flush()  # one line per finished sample survives a crash of the process
            if _holds_measurements(record):  # and of the machine, for what cost time to measure
                os.fsync(self._file.fileno())

    def note(self, stage: Stage, message: str, **extra) -> None:
        self.append(SampleRecord(stage, "", SampleStatus.NOTE, reason=message, extra=extra))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def samples(self, stage: Stage | str | None = None) -> list[SampleRecord]:
        return [r for r in self.records if r.is_sample and (stage is None or r.stage == stage)]

    def notes(self) -> list[SampleRecord]:
        return [r for r in self.records if not r.is_sample]

    def __iter__(self) -> Iterator[SampleRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        where = f" -> {self.path}" if self.path else ""
        return f"SearchLog({len(self.samples())} samples, {len(self.notes())} notes{where})"

    @classmethod
    def read(cls, path: str | os.PathLike) -> "SearchLog":
        """Load a log written by a search; a damaged line raises :class:`PlanFileError`.

        Digests are checked: a changed, inserted, removed or moved line raises
        :class:`~compfx.errors.LogIntegrityError`; a log written before digests
        is read with a warning (``log.verified`` is False). (Resuming is more
        lenient about a last line cut short by a crash, which it drops, and
        stricter about old logs, which it refuses.)
        """
        log = cls._read(Path(path), strict=True)[0]
        if not log.verified and log.records:
            warnings.warn(f"search log {path} has no digests (written before tamper-evident logs); its records "
                          "were read unchecked.", stacklevel=2)
        return log

    @classmethod
    def _read(cls, path: Path, strict: bool = False) -> tuple["SearchLog", int]:
        """The log and the number of bytes that hold complete lines; ``strict`` parses an unfinished last line too."""
        log = cls()
        text = read_bounded(path, "search log", MAX_LOG_BYTES).decode("utf-8", errors="replace")
        lines = text.split("\n")
        complete, tail = lines[:-1], lines[-1]  # ``tail`` is "" when the file ends with a newline
        if strict and tail.strip():
            complete, tail = lines, ""
        chained: bool | None = None  # whether the lines carry digests, decided by the first line
        for number, line in enumerate(complete, 1):
            if not line.strip():
                continue
            data = _parse_line(path, number, line)
            digest = data.pop(DIGEST, None)
            if chained is None:
                chained = digest is not None
            if chained != (digest is not None):
                raise LogIntegrityError(
                    f"search log {path} line {number} {'has no' if chained else 'has a'} digest, unlike line 1: "
                    "lines were added to or changed in it after compfx wrote it. A resumed search replays logged "
                    "results as measured, so it cannot use this log; delete it and search again without resume=True.")
            if digest is not None and digest != record_digest(log._digest, data):
                raise LogIntegrityError(
                    f"search log {path} line {number} does not match its digest: that line, or the order of the lines "
                    "before it, was changed after compfx wrote it. A resumed search replays logged results as "
                    "measured, so it refuses a changed log; delete it (or restore the original) and search again "
                    "without resume=True.")
            log._digest = digest or ""
            log.records.append(_record(path, number, data))
        log.verified = chained is not False
        good_bytes = len(text.encode("utf-8")) - len(tail.encode("utf-8"))
        return log, good_bytes


_HINT = "Pass another log=."


def _open_for_writing(path: Path, append: bool, keep_bytes: int | None = None):
    """``path`` opened to write a log: no link followed, no blocking, a regular file, locked, then emptied unless
    ``append`` (only after the lock: truncating first would empty another writer's log); appending, the bytes
    after ``keep_bytes`` (an unfinished last line) are dropped first."""
    check_writable(path, "search log", replaces=None if append else is_search_log, hint=_HINT)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
            | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        raise FileWriteError(
            f"could not open the search log {path} for writing: {error.strerror or error}; expected the path of a "
            "file (not a folder or a link) in a folder this process can write. Pass another log=.") from error
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileWriteError(f"search log {path} is {file_kind(mode)}, not a regular file; pass the path of a file.")
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                raise FileWriteError(f"search log {path} is being written by another search or guard (it holds the "
                                     "file's lock); two writers would interleave their lines. Give each its own "
                                     "log path.") from error
        if not append:
            os.ftruncate(fd, 0)
        elif keep_bytes is not None:
            os.ftruncate(fd, keep_bytes)
        os.lseek(fd, 0, os.SEEK_END)
        return os.fdopen(fd, "w")
    except OSError as error:
        os.close(fd)
        raise FileWriteError(f"could not open the search log {path} for writing: {error.strerror or error}.") \
            from error
    except BaseException:
        os.close(fd)
        raise


def _parse_line(path: Path, number: int, line: str) -> dict:
    try:
        data = json.loads(line, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as error:
        raise PlanFileError(f"search log {path} line {number} is damaged ({type(error).__name__}: {error}); "
                            "expected one JSON object per line as compfx writes them. Delete the file (or that "
                            "line) and search again.") from error
    if not isinstance(data, dict):
        raise PlanFileError(f"search log {path} line {number} is damaged (a JSON {type(data).__name__}); expected "
                            "one JSON object per line as compfx writes them. Delete the file and search again.")
    return data


def _record(path: Path, number: int, data: dict) -> SampleRecord:
    try:
        return SampleRecord.from_dict(data)
    except (ValueError, TypeError) as error:
        raise PlanFileError(f"search log {path} line {number} is damaged ({type(error).__name__}: {error}); "
                            "expected one JSON object per line as compfx writes them. Delete the file (or that "
                            "line) and search again.") from error


def _check_header(path: Path, log: SearchLog, header: dict) -> None:
    found = log.records[0].extra.get(HEADER) if log.records else None
    if found is None:
        raise PlanFileError(f"search log {path} has no '{HEADER}' entry on its first line, so compfx cannot tell "
                            "which model and "
                            "settings it was written for; expected a log written by compfx.optimize(log=...). "
                            "Start a new search without resume=True.")
    if found.get("fingerprint") != header.get("fingerprint"):
        raise PlanMismatchError(f"search log {path} was written for another model (fingerprint "
                                f"{found.get('fingerprint')!r}, this model's is {header.get('fingerprint')!r}); "
                                "expected a log of this model. Resume with the log of this model, or search "
                                "again without resume=True.")
    differ = {k: (found.get(k), v) for k, v in header.items() if k != "fingerprint" and found.get(k) != v}
    if differ:
        details = ", ".join(f"{k}: log {old!r} vs now {new!r}" for k, (old, new) in differ.items())
        raise PlanMismatchError(f"search log {path} was written with other search settings ({details}); a resumed "
                                "search replays the logged samples, so expected the same settings. Use them, or "
                                "search again without resume=True.")
