"""The search log: one JSON object per line, one line per sample, flushed as it is written.

A log survives a crash or Ctrl-C up to the last finished sample, and
``SearchLog.read(path)`` turns it back into records. Lines with
``"status": "note"`` are not samples: they say why the search did what it did
(the Stage-1 space was reduced, the Stage-2 check fell back, ...).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from .errors import PlanFileError

__all__ = ["SampleRecord", "SearchLog", "STATUSES"]

#: accepted: a valid plan (it may still lose to a cheaper one); rejected: it ran
#: to the end but failed the loss guard; pruned: stopped early because it could
#: no longer win or be accepted; error: the model raised under the plan;
#: skipped: not run, the cost model predicted it could not win (see SearchConfig.predictor).
STATUSES = ("accepted", "rejected", "pruned", "error", "note", "skipped")


@dataclass(frozen=True)
class SampleRecord:
    """One line of the log."""

    stage: str  # "stage1" | "stage2" | "check" | "compare" | "search"
    bitstring: str
    status: str
    loss: float | None = None
    cost: float | None = None
    seconds: float | None = None  # measured step time: epoch sum (stage 1) or median step (stage 2)
    batches: int = 0
    reason: str = ""
    duration: float = 0.0  # wall seconds the sample took, set-up and restore included
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    @property
    def is_sample(self) -> bool:
        return self.status != "note"

    def to_json(self) -> str:
        # NaN/inf are not JSON: write them as strings so every line stays parseable.
        data = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}
        return json.dumps(data, sort_keys=False)

    @classmethod
    def from_json(cls, line: str) -> "SampleRecord":
        data = json.loads(line)
        for name in ("loss", "cost", "seconds"):
            if isinstance(data.get(name), str):
                data[name] = float(data[name])
        return cls(**data)


class SearchLog:
    """Records of one search, kept in memory and, given a path, appended to a JSON Lines file.

    >>> from compfx.searchlog import SearchLog, SampleRecord
    >>> log = SearchLog()
    >>> log.append(SampleRecord("stage1", "11", "accepted", loss=0.5, cost=1.0))
    >>> [r.bitstring for r in log.samples()]
    ['11']
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.records: list[SampleRecord] = []
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w")

    def append(self, record: SampleRecord) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(record.to_json() + "\n")
            self._file.flush()  # one line per finished sample survives a crash
            os.fsync(self._file.fileno())

    def note(self, stage: str, message: str, **extra) -> None:
        self.append(SampleRecord(stage, "", "note", reason=message, extra=extra))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def samples(self, stage: str | None = None) -> list[SampleRecord]:
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
        """Load a log written by a search; a damaged line raises :class:`PlanFileError`."""
        log = cls()
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as error:
            raise PlanFileError(f"could not read search log {path}: {error}") from error
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                log.records.append(SampleRecord.from_json(line))
            except (ValueError, TypeError) as error:
                raise PlanFileError(f"search log {path} line {number} is damaged ({error}); "
                                    "the search may have been killed mid-write.") from error
        return log
