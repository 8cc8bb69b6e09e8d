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
by a crash, and keeps appending to it. :class:`Replay` then serves the outcome
of every sample already logged -- Stage-1 epochs batch by batch (loss and
seconds), Stage-2 timings, the Stage-2 check -- instead of running it again
(:class:`compfx.search.evaluator.ReplayingEvaluator`), so a resumed search makes
the same decisions as one that was never interrupted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from ..errors import PlanFileError, PlanMismatchError, SearchError, SearchReplayError
from ..plan import Assignment
from ..vocabulary import SampleStatus, Stage

__all__ = ["SampleRecord", "SearchLog", "Replay", "ReplayedState", "HEADER", "BATCHES", "STOPPED_EARLY"]

#: key, in the ``extra`` of a log's first line, of what the search was run on (fingerprint and settings)
HEADER = "search"
#: key of a live Stage-1 record's ``extra``: [loss, seconds] per batch, which a resumed search replays
BATCHES = "batches"
#: key of a Stage-1 record's ``extra`` on a sample stopped early on pace (see SearchConfig.early_stop)
STOPPED_EARLY = "stopped_early"


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

    def to_json(self) -> str:
        # NaN/inf are not JSON: write them as strings so every line stays parseable.
        data = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}
        return json.dumps(data, sort_keys=False)

    @classmethod
    def from_json(cls, line: str) -> "SampleRecord":
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"a log line is a JSON object; got a {type(data).__name__}")
        if "bitstring" in data:  # logs written before the plan field had its name
            data["plan"] = data.pop("bitstring")
        for name in ("loss", "cost", "seconds"):
            if isinstance(data.get(name), str):
                data[name] = float(data[name])
        return cls(**data)


