"""The chaos bench's verdict: each kind of damage a run directory can show is reported, a clean one passes."""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

import pytest

from rlfleet.benchmarks.chaos import (Faults, Leg, check, critic_off, final_job, last_checkpoint_step, next_step_seconds,
                                      step_records, trained_since, under_fault)
from rlfleet.workers.executors import ROLES
from rlfleet.workers.sync.checksum import MIXED, VERIFIED


def _run_dir(tmp_path: Path, steps=(1, 2, 3), prompts=range(6), outcome="trained", pushes=(VERIFIED,),
             critic=lambda step: step, staleness=(0, 1, 1)) -> Path:
    """A run directory of a job with a critic and maxStaleness 1; `critic` gives each step's critic version."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"spec": {"algorithm": {"maxStaleness": 1}}}))
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "time": float(s), "policy_version": s, "samples_trained": 4,
                    "critic_version": float(critic(s)), "max_trained_staleness": stale}) + "\n"
        for s, stale in zip(steps, itertools.cycle(staleness))))
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": p, "step": p // 2 + 1, "outcome": outcome, "samples_trained": 2}) + "\n"
        for p in prompts))
    (tmp_path / "logs" / "job-generator-0.log").write_text("".join(f"INFO push {line}\n" for line in pushes))
    return tmp_path


def test_a_clean_run_passes(tmp_path):
    assert check(_run_dir(tmp_path), 3) == []


def test_a_step_that_sent_the_critic_nothing_does_not_count_against_it():
    records = [{"step": 1, "critic_version": 1.0}, {"step": 2}, {"step": 3, "critic_version": 2.0}]
    assert critic_off(records) == []
    assert critic_off(records[:2] + [{"step": 3, "critic_version": 3.0}]) == [3]


@pytest.mark.parametrize("damage, expected", [
    ({"steps": (1, 2, 2, 3)}, "trained twice"),
    ({"steps": (1, 3)}, "a step was lost"),
    ({"prompts": [0, 1, 2, 3, 5, 6]}, "every prompt handed out exactly once"),
    ({"prompts": [0, 1, 2, 2, 3, 4]}, "every prompt handed out exactly once"),
    ({"outcome": "vanished"}, "not a counted one"),
    ({"pushes": (VERIFIED, MIXED)}, "content other than what the trainers sent"),
    ({"pushes": ()}, "no push was checked by content"),
    # A critic restarted from its checkpoint (version 2) while the policy went on from step 3.
    ({"critic": lambda step: min(step, 2)}, "critic's version is not the step at steps 3"),
    ({"staleness": (0, 2, 1)}, "staler than maxStaleness (1) trained at steps 2"),
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


def test_every_round_hits_each_kind_once_and_the_trainer_last(monkeypatch):
    """The trainer's death pauses the faults until the run trains again, so it ends a round: the others are hit
    first even in a short run."""
    monkeypatch.setattr(os, "kill", lambda pid, signum: None)
    faults = Faults(random.Random(3), every=1.0)
    workers = {pid: role for pid, role in enumerate(ROLES)}
    hit = []
    for _ in range(3 * len(ROLES)):
        hit.append(faults.inject(workers))
        faults.continue_due(everything=True)  # a stopped worker is no candidate until continued
    for start in range(0, len(hit), len(ROLES)):
        assert sorted(hit[start:start + len(ROLES)]) == sorted(ROLES) and hit[start + len(ROLES) - 1] == "trainer"
    assert sum(faults.counts.values()) == len(faults.times) == len(hit)


def test_steps_under_fault_and_the_wait_for_a_step_after_each_fault():
    faults = Faults(random.Random(0), every=1.0, times=[(10.0, "critic"), (20.0, "trainer"), (35.0, "scorer")])
    steps = [5.0, 12.0, 18.0, 30.0, 40.0, 50.0]
    assert next_step_seconds(faults, steps) == {"critic": [2.0], "trainer": [10.0], "scorer": [5.0]}
    assert under_fault(faults, Leg(ended=45.0), steps) == 4  # 12, 18, 30 and 40: not 5 (before), not 50 (after)


def test_a_resumed_run_counts_steps_by_their_time_not_their_lines(tmp_path):
    """A resume cuts metrics.jsonl back to its checkpoint: older lines stay, and one half written is not read."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "time": 100.0}) + "\n" + '{"step": 6, "ti')
    assert [r["step"] for r in step_records(tmp_path)] == [5]
    assert trained_since(tmp_path, 99.0) and not trained_since(tmp_path, 100.0)
