"""KL towards the reference executor keeps the policy near the reference: the built-in job with a frozen reference,
trained with and without a large KL coefficient (as a loss term and as a reward penalty), side by side.

The reference's own log pi_ref is what the trainer's kl_mean compares with, so the runs also show the whole path:
weights pushed to the reference at the start, log pi_ref of every completion, the KL in the trainer's loss."""

from __future__ import annotations

import pytest

from runs import job_file, metrics, rlfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 40
WINDOW = 10


def _late_kl(tmp_path, name: str, kl: dict) -> float:
    """Mean kl_mean of the run's last WINDOW steps."""
    job = job_file(tmp_path, name, roles={"reference": {"replicas": 1}}, steps=STEPS, kl=kl,
                   checkpoint={"everySteps": 100}, spec={"evaluation": {"everySteps": 0}})
    run = rlfleet("run", str(job), "--out", str(tmp_path / name))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = metrics(tmp_path / name)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return sum(r["kl_mean"] for r in rows[-WINDOW:]) / WINDOW


def test_a_large_kl_coefficient_keeps_the_policy_near_the_reference(tmp_path):
    free = _late_kl(tmp_path, "kl-free", {"coef": 0.0})
    as_loss = _late_kl(tmp_path, "kl-loss", {"coef": 1.0, "estimator": "k3", "use": "loss"})
    as_reward = _late_kl(tmp_path, "kl-reward", {"coef": 1.0, "estimator": "k1", "use": "reward"})
    # Measured here: free ~0.26 nats a token after 40 steps, the KL loss ~0.004.
    assert free > 0.02, f"the unregularised policy did not move from the reference (kl {free:.4f})"
    assert as_loss < free / 4, f"kl {as_loss:.4f} with the KL loss, {free:.4f} without"
    assert as_reward < free / 2, f"kl {as_reward:.4f} with the KL reward penalty, {free:.4f} without"
