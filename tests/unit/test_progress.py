"""`rlfleet run`'s progress lines: each step printed once, also across a resume that rewrites metrics.jsonl."""

from __future__ import annotations

import io
import json

from rlfleet.workers.local import ProgressPrinter


def _line(step: int, seconds: float = 1.0) -> str:
    return json.dumps({"step": step, "reward_mean": 0.5, "max_staleness": 0, "tokens_generated": 10,
                       "step_seconds": seconds, "samples_dropped_stale": 0}) + "\n"


def _printed_steps(out: io.StringIO) -> list[int]:
    return [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()]


def test_a_resumed_run_prints_only_its_own_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_line(s) for s in range(1, 8)))  # the killed run got to step 7
    out = io.StringIO()
    printer = ProgressPrinter(path, 10, out)
    printer.poll()
    assert _printed_steps(out) == []
    # The resume from the step-5 checkpoint rewrites the file, then trains steps 6.. again.
    rewritten = tmp_path / "metrics.jsonl.tmp"
    rewritten.write_text("".join(_line(s) for s in range(1, 6)))
    rewritten.replace(path)
    printer.poll()
    with open(path, "a") as handle:
        handle.write(_line(6, seconds=2.0) + _line(7, seconds=2.0)[:10])  # the second line is half written
    printer.poll()
    with open(path, "a") as handle:
        handle.write(_line(7, seconds=2.0)[10:])
    printer.poll()
    assert _printed_steps(out) == [6, 7]
