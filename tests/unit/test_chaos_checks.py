"""The chaos bench's verdict: each kind of damage a run directory can show is reported, a clean one passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.benchmarks.chaos import check, final_job, last_checkpoint_step
from rlfleet.workers.sync.checksum import MIXED, VERIFIED


def _run_dir(tmp_path: Path, steps=(1, 2, 3), prompts=range(6), outcome="trained", pushes=(VERIFIED,)) -> Path:
    (tmp_path / "logs").mkdir()
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "policy_version": s, "samples_trained": 4}) + "\n" for s in steps))
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": p, "step": p // 2 + 1, "outcome": outcome, "samples_trained": 2}) + "\n"
        for p in prompts))
    (tmp_path / "logs" / "job-generator-0.log").write_text("".join(f"INFO push {line}\n" for line in pushes))
    return tmp_path


def test_a_clean_run_passes(tmp_path):
    assert check(_run_dir(tmp_path), 3) == []


@pytest.mark.parametrize("damage, expected", [
    ({"steps": (1, 2, 2, 3)}, "trained twice"),
    ({"steps": (1, 3)}, "a step was lost"),
    ({"prompts": [0, 1, 2, 3, 5, 6]}, "every prompt handed out exactly once"),
    ({"prompts": [0, 1, 2, 2, 3, 4]}, "every prompt handed out exactly once"),
    ({"outcome": "vanished"}, "not a counted one"),
    ({"pushes": (VERIFIED, MIXED)}, "content other than what the trainers sent"),
    ({"pushes": ()}, "no push was checked by content"),
])
def test_each_kind_of_damage_is_reported(damage, expected, tmp_path):
    problems = check(_run_dir(tmp_path, **damage), 3)
    assert any(expected in problem for problem in problems), problems


def test_the_last_leg_ends_a_few_steps_past_the_last_checkpoint(tmp_path):
    for step in (5, 10):
        (tmp_path / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step-{step:06d}" / "state.json").write_text(json.dumps({"step": step}))
    (tmp_path / "checkpoints" / "step-000015.tmp").mkdir()  # a torn write is no checkpoint
    (tmp_path / "checkpoints" / "step-000020").mkdir()  # nor one whose state was never written
    job = tmp_path / "chaos-job.json"
    job.write_text(json.dumps({"spec": {"algorithm": {"steps": 10**7}}}))
    path, steps = final_job(job, tmp_path)
    assert last_checkpoint_step(tmp_path) == 10 and steps == 15
    assert json.loads(path.read_text())["spec"]["algorithm"]["steps"] == 15
