"""Every policy loss against a per-token reference written with plain floats: the loss, its gradient with respect to
log pi (worked out by hand), and the share of tokens each clips; with one advantage per sequence or per token."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.testing import assert_close

from rlfleet.workers.rl.config import CispoLoss, GspoLoss, PpoLoss, ReinforceLoss
from rlfleet.workers.rl.losses import policy_loss

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
ADVANTAGES = [1.5, -0.7, 0.4]
# One per token (GAE's shape), of both signs within a sequence; the padding's value must not matter.
TOKEN_ADVANTAGES = [[1.5, -0.3, 0.8, 9.0], [-0.7, 0.2, 9.0, 9.0], [0.4, -1.1, 0.0, 2.5]]


def _batch(seed: int, spread: float):
    rng = random.Random(seed)
    logprobs = [[-rng.uniform(0.05, 3.0) for _ in row] for row in MASK]
    gen = [[lp - rng.uniform(-spread, spread) for lp in row] for row in logprobs]
    return logprobs, gen


def _tokens(b: int) -> list[int]:
    return [t for t, on in enumerate(MASK[b]) if on]


def _clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def _advantage(advantages, b: int, t: int) -> float:
    return advantages[b][t] if isinstance(advantages[b], list) else advantages[b]


def _surrogate(r: float, a: float, low: float, high: float) -> tuple[float, float, bool]:
    """min(r a, clip(r) a), its derivative in r, and whether the clip chose it."""
    clipped = _clip(r, 1 - low, 1 + high) * a
    if clipped < r * a:
        return clipped, 0.0, True
    return r * a, a, False


def ppo_reference(lp, gen, low, high, advantages=ADVANTAGES):
    n, loss, grad, clips = sum(map(sum, MASK)), 0.0, [[0.0] * 4 for _ in MASK], 0
    for b in range(len(MASK)):
        for t in _tokens(b):
            r = math.exp(lp[b][t] - gen[b][t])
            value, slope, clipped = _surrogate(r, _advantage(advantages, b, t), low, high)
            loss -= value / n
            grad[b][t] = -slope * r / n  # d r / d log pi = r
            clips += clipped
    return loss, grad, clips / n


def gspo_reference(lp, gen, low, high, advantages=ADVANTAGES):
    n, loss, grad, clips = sum(map(sum, MASK)), 0.0, [[0.0] * 4 for _ in MASK], 0
    for b in range(len(MASK)):
        tokens = _tokens(b)
        s = math.exp(sum(lp[b][t] - gen[b][t] for t in tokens) / len(tokens))
        slopes = 0.0
        for u in tokens:  # the surrogate of s against each token's advantage, counted per token
            value, slope, clipped = _surrogate(s, _advantage(advantages, b, u), low, high)
            loss -= value / n
            slopes += slope
            clips += clipped
        for t in tokens:
            grad[b][t] = -slopes * s / len(tokens) / n  # d s / d log pi_t = s / len(tokens)
    return loss, grad, clips / n


def cispo_reference(lp, gen, low, high, advantages=ADVANTAGES):
    n, loss, grad, clips = sum(map(sum, MASK)), 0.0, [[0.0] * 4 for _ in MASK], 0
    for b in range(len(MASK)):
        for t in _tokens(b):
            a = _advantage(advantages, b, t)
            r = math.exp(lp[b][t] - gen[b][t])
            w = _clip(r, 1 - low, 1 + high)
            loss -= w * a * lp[b][t] / n
            grad[b][t] = -w * a / n
            clips += w != r
    return loss, grad, clips / n


def reinforce_reference(lp, gen, correction, level, cap, advantages=ADVANTAGES):
    n, loss, grad, clips = sum(map(sum, MASK)), 0.0, [[0.0] * 4 for _ in MASK], 0
    for b in range(len(MASK)):
        sequence = math.exp(sum(lp[b][t] - gen[b][t] for t in _tokens(b)))
        for t in _tokens(b):
            a = _advantage(advantages, b, t)
            r = sequence if level == "sequence" else math.exp(lp[b][t] - gen[b][t])
            over = correction != "none" and r > cap
            w = {"none": 1.0, "tis": min(r, cap), "mis": 0.0 if over else r}[correction]
            loss -= w * a * lp[b][t] / n
            grad[b][t] = -w * a / n
            clips += over
    return loss, grad, clips / n


def run(config, lp, gen, advantages=ADVANTAGES):
    logprobs = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(config, logprobs, torch.tensor(gen, dtype=torch.float64),
                                torch.tensor(advantages, dtype=torch.float64), torch.tensor(MASK))
    loss.backward()
    return loss, logprobs.grad, metrics


CASES = [
    (PpoLoss(), lambda lp, gen, adv=ADVANTAGES: ppo_reference(lp, gen, 0.2, 0.2, adv)),
    (PpoLoss(eps_low=0.2, eps_high=0.28), lambda lp, gen, adv=ADVANTAGES: ppo_reference(lp, gen, 0.2, 0.28, adv)),
    (GspoLoss(eps_low=0.05, eps_high=0.08), lambda lp, gen, adv=ADVANTAGES: gspo_reference(lp, gen, 0.05, 0.08, adv)),
    (CispoLoss(eps_low=0.5, eps_high=0.3), lambda lp, gen, adv=ADVANTAGES: cispo_reference(lp, gen, 0.5, 0.3, adv)),
    *[(ReinforceLoss(correction=c, level=level, cap=1.3),
       lambda lp, gen, adv=ADVANTAGES, c=c, level=level: reinforce_reference(lp, gen, c, level, 1.3, adv))
      for c in ("none", "tis", "mis") for level in ("token", "sequence")],
]
CASE_IDS = {"ids": lambda case: getattr(case, "type", None) and "-".join(str(v) for v in case.model_dump().values())}


@pytest.mark.parametrize("spread", [0.05, 0.6], ids=["near-on-policy", "stale"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config, reference", CASES, **CASE_IDS)
def test_each_loss_matches_its_reference(config, reference, seed, spread):
    lp, gen = _batch(seed, spread)
    loss, grad, metrics = run(config, lp, gen)
    ref_loss, ref_grad, ref_clipped = reference(lp, gen)
    assert_close(loss, torch.tensor(ref_loss, dtype=torch.float64))
    assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64))
    assert metrics["clip_fraction"] == pytest.approx(ref_clipped)


def test_the_stale_batches_do_clip_so_the_references_check_both_branches():
    """Each clipping loss clips some tokens and keeps others in the stale cases (else a clip bug would pass)."""
    for config, reference in CASES:
        fractions = [reference(*_batch(seed, 0.6))[2] for seed in range(3)]
        if getattr(config, "correction", "clip") != "none":
            assert any(0 < f < 1 for f in fractions), config


def test_at_equal_policies_every_loss_is_the_plain_policy_gradient():
    """pi = mu: no ratio differs from 1, so each loss's gradient is -A / N on every token."""
    lp = [[-1.0, -2.0, -0.5, -0.1]] * 3
    n = sum(map(sum, MASK))
    expected = torch.tensor([[-a / n * on for on in row] for a, row in zip(ADVANTAGES, MASK)], dtype=torch.float64)
    for config, _ in CASES:
        _, grad, metrics = run(config, lp, lp)
        assert_close(grad, expected)
        assert metrics["clip_fraction"] == 0.0 and metrics["logprob_gap"] == 0.0


