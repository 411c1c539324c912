"""AIPO loss and group advantages against a per-token reference written with plain floats."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlfleet.workers.rl.advantages import group_advantages
from rlfleet.workers.rl.losses import MAX_LOG_RATIO, aipo_loss


def reference(logprobs, gen_logprobs, advantages, mask, rho, normalizer=None):
    """Loss, analytic gradient d loss / d logprobs, and metrics, one token at a time."""
    tokens = [(b, t) for b in range(len(mask)) for t in range(len(mask[b])) if mask[b][t]]
    n = len(tokens)
    norm = max(normalizer if normalizer is not None else n, 1)
    loss, grad = 0.0, [[0.0] * len(row) for row in mask]
    ratios = []
    for b, t in tokens:
        ratio = math.exp(min(logprobs[b][t] - gen_logprobs[b][t], MAX_LOG_RATIO))
        ratios.append(ratio)
        w = min(ratio, rho)
        loss -= w * advantages[b] * logprobs[b][t] / norm
        grad[b][t] = -w * advantages[b] / norm
    metrics = {
        "clip_fraction": sum(r > rho for r in ratios) / n,
        "ess": sum(ratios) ** 2 / (n * sum(r * r for r in ratios)),
        "logprob_gap": sum(abs(logprobs[b][t] - gen_logprobs[b][t]) for b, t in tokens) / n,
        "ratio_mean": sum(ratios) / n,
        "tokens": float(n),
    }
    return loss, grad, metrics


def run(logprobs, gen_logprobs, advantages, mask, rho, normalizer=None):
    lp = torch.tensor(logprobs, dtype=torch.float64, requires_grad=True)
    loss, metrics = aipo_loss(
        lp,
        torch.tensor(gen_logprobs, dtype=torch.float64),
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(mask),
        rho,
        normalizer,
    )
    loss.backward()
    return loss, lp.grad, metrics


def check_against_reference(logprobs, gen_logprobs, advantages, mask, rho, normalizer=None):
    loss, grad, metrics = run(logprobs, gen_logprobs, advantages, mask, rho, normalizer)
    ref_loss, ref_grad, ref_metrics = reference(logprobs, gen_logprobs, advantages, mask, rho, normalizer)
    assert_close(loss, torch.tensor(ref_loss, dtype=torch.float64))
    assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64))
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    return metrics


LOGPROBS = [[-0.5, -1.2, -2.0, -0.1], [-0.3, -0.9, -1.5, -4.0], [-2.2, -0.7, -0.05, -1.0]]
MASK = [[True, True, True, False], [False, True, True, True], [True, True, False, False]]
ADVANTAGES = [0.75, -1.25, 0.5]


def test_unclipped_matches_reference():
    gen = [[lp + d for lp, d in zip(row, (0.2, -0.3, 0.1, 0.4))] for row in LOGPROBS]
    metrics = check_against_reference(LOGPROBS, gen, ADVANTAGES, MASK, rho=10.0)
    assert metrics["clip_fraction"] == 0.0
    assert 0.0 < metrics["ess"] < 1.0


def test_clipping_at_rho_matches_reference():
    # log-ratios 1.5 and 2.0 give pi/mu = 4.5 and 7.4, above rho = 2; the rest stay below.
    gen = [[lp - d for lp, d in zip(row, (1.5, 0.2, -0.4, 2.0))] for row in LOGPROBS]
    metrics = check_against_reference(LOGPROBS, gen, ADVANTAGES, MASK, rho=2.0)
    assert metrics["clip_fraction"] == pytest.approx(3 / 8)  # columns 0 (2 masked tokens) and 3 (1)


def test_explicit_normalizer_matches_reference():
    gen = [[lp + 0.1 for lp in row] for row in LOGPROBS]
    check_against_reference(LOGPROBS, gen, ADVANTAGES, MASK, rho=2.0, normalizer=40)


def test_gradient_is_minus_w_times_advantage_over_n():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    gen = torch.tensor([[-1.0, -3.0, -0.5 - math.log(1.5)]])
    loss, _ = aipo_loss(logprobs, gen, torch.tensor([2.0]), torch.tensor([[1, 1, 1]]), rho=2.0)
    loss.backward()
    # weights: ratio 1, ratio e (clipped to 2), ratio 1.5; A = 2; n = 3.
    assert_close(logprobs.grad, torch.tensor([[-1.0, -2.0, -1.5]]) * 2.0 / 3.0)


def test_empty_mask_gives_zero_loss_and_finite_zero_grads():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    empty = torch.zeros(2, 2, dtype=torch.bool)
    loss, metrics = aipo_loss(logprobs, torch.zeros(2, 2), torch.ones(2), empty, 2.0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 2))
    assert metrics == {"clip_fraction": 0.0, "ess": 1.0, "logprob_gap": 0.0, "ratio_mean": 1.0, "tokens": 0.0}


def test_masked_out_infinities_do_not_leak():
    logprobs = torch.tensor([[-1.0, -math.inf]], requires_grad=True)
    gen = torch.tensor([[-1.0, -math.inf]])
    loss, metrics = aipo_loss(logprobs, gen, torch.tensor([1.0]), torch.tensor([[True, False]]), 2.0)
    loss.backward()
    assert loss.item() == pytest.approx(1.0)
    assert torch.isfinite(logprobs.grad).all()
    assert metrics["tokens"] == 1.0 and math.isfinite(metrics["logprob_gap"])


def test_huge_log_ratio_is_guarded():
    logprobs = torch.tensor([[-0.1, -0.2]], requires_grad=True)
    gen = torch.tensor([[-1000.0, -0.2]])
    loss, metrics = aipo_loss(logprobs, gen, torch.tensor([1.0]), torch.ones(1, 2), 2.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert_close(logprobs.grad, torch.tensor([[-2.0, -1.0]]) / 2)
    assert metrics["clip_fraction"] == 0.5 and 0.5 <= metrics["ess"] < 0.51


def test_all_equal_rewards_give_zero_loss_and_zero_grad():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7])
    advantages = group_advantages(rewards, torch.tensor([4, 4, 4, 9, 9]))
    assert torch.equal(advantages, torch.zeros(5))
    logprobs = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).sub(2).requires_grad_()
    loss, _ = aipo_loss(logprobs, logprobs.detach() - 0.3, advantages, torch.ones(5, 3), 2.0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(5, 3))


def test_group_advantages_subtract_the_group_mean():
    rewards = [1.0, 0.0, 0.5, 2.0, 1.0, 3.0, -1.0]
    groups = [7, 3, 7, 3, 7, 5, 3]
    means = {g: sum(r for r, h in zip(rewards, groups) if h == g) / groups.count(g) for g in set(groups)}
    expected = torch.tensor([r - means[g] for r, g in zip(rewards, groups)])
    assert_close(group_advantages(torch.tensor(rewards), torch.tensor(groups)), expected)


def test_group_advantages_accept_integer_rewards():
    advantages = group_advantages(torch.tensor([1, 0, 0, 0]), torch.tensor([0, 0, 1, 1]))
    assert advantages.dtype == torch.float32
    assert_close(advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_ess_and_clip_fraction_on_known_weights():
    # Ratios 1, 1, 4, 4 with rho = 2: half clipped; ESS = (1+1+4+4)^2 / (4 * (1+1+16+16)) = 100/136.
    gen = torch.log(torch.tensor([[1.0, 1.0, 0.25, 0.25]]))
    _, metrics = aipo_loss(torch.zeros(1, 4), gen, torch.ones(1), torch.ones(1, 4), rho=2.0)
    assert metrics["clip_fraction"] == 0.5
    assert metrics["ess"] == pytest.approx(100 / 136)
    assert metrics["ratio_mean"] == pytest.approx(2.5)
    assert metrics["logprob_gap"] == pytest.approx(math.log(4) / 2)
    same = torch.full((1, 3), -0.5)
    _, equal = aipo_loss(torch.zeros(1, 3), same, torch.ones(1), torch.ones(1, 3), rho=2.0)
    assert equal["ess"] == pytest.approx(1.0)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="advantages"):
        aipo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), 2.0)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
