"""A finished (or running) run directory read back: its steps, each worker's spans, and bubble ratios.

Pure file reading and arithmetic; the pictures are drawn elsewhere. Everything is measured over the
loop window: from trainer rank 0 leaving `starting` (model loaded, generators joined) to its last
span, so engine start-up does not count and a sync and an async run compare like for like.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.workers.metrics.clock import BUSY, STARTING
from rlfleet.workers.metrics.spans import Span, read_spans, worker_files

CONTROLLER = ("trainer", 0)


@dataclass
class Run:
    name: str
    path: Path
    steps: list[dict]
    """metrics.jsonl, one record per trainer step."""
    spans: dict[tuple[str, int], list[Span]] = field(default_factory=dict)
    """(role, rank) -> spans clipped to the loop window."""
    start: float = 0.0
    end: float = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start


def load_run(path: Path) -> Run:
    steps = _read_steps(path / "metrics.jsonl")
    run = Run(path.name, path, steps)
    files = worker_files(path)
    if CONTROLLER not in files:
        return run
    controller = read_spans(files[CONTROLLER], until=time.time())
    looping = [s for s in controller if s.state != STARTING]
    if not looping:
        return run
    run.start, run.end = looping[0].start, controller[-1].end
    for worker, file in files.items():
        run.spans[worker] = clip(read_spans(file, until=run.end), run.start, run.end)
    return run


def clip(spans: list[Span], start: float, end: float) -> list[Span]:
    return [Span(max(s.start, start), min(s.end, end), s.state) for s in spans if s.end > start and s.start < end]


@dataclass(frozen=True)
class Bubble:
    busy: float
    idle: dict[str, float]
    """Idle seconds by reason."""

    @property
    def ratio(self) -> float:
        """idle / (idle + busy); 0 when nothing was recorded."""
        idle = sum(self.idle.values())
        return idle / (idle + self.busy) if idle + self.busy > 0 else 0.0


def bubbles(run: Run, after: float | None = None) -> dict[str, Bubble]:
    """Per executor (role), summed over its ranks, within the loop window (from `after` if given)."""
    busy: dict[str, float] = defaultdict(float)
    idle: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (role, _rank), spans in sorted(run.spans.items()):
        for span in clip(spans, after or run.start, run.end):
            if span.state == BUSY:
                busy[role] += span.end - span.start
            else:
                idle[role][span.state] += span.end - span.start
    return {role: Bubble(busy[role], dict(idle[role])) for role in sorted(set(busy) | set(idle))}


def evaluations(run: Run) -> list[dict]:
    """The step records that carry a held-out evaluation's result (evaluation in the loop)."""
    return [r for r in run.steps if "eval_policy_version" in r]


def held_out_key(scored: list[dict]) -> str:
    """What evaluations are compared by, as the best checkpoint is chosen: the accuracy where a scorer grades
    answers, else the mean reward (a job of format or python scorers only)."""
    return "eval_accuracy" if all("eval_accuracy" in r for r in scored) else "eval_reward_mean"


def _read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line being written right now
    return records