def test_padding_with_minus_infinity_gives_no_nan():
    lp = [[-1.0 - t if on else -math.inf for t, on in enumerate(row)] for row in MASK]
    for config, _ in CASES:
        loss, grad, _ = run(config, lp, [[-1.2 - t if on else 0.0 for t, on in enumerate(row)] for row in MASK])
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), config


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", [case[0] for case in CASES], ids=lambda config: config.type)
def test_a_token_advantage_equal_to_its_sequences_gives_the_same_loss_exactly(config, seed):
    """A [B, T] advantage that repeats each sequence's [B] one gives the same loss, gradient and metrics, to the
    bit: in float32 over long rows, where a sum taken in another order would differ in the last bits."""
    rng = torch.Generator().manual_seed(seed)
    logprobs = -3.0 * torch.rand(4, 37, generator=rng)
    gen = logprobs - 0.6 * (torch.rand(4, 37, generator=rng) - 0.5)
    mask = torch.rand(4, 37, generator=rng) < 0.8
    advantages = torch.randn(4, generator=rng)
    results = []
    for given in (advantages, advantages[:, None].expand(4, 37).clone()):
        lp = logprobs.clone().requires_grad_()
        loss, metrics = policy_loss(config, lp, gen, given, mask)
        loss.backward()
        results.append((loss, lp.grad, metrics))
    (loss, grad, metrics), (token_loss, token_grad, token_metrics) = results
    assert torch.equal(token_loss, loss) and torch.equal(token_grad, grad)
    assert token_metrics == metrics


@pytest.mark.parametrize("spread", [0.05, 0.6], ids=["near-on-policy", "stale"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config, reference", CASES, **CASE_IDS)
def test_token_advantages_match_the_reference(config, reference, seed, spread):
    lp, gen = _batch(seed, spread)
    loss, grad, metrics = run(config, lp, gen, TOKEN_ADVANTAGES)
    ref_loss, ref_grad, ref_clipped = reference(lp, gen, TOKEN_ADVANTAGES)
    assert_close(loss, torch.tensor(ref_loss, dtype=torch.float64))
    assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64))
    assert metrics["clip_fraction"] == pytest.approx(ref_clipped)


def test_token_advantages_of_another_shape_are_refused():
    lp, gen = _batch(0, 0.1)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        run(PpoLoss(), lp, gen, [row[:3] for row in TOKEN_ADVANTAGES])