class SearchLog:
    """Records of one search, kept in memory and, given a path, appended to a JSON Lines file.

    >>> log = SearchLog()
    >>> log.append(SampleRecord(Stage.STAGE1, "11", SampleStatus.ACCEPTED, loss=0.5, cost=1.0))
    >>> [r.plan for r in log.samples()]
    ['11']
    """

    def __init__(self, path: str | os.PathLike | None = None, *, append: bool = False):
        self.path = Path(path) if path is not None else None
        self.records: list[SampleRecord] = []
        self._file = None
        self._header: dict | None = None  # goes into the first line written
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w")

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
        _check_header(path, previous, header)
        with open(path, "r+b") as file:  # drop a last line cut short by a crash before appending
            file.truncate(good_bytes)
        opened = cls(path, append=True)
        opened.records = previous.records
        opened.note(Stage.SEARCH, "resumed", samples_in_log=len(previous.samples()))
        return opened

    def append(self, record: SampleRecord) -> None:
        if self._header is not None:
            record = replace(record, extra={**record.extra, HEADER: self._header})
            self._header = None
        self.records.append(record)
        if self._file is not None:
            self._file.write(record.to_json() + "\n")
            self._file.flush()  # one line per finished sample survives a crash
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

        (Resuming is more lenient: it drops a last line cut short by a crash.)
        """
        return cls._read(Path(path), strict=True)[0]

    @classmethod
    def _read(cls, path: Path, strict: bool = False) -> tuple["SearchLog", int]:
        """The log and the number of bytes that hold complete lines; ``strict`` parses an unfinished last line too."""
        log = cls()
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError as error:
            raise PlanFileError(f"could not read search log {path}: {error}; expected a JSON Lines file written "
                                "by compfx.optimize(log=...). Check the path.") from error
        lines = text.split("\n")
        complete, tail = lines[:-1], lines[-1]  # ``tail`` is "" when the file ends with a newline
        if strict and tail.strip():
            complete, tail = lines, ""
        for number, line in enumerate(complete, 1):
            if line.strip():
                log.records.append(_parse_line(path, number, line))
        good_bytes = len(text.encode("utf-8")) - len(tail.encode("utf-8"))
        return log, good_bytes


def _parse_line(path: Path, number: int, line: str) -> SampleRecord:
    try:
        return SampleRecord.from_json(line)
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


# -- replaying a log ----------------------------------------------------------------

@dataclass(frozen=True)
class ReplayedState:
    """Stands in for the trained state of a Stage-1 epoch served from the log (it was not kept)."""

    plan: Assignment


_REPLAYED_STAGES = (Stage.STAGE1, Stage.STAGE2, Stage.CHECK)


class Replay:
    """Outcomes of logged samples, keyed by stage and plan, handed back instead of re-running them.

    It also records, per Stage-1 epoch that runs live, each batch's loss and
    seconds, which :meth:`annotate` adds to the log line so that a later resume
    can replay the epoch batch by batch (pruning decisions depend on them).

    >>> log = SearchLog()
    >>> log.append(SampleRecord(Stage.STAGE2, "10", SampleStatus.ACCEPTED, seconds=0.5, cost=0.5))
    >>> Replay(log.records).time_step(Assignment.parse("10"))
    0.5
    """

    def __init__(self, records=()):
        self.logged: dict[tuple[Stage, str], SampleRecord] = {}
        self.skipped: set[tuple[Stage, str]] = set()  # never run (the cost model skipped them): nothing to replay
        for record in records:
            key = (record.stage, record.plan)
            if record.status is SampleStatus.SKIPPED:
                self.skipped.add(key)
            elif record.is_sample and record.stage in _REPLAYED_STAGES:
                self.logged[key] = record
        self.replayed: set[tuple[Stage, str]] = set()
        self._batches: dict[str, list[list[float]]] = {}

    def has(self, stage: Stage, plan: Assignment) -> bool:
        return (stage, str(plan)) in self.logged

    def _take(self, stage: Stage, plan: Assignment) -> SampleRecord:
        key = (stage, str(plan))
        self.replayed.add(key)
        record = self.logged[key]
        if record.status is SampleStatus.ERROR:
            raise SearchReplayError(f"(replayed from the log) {record.reason}")
        return record

    def epoch(self, plan: Assignment, run_live: Callable[[], Iterator]) -> Iterator:
        """A Stage-1 epoch: the logged batches replayed, or the live epoch with its batches recorded."""
        if self.has(Stage.STAGE1, plan):
            return self._replay_epoch(plan)
        return self._record_epoch(plan, run_live())

    def _replay_epoch(self, plan: Assignment):
        record = self._take(Stage.STAGE1, plan)
        batches = record.extra.get(BATCHES)
        if batches is None:
            raise SearchError(f"the logged Stage-1 sample {plan} has no per-batch losses, so it cannot be "
                              "replayed; expected a log written by this compfx version. Search again without "
                              "resume=True.")
        for loss, seconds in batches:
            yield float(loss), float(seconds)
        return ReplayedState(plan)

    def _record_epoch(self, plan: Assignment, epoch):
        batches = self._batches[str(plan)] = []
        try:
            while True:
                loss, seconds = next(epoch)
                batches.append([loss, seconds])
                yield loss, seconds
        except StopIteration as stop:
            return stop.value
        finally:
            epoch.close()  # pruning closes this wrapper: let the live epoch restore the state

    def time_step(self, plan: Assignment) -> float:
        return float(self._take(Stage.STAGE2, plan).seconds)

    def check_loss(self, plan: Assignment) -> float:
        return float(self._take(Stage.CHECK, plan).loss)

    def annotate(self, record: SampleRecord) -> SampleRecord | None:
        """The record to log: None when it was replayed (already in the log), with per-batch data for Stage 1."""
        key = (record.stage, record.plan)
        if key in self.replayed or (record.status is SampleStatus.SKIPPED and key in self.skipped):
            return None
        if record.stage is Stage.STAGE1 and record.plan in self._batches:
            batches = self._batches.pop(record.plan)
            return replace(record, extra={**record.extra, BATCHES: batches})
        return record
