"""The spans file: each worker appends its executor-clock changes to RUN_DIR/spans/<role>-<rank>.jsonl.

One line per change of state, written with a single O_APPEND write (no buffer to lose when the
worker is killed): `{"t": unix seconds, "state": "busy" | idle reason | "end"}`. Every start of the
worker first writes `{"t": ..., "event": "start", "pid": ...}`, so the file also counts restarts.
In a pod RLFLEET_RUN_DIR is the pod's own volume (an emptyDir that outlives container restarts, the
trainer's PersistentVolumeClaim); `kubectl cp` the files into one directory for `rlfleet report`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
END = "end"


class SpanLog:
    """Appends state changes of one worker; a run directory that cannot be written disables it."""

    def __init__(self, path: Path):
        self.path = path
        self.previous_starts = _count_starts(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            log.warning("no spans file (%s): timelines of this worker will be missing", error)
            self._fd = None
        self._write({"event": "start", "pid": os.getpid()}, time.time())

    def change(self, wall_time: float, state: str) -> None:
        self._write({"state": state}, wall_time)

    def _write(self, fields: dict, wall_time: float) -> None:
        if self._fd is None:
            return
        line = json.dumps({"t": round(wall_time, 6), **fields}) + "\n"
        try:
            os.write(self._fd, line.encode())
        except OSError as error:  # a full disk must not stop training
            log.warning("spans file write failed (%s); no more spans from this worker", error)
            self._fd = None


def span_path(run_dir: str | Path, role: str, rank: int) -> Path:
    return Path(run_dir) / "spans" / f"{role}-{rank}.jsonl"


@dataclass(frozen=True)
class Span:
    start: float
    end: float
    state: str
    """"busy" or the idle reason."""


def read_spans(path: Path, until: float) -> list[Span]:
    """The worker's spans in time order; the state it was in when the file ends lasts until `until`
    (the worker was still running), a state cut by a restart ends where it was last seen."""
    spans: list[Span] = []
    current: tuple[float, str] | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        at, state = entry["t"], entry.get("state")
        if current is not None and (state is not None or entry.get("event") == "start"):
            end = at if state is not None else current[0]
            if end > current[0] and current[1] != END:
                spans.append(Span(current[0], end, current[1]))
            current = None
        if state is not None:
            current = (at, state)
    if current is not None and current[1] != END and until > current[0]:
        spans.append(Span(current[0], until, current[1]))
    return spans


def worker_files(run_dir: Path) -> dict[tuple[str, int], Path]:
    """(role, rank) -> spans file of every worker that wrote one."""
    found = {}
    for path in sorted((run_dir / "spans").glob("*-*.jsonl")):
        role, _, rank = path.stem.rpartition("-")
        if rank.isdigit():
            found[(role, int(rank))] = path
    return found


def _count_starts(path: Path) -> int:
    try:
        with open(path, "rb") as handle:
            return sum(1 for line in handle if b'"event": "start"' in line)
    except OSError:
        return 0
