"""The KL estimators against their formulas in plain floats: value, gradient in log pi, the loss and the reward
penalty forms."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.testing import assert_close

from rlfleet.workers.rl.kl import MAX_KL_LOG_RATIO, kl_estimate, kl_loss, kl_penalties

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def _plain(d: float, estimator: str) -> tuple[float, float]:
    """The estimate of one token and its derivative in log pi (d = log pi - log pi_ref)."""
    if estimator == "k1":
        return d, 1.0
    if estimator == "k2":
        return 0.5 * d * d, d
    return math.exp(-d) - 1 + d, 1 - math.exp(-d)


def _logprobs(seed: int) -> tuple[list[list[float]], list[list[float]]]:
    rng = random.Random(seed)
    pi = [[-rng.uniform(0.05, 3.0) for _ in row] for row in MASK]
    ref = [[lp - rng.uniform(-1.5, 1.5) for lp in row] for row in pi]
    return pi, ref


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_loss_and_its_gradient_match_the_formula(estimator, seed):
    pi, ref = _logprobs(seed)
    coef, normalizer = 0.3, 11.0
    logprobs = torch.tensor(pi, dtype=torch.float64, requires_grad=True)
    loss, mean = kl_loss(logprobs, torch.tensor(ref, dtype=torch.float64), torch.tensor(MASK), estimator, coef,
                         normalizer)
    loss.backward()
    tokens = [(b, t) for b, row in enumerate(MASK) for t, on in enumerate(row) if on]
    values = {bt: _plain(pi[bt[0]][bt[1]] - ref[bt[0]][bt[1]], estimator) for bt in tokens}
    assert_close(loss.item(), coef * sum(v for v, _ in values.values()) / normalizer)
    assert_close(mean, sum(v for v, _ in values.values()) / len(tokens))
    expected = [[coef * values[(b, t)][1] / normalizer if on else 0.0 for t, on in enumerate(row)]
                for b, row in enumerate(MASK)]
    assert_close(logprobs.grad, torch.tensor(expected, dtype=torch.float64))


def test_k3_is_never_negative_and_zero_only_at_equal_policies():
    d = torch.tensor([-5.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 5.0], dtype=torch.float64)
    k3 = kl_estimate(d, torch.zeros_like(d), "k3")
    assert k3[3].item() == 0.0
    assert (k3[:3] > 0).all() and (k3[4:] > 0).all()


def test_a_token_outside_the_references_nucleus_costs_a_bounded_penalty():
    logprobs = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-float("inf"), -0.5]])
    loss, mean = kl_loss(logprobs, ref, torch.ones(1, 2), "k3", 1.0)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(mean) and torch.isfinite(logprobs.grad).all()
    assert_close(mean, (math.exp(-MAX_KL_LOG_RATIO) - 1 + MAX_KL_LOG_RATIO) / 2)


def test_padding_and_an_empty_mask_add_nothing():
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    loss, mean = kl_loss(logprobs, torch.tensor([[-2.0, 0.0]]), torch.tensor([[1, 0]]), "k2", 1.0)
    loss.backward()
    assert_close(loss.item(), 0.5)
    empty, empty_mean = kl_loss(logprobs, torch.zeros(1, 2), torch.zeros(1, 2), "k3", 1.0)
    assert empty.item() == 0.0 and empty_mean == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reward_penalty_is_the_coefficient_times_the_completions_summed_estimate(estimator):
    mu, ref = [[-0.2, -1.0, -0.7], [-2.0]], [[-0.5, -0.9, -0.1], [-1.0]]
    found = kl_penalties(mu, ref, estimator, 0.05)
    expected = [0.05 * sum(_plain(m - r, estimator)[0] for m, r in zip(a, b)) for a, b in zip(mu, ref)]
    assert_close(found, expected)
    with pytest.raises(ValueError, match="2 reference logprobs for 3"):
        kl_penalties([[-1.0, -1.0, -1.0]], [[-1.0, -1.0]], estimator, 1.0)
