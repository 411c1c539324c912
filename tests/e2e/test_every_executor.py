"""The example job with every executor kind runs locally: a reference (KL), a learned reward model and a critic
(GAE, PPO) beside the generator, scorer and trainer, each in its own process, each doing its part every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlfleet.workers.executors import ROLES
from rlfleet.workers.report.runs import bubbles, load_run
from rlfleet.workers.reward_model.toy import train_digit_preference

from runs import metrics, rlfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-every-executor.yaml"
STEPS = 20


def test_the_job_with_every_executor_runs(tmp_path, model_cache):
    reward_dir = tmp_path / "toy-reward-model"
    assert train_digit_preference(reward_dir) >= 0.95
    job = yaml.safe_load(EXAMPLE.read_text())
    assert job["spec"]["roles"]["rewardModel"]["path"] == "runs/toy-reward-model"  # what the README's command makes
    job["spec"]["roles"]["rewardModel"]["path"] = str(reward_dir)
    job["spec"]["algorithm"]["steps"] = STEPS
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    result = rlfleet("run", str(path), "--out", str(run_dir), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:  # the reference, the reward model and the critic took part in every step
        assert row["kl_mean"] >= 0 and row["scorer_errors"] == 0
        assert row["reward_mean"] >= row["reward_model_mean"] - 1e-6  # math_answer + the model's score
        assert row["critic_version"] == row["step"] and row["optimizer_steps"] == 4
    found = bubbles(load_run(run_dir))
    assert set(found) == set(ROLES)
    for role in ROLES:
        assert found[role].busy > 0, f"{role} never worked"
