"""metrics.jsonl on a resume: each step appears once."""

from __future__ import annotations

import json

from rlfleet.workers.controller.record import append_metrics, keep_metrics_until


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    for step in range(1, 8):
        append_metrics(tmp_path, {"step": step, "reward_mean": 0.0, "max_staleness": 0})
    keep_metrics_until(tmp_path, 5)
    assert _steps(tmp_path) == [1, 2, 3, 4, 5]
    append_metrics(tmp_path, {"step": 6, "reward_mean": 0.0, "max_staleness": 0})
    assert _steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_resume_from_scratch_empties_the_file_and_a_missing_file_is_fine(tmp_path):
    keep_metrics_until(tmp_path, 0)
    assert not (tmp_path / "metrics.jsonl").exists()
    append_metrics(tmp_path, {"step": 1, "reward_mean": 0.0, "max_staleness": 0})
    keep_metrics_until(tmp_path, 0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
