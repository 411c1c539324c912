"""Every advantage estimator against its formula written with plain floats, and the controller using the job's."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from torch.testing import assert_close

from rlfleet.workers.controller.rollouts import Rollout, set_advantages
from rlfleet.workers.rl.advantages import STD_EPS, advantages


def reference(kind: str, rewards: list[float], groups: list[int]) -> list[float]:
    members = {g: [r for r, h in zip(rewards, groups) if h == g] for g in set(groups)}
    centred = [r - statistics.fmean(members[g]) for r, g in zip(rewards, groups)]
    if kind == "group_mean":
        return centred
    if kind == "group_mean_std":
        return [c / ((statistics.stdev(members[g]) if len(members[g]) > 1 else 0.0) + STD_EPS)
                for c, g in zip(centred, groups)]
    if kind == "rloo":
        return [r - (sum(members[g]) - r) / (len(members[g]) - 1) if len(members[g]) > 1 else 0.0
                for r, g in zip(rewards, groups)]
    return [c / (statistics.stdev(centred) + STD_EPS) for c in centred]  # reinforce_pp


KINDS = ["group_mean", "group_mean_std", "rloo", "reinforce_pp"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(4))
def test_each_estimator_matches_its_formula(kind, seed):
    rng = random.Random(seed)
    groups = [g for g in range(5) for _ in range(rng.randint(1, 6))]
    rewards = [rng.choice([0.0, 0.1, 1.0, 1.1]) + rng.random() * (seed % 2) for _ in groups]
    found = advantages(kind, torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups))
    assert_close(found, torch.tensor(reference(kind, rewards, groups), dtype=torch.float64))


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_of_equal_rewards_has_exactly_zero_advantage(kind):
    found = advantages(kind, torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0]), torch.tensor([7, 7, 7, 3, 3]))
    assert found[:3].tolist() == [0.0, 0.0, 0.0] and all(math.isfinite(a) for a in found.tolist())


def test_rloo_is_the_leave_one_out_baseline():
    found = advantages("rloo", torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]))
    assert found.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_the_controller_uses_the_jobs_estimator():
    rollouts = [Rollout(sample_id=str(i), prompt=i // 2, prompt_ids=[1], answer="", reward=float(i % 3 == 0))
                for i in range(6)]
    set_advantages(rollouts, "group_mean_std")
    expected = advantages("group_mean_std", torch.tensor([r.reward for r in rollouts], dtype=torch.float64),
                          torch.tensor([r.prompt for r in rollouts]))
    assert [r.advantage for r in rollouts] == pytest.approx(expected.tolist())
    assert [r.advantage for r in rollouts] != pytest.approx([r.reward - 0.5 for r in rollouts])
