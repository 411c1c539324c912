"""The local runtime's watch: a trainer rank that exits cleanly at the end is not a dead worker, even when it
exits before rank 0's process (rank 0 still shutting its trackers and servers down); one that fails is."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from rlfleet.workers.local import Child, WorkerDied, watch
from rlfleet.workers.plan import Worker


class Process:
    """Running for `polls` polls, then exited with `code`."""

    def __init__(self, code: int, polls: int = 0):
        self.code, self.polls, self.returncode = code, polls, None

    def poll(self) -> int | None:
        if self.polls > 0:
            self.polls -= 1
            return None
        self.returncode = self.code
        return self.code


def child(role: str, rank: int, process: Process, tmp_path: Path) -> Child:
    log = tmp_path / f"{role}-{rank}.log"
    log.write_text("last line\n")
    return Child(Worker(role, rank, f"t-{role}-{rank}", [], {}, {"metrics": 1}), process, log)


def test_a_follower_trainer_that_exits_cleanly_before_rank_0_ends_nothing(tmp_path):
    children = [child("trainer", 0, Process(0, polls=2), tmp_path), child("trainer", 1, Process(0), tmp_path),
                child("generator", 0, Process(0, polls=10**6), tmp_path)]
    watch(children, tmp_path, total_steps=1, max_restarts=0, out=io.StringIO())


def test_a_follower_trainer_that_fails_fails_the_run(tmp_path):
    children = [child("trainer", 0, Process(0, polls=10**6), tmp_path), child("trainer", 1, Process(1), tmp_path)]
    with pytest.raises(WorkerDied, match="t-trainer-1 exited with code 1"):
        watch(children, tmp_path, total_steps=1, max_restarts=0, out=io.StringIO())
