"""The example job with every executor kind runs locally: a reference (KL), a learned reward model, a critic (GAE,
PPO) and an environment beside the generator, scorer and trainer, each in its own process, each doing its part every
step."""

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
    """As its header says to run it: the reward model made first at the relative path the job names, both commands
    run from one directory (the workers, started in the run directory, must find it too)."""
    assert train_digit_preference(tmp_path / "runs" / "toy-reward-model") >= 0.95
    job = yaml.safe_load(EXAMPLE.read_text())
    assert job["spec"]["roles"]["rewardModel"]["path"] == "runs/toy-reward-model"  # what the header's command makes
    assert job["spec"]["algorithm"]["kl"] == {"coef": 0.05, "estimator": "k3", "use": "loss"}
    assert job["spec"]["roles"]["reference"]["updateEverySteps"] == 0  # a frozen reference: the initial policy
    job["spec"]["algorithm"]["steps"] = STEPS
    # The header's commands run from the repository: here the environment's file is named from it.
    environment = job["spec"]["roles"]["environment"]
    environment["path"] = str(EXAMPLE.parents[2] / environment["path"])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = rlfleet("run", "job.yaml", "--out", "runs/every-executor", timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rows = metrics(tmp_path / "runs" / "every-executor")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:  # the reward model and the critic took part in every step
        assert row["scorer_errors"] == 0
        assert row["reward_mean"] >= row["reward_model_mean"] - 1e-6  # math_answer + the model's score
        assert row["critic_version"] == row["step"] and row["optimizer_steps"] == 4
        assert row["turns_mean"] >= 1 and row["environment_errors"] == 0  # every rollout an episode
    # The reference took part too: KL(pi || pi_ref) starts near 0 (the policy starts as the reference) and grows as
    # the policy leaves it (k3 is never negative, so a bare sign check could not fail). Sums over the last and first
    # five steps: 9.3 and 0.35 here; 0.30 and 0.17 with a reference that follows the policy (updateEverySteps: 1).
    kl = [row["kl_mean"] for row in rows]
    assert kl[0] < 0.5 and sum(kl[-5:]) > 4 * sum(kl[:5]), kl
    found = bubbles(load_run(tmp_path / "runs" / "every-executor"))
    assert set(found) == set(ROLES)
    for role in ROLES:
        assert found[role].busy > 0, f"{role} never worked"
