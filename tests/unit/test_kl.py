"""The KL estimators against their formulas in plain floats: value, gradient in log pi, the loss and the reward
penalty forms; and, on a small softmax, the exact expected gradient of each form against that of the KL itself."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from rlfleet.workers.rl.config import KlPenalty
from rlfleet.workers.rl.kl import MAX_KL_LOG_RATIO, kl_estimate, kl_loss, kl_penalties
from rlfleet.workers.rl.losses import aipo_loss

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
    # mu = pi (on-policy): weight 1, the plain formula
    loss, mean = kl_loss(logprobs, logprobs.detach(), torch.tensor(ref, dtype=torch.float64), torch.tensor(MASK),
                         estimator, coef, normalizer)
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
    loss, mean = kl_loss(logprobs, logprobs.detach(), ref, torch.ones(1, 2), "k3", 1.0)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(mean) and torch.isfinite(logprobs.grad).all()
    assert_close(mean, (math.exp(-MAX_KL_LOG_RATIO) - 1 + MAX_KL_LOG_RATIO) / 2)


def test_padding_and_an_empty_mask_add_nothing():
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    loss, mean = kl_loss(logprobs, torch.tensor([[-1.0, float("nan")]]), torch.tensor([[-2.0, 0.0]]),
                         torch.tensor([[1, 0]]), "k2", 1.0)
    loss.backward()
    assert_close(loss.item(), 0.5)
    empty, empty_mean = kl_loss(logprobs, torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), "k3", 1.0)
    assert empty.item() == 0.0 and empty_mean == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reward_penalty_is_the_coefficient_times_the_completions_summed_estimate(estimator):
    mu, ref = [[-0.2, -1.0, -0.7], [-2.0]], [[-0.5, -0.9, -0.1], [-1.0]]
    found = kl_penalties(mu, ref, estimator, 0.05)
    expected = [0.05 * sum(_plain(m - r, estimator)[0] for m, r in zip(a, b)) for a, b in zip(mu, ref)]
    assert_close(found, expected)
    with pytest.raises(ValueError, match="2 reference logprobs for 3"):
        kl_penalties([[-1.0, -1.0, -1.0]], [[-1.0, -1.0]], estimator, 1.0)


# A categorical over a few outcomes: the policy pi = softmax(theta), a stale sampler mu and the reference.
LOGITS = {"pi": [0.3, -1.2, 0.8, 0.0, -0.4], "mu": [0.9, -0.7, 0.1, 0.2, -1.0], "ref": [-0.5, 0.4, 1.1, -0.3, 0.2]}


def _softmax_case() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    theta = torch.tensor(LOGITS["pi"], dtype=torch.float64, requires_grad=True)
    mu, ref = (torch.log_softmax(torch.tensor(LOGITS[k], dtype=torch.float64), 0) for k in ("mu", "ref"))
    return theta, torch.log_softmax(theta, 0), mu, ref


def _exact_kl_gradients() -> dict[str, Tensor]:
    """The gradients in theta of KL(pi || pi_ref) and KL(pi_ref || pi), by autograd on the sums over outcomes."""
    theta, log_pi, _, ref = _softmax_case()
    forward = (log_pi.exp() * (log_pi - ref)).sum()
    reverse = (ref.exp() * (ref - log_pi)).sum()
    return {"forward": torch.autograd.grad(forward, theta, retain_graph=True)[0],
            "reverse": torch.autograd.grad(reverse, theta)[0]}


def _expected_loss_gradient(estimator: str, sampler: str) -> Tensor:
    """E_{y ~ sampler}[grad of kl_loss on the one token y], every outcome enumerated and weighted by its probability
    (no sampling, so the expectation is exact)."""
    theta, log_pi, mu, ref = _softmax_case()
    log_mu = log_pi.detach() if sampler == "pi" else mu
    one = torch.ones(1, 1)
    expected = sum(log_mu[y].exp() * kl_loss(log_pi[y].view(1, 1), log_mu[y].view(1, 1), ref[y].view(1, 1), one,
                                             estimator, 1.0)[0] for y in range(len(LOGITS["pi"])))
    return torch.autograd.grad(expected, theta)[0]


@pytest.mark.parametrize("sampler", ["pi", "mu"])
def test_each_estimator_as_a_loss_has_the_expected_gradient_the_readme_gives(sampler):
    exact = _exact_kl_gradients()
    assert_close(_expected_loss_gradient("k2", sampler), exact["forward"])
    assert_close(_expected_loss_gradient("k3", sampler), exact["reverse"])
    assert_close(_expected_loss_gradient("k1", sampler), torch.zeros(len(LOGITS["pi"]), dtype=torch.float64))
    assert not torch.allclose(exact["forward"], exact["reverse"])  # the case tells the two KLs apart


def _expected_reward_gradient(estimator: str) -> Tensor:
    """On-policy E_{y ~ pi}[grad of the policy loss whose advantage is minus the token's penalty]."""
    theta, log_pi, _, ref = _softmax_case()
    expected = 0.0
    for y in range(len(LOGITS["pi"])):
        lp = log_pi[y].view(1, 1)
        penalty = kl_penalties([[lp.item()]], [[ref[y].item()]], estimator, 1.0)[0]
        expected = expected + lp.exp().detach() * aipo_loss(lp, lp.detach(), torch.tensor([-penalty]),
                                                            torch.ones(1, 1), 2.0)[0]
    return torch.autograd.grad(expected, theta)[0]


def test_only_k1_as_a_reward_penalty_follows_the_gradient_of_the_kl():
    exact = _exact_kl_gradients()["forward"]
    assert_close(_expected_reward_gradient("k1"), exact)
    for estimator in ("k2", "k3"):
        assert not torch.allclose(_expected_reward_gradient(estimator), exact)


@pytest.mark.parametrize(("estimator", "use"), [("k1", "loss"), ("k2", "reward"), ("k3", "reward")])
def test_the_spec_refuses_a_kl_whose_gradient_is_not_a_kls(estimator, use):
    with pytest.raises(ValueError, match=f"estimator {estimator} with use {use}"):
        KlPenalty(coef=0.1, estimator=estimator, use=use)
    KlPenalty(coef=0.0, estimator=estimator, use=use)  # measuring only: kl_mean, nothing acts on it
