"""PPO with a critic, end to end: the critic executor values every completion token, GAE makes per-token advantages,
and both the policy (PPO, two epochs of two mini-batches) and the critic learn; a resumed run restores the critic, to
step 0 too (the base critic) when the trainer starts over; a critic killed mid-run is restored in place.

The reward is a property the tiny policy can learn fast and its critic can predict (a completion with a 7 in it
scores 1): the reward rises from rare to nearly always, and the value loss, after rising with the rewards, falls as
the values catch up. A critic that does not learn keeps its values at 0 and a loss of 0.5 x reward^2."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from runs import metrics, rlfleet, start_rlfleet, stop, wait_for

from rlfleet.benchmarks.chaos import workers_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-critic-ppo.yaml"
FIRST, TOTAL, WINDOW = 30, 40, 5


def _job(tmp_path: Path, steps: int) -> Path:
    job = yaml.safe_load(EXAMPLE.read_text())
    job["spec"]["scorers"] = [{"type": "regex_format", "pattern": "(?s).*7.*", "weight": 1.0}]
    job["spec"]["algorithm"]["steps"] = steps
    job["spec"]["checkpoint"] = {"everySteps": 10, "keep": 2}
    path = tmp_path / f"ppo-{steps}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_ppo_with_a_critic_learns_and_the_critic_resumes(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    first = rlfleet("run", str(_job(tmp_path, FIRST)), "--out", str(run_dir))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["critic_version"] for r in rows] == list(range(1, FIRST + 1))  # one critic update a step
    assert {r["optimizer_steps"] for r in rows} == {4.0}  # 2 epochs x 2 mini-batches
    early, late = rows[:WINDOW], rows[FIRST - WINDOW:]
    assert _mean(late, "reward_mean") > _mean(early, "reward_mean") + 0.5, [r["reward_mean"] for r in rows]
    peak = max(r["value_loss"] for r in rows)
    assert _mean(late, "value_loss") < peak / 5, [r["value_loss"] for r in rows]
    assert _mean(late, "value_mean") > 0.5 * _mean(late, "reward_mean")  # the values learned the returns

    # Resumed, and its critic killed mid-run: it comes back from its checkpoint of step FIRST, behind the batches
    # sent since, and the controller restores it and sends them again; nothing else restarts.
    resumed = start_rlfleet("run", "--resume", str(run_dir), str(_job(tmp_path, TOTAL)))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").read_text().count("\n") >= FIRST + 2, 600, "two resumed steps")
        (critic,) = [pid for pid, role in workers_of(resumed.pid).items() if role == "critic"]
        assert os.getpgid(critic) == critic, "each worker leads a process group of its own"
        os.killpg(critic, signal.SIGKILL)  # the critic pod's process and both its ranks
        output, _ = resumed.communicate(timeout=600)
    finally:
        stop(resumed)
    assert resumed.returncode == 0, output[-3000:]
    assert re.findall(r"worker (\S+) exited with code -9; restarting", output) == ["tiny-critic-ppo-critic-0"], output
    log = (run_dir / "logs" / "tiny-critic-ppo-trainer-0.log").read_text()
    assert f"critic restored to step {FIRST} (version {FIRST})" in log
    assert "the critic is restored and learned again steps" in log
    after = metrics(run_dir)[FIRST:]
    assert [r["critic_version"] for r in after] == list(range(FIRST + 1, TOTAL + 1)), "one critic update a batch"
    assert [r["step"] for r in after] == list(range(FIRST + 1, TOTAL + 1))
    # A critic started afresh would value every token 0 against rewards near 1: a loss near 0.5.
    assert after[0]["value_loss"] < peak / 5 and after[0]["critic_version"] == FIRST + 1

    # A trainer without a checkpoint (one that died before its first) starts from the base policy; the critic, which
    # has checkpoints of its own, must start from the base critic.
    shutil.rmtree(run_dir / "checkpoints")
    over = rlfleet("run", "--resume", str(run_dir), str(_job(tmp_path, 2)))
    assert over.returncode == 0, over.stdout[-3000:] + over.stderr[-3000:]
    assert [r["critic_version"] for r in metrics(run_dir)] == [1, 2]  # not TOTAL + 1: it learned nothing before
