"""metrics.jsonl and prompts.jsonl on a resume: each step appears once."""

from __future__ import annotations

import json

from rlfleet.workers.controller.record import METRICS_FILE, append_metrics, keep_lines_until


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    for step in range(1, 8):
        append_metrics(tmp_path, {"step": step, "reward_mean": 0.0, "max_staleness": 0})
    keep_lines_until(tmp_path / METRICS_FILE, 5)
    assert _steps(tmp_path / METRICS_FILE) == [1, 2, 3, 4, 5]
    append_metrics(tmp_path, {"step": 6, "reward_mean": 0.0, "max_staleness": 0})
    assert _steps(tmp_path / METRICS_FILE) == [1, 2, 3, 4, 5, 6]


def test_resume_from_scratch_empties_the_file_and_a_missing_file_is_fine(tmp_path):
    keep_lines_until(tmp_path / METRICS_FILE, 0)
    assert not (tmp_path / METRICS_FILE).exists()
    append_metrics(tmp_path, {"step": 1, "reward_mean": 0.0, "max_staleness": 0})
    keep_lines_until(tmp_path / METRICS_FILE, 0)
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_a_line_torn_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "prom')
    keep_lines_until(path, 5)
    assert _steps(path) == [1, 2]
