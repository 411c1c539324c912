"""GAE and whitening against plain-float references, one token at a time."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.testing import assert_close

from rlfleet.workers.rl.advantages import STD_EPS, gae, whiten


def gae_reference(rewards, values, lengths, gamma, lam):
    """Advantages and returns of each row's first `length` tokens, walking back from V = 0 after the last."""
    advantages, returns = [], []
    for r, v, n in zip(rewards, values, lengths):
        row, following = [0.0] * len(r), 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            following = r[t] + gamma * next_value - v[t] + gamma * lam * following
            row[t] = following
        advantages.append(row)
        returns.append([row[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return advantages, returns


def random_batch(seed: int, width: int = 7):
    """Rows of random lengths (0 and the full width included) with random rewards and values, padding too."""
    rng = random.Random(seed)
    lengths = [0, width, *(rng.randrange(1, width) for _ in range(4))]
    rewards = [[rng.uniform(-2, 2) for _ in range(width)] for _ in lengths]
    values = [[rng.uniform(-1, 1) for _ in range(width)] for _ in lengths]
    mask = [[t < n for t in range(width)] for n in lengths]
    return rewards, values, mask, lengths


def run(rewards, values, mask, gamma, lam):
    return gae(torch.tensor(rewards, dtype=torch.float64), torch.tensor(values, dtype=torch.float64),
               torch.tensor(mask), gamma, lam)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (1.0, 1.0), (0.0, 0.5)])
@pytest.mark.parametrize("seed", range(3))
def test_gae_matches_the_reference(gamma, lam, seed):
    rewards, values, mask, lengths = random_batch(seed)
    advantages, returns = run(rewards, values, mask, gamma, lam)
    expected_advantages, expected_returns = gae_reference(rewards, values, lengths, gamma, lam)
    assert_close(advantages, torch.tensor(expected_advantages, dtype=torch.float64))
    assert_close(returns, torch.tensor(expected_returns, dtype=torch.float64))


def test_gamma_and_lambda_one_give_the_return_minus_the_value():
    """A_t = sum_{u >= t} r_u - V_t: with the reward on the last token, the completion's reward minus V_t."""
    values = [[0.2, -0.4, 0.7, 0.1], [0.5, 0.3, -0.9, 0.6]]
    rewards = [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, -2.0]]
    mask = [[True, True, True, False], [True] * 4]
    advantages, returns = run(rewards, values, mask, 1.0, 1.0)
    expected = [[1.0 - 0.2, 1.0 + 0.4, 1.0 - 0.7, 0.0], [-2.5, -2.3, -1.1, -2.6]]
    assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
    assert_close(returns, torch.tensor([[1.0, 1.0, 1.0, 0.0], [-2.0] * 4], dtype=torch.float64))


def test_lambda_zero_is_the_one_step_td_error():
    rewards, values, mask, lengths = random_batch(5)
    advantages, _ = run(rewards, values, mask, 0.9, 0.0)
    for b, n in enumerate(lengths):
        for t in range(n):
            next_value = values[b][t + 1] if t + 1 < n else 0.0
            assert advantages[b, t].item() == pytest.approx(rewards[b][t] + 0.9 * next_value - values[b][t])


def test_padding_gives_zeros_and_does_not_leak():
    """Whatever the padding holds (inf included), the real tokens' results are those of the trimmed rows."""
    rewards, values, mask, lengths = random_batch(1)
    noisy = [[x if on else math.inf for x, on in zip(row, m)] for row, m in zip(values, mask)]
    advantages, returns = run(rewards, noisy, mask, 0.95, 0.9)
    clean, _ = run(rewards, values, mask, 0.95, 0.9)
    padding = ~torch.tensor(mask)
    assert torch.equal(advantages, clean)
    assert (advantages[padding] == 0).all() and (returns[padding] == 0).all()


def test_gae_refuses_bad_shapes_and_holes_in_the_mask():
    with pytest.raises(ValueError, match="prefix"):
        run([[1.0, 1.0]], [[0.0, 0.0]], [[False, True]], 1.0, 1.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        gae(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3), 1.0, 1.0)


def test_whiten_gives_mean_zero_and_std_one_over_the_masked_entries():
    rewards, values, mask, _ = random_batch(2)
    x, m = torch.tensor(rewards, dtype=torch.float64), torch.tensor(mask)
    flat = [r for row, on in zip(rewards, mask) for r, keep in zip(row, on) if keep]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((r - mean) ** 2 for r in flat) / (len(flat) - 1))
    expected = [[(r - mean) / (std + STD_EPS) if keep else 0.0 for r, keep in zip(row, on)]
                for row, on in zip(rewards, mask)]
    assert_close(whiten(x, m), torch.tensor(expected, dtype=torch.float64))


def test_whiten_of_nothing_or_constants_is_zero():
    assert torch.equal(whiten(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool)), torch.zeros(2, 3))
    assert torch.equal(whiten(torch.full((2, 2), 0.3), torch.tensor([[True, True], [True, False]])),
                       torch.zeros(2, 2))


def test_the_controller_puts_each_reward_less_its_penalty_on_the_last_token():
    from conftest import sampled
    from rlfleet.workers.controller.rollouts import Rollout, set_gae_advantages
    from rlfleet.workers.rl.config import Gae

    values = [[0.5, 0.25], [0.0, 0.1, 0.2], []]
    rollouts = [Rollout(str(i), 0, [1], "", turns=sampled([5] * len(v)), values=v, reward=reward, kl_penalty=penalty)
                for i, (v, reward, penalty) in enumerate(zip(values, (1.0, 0.5, 0.3), (0.0, 0.25, 0.0)))]
    set_gae_advantages(rollouts, Gae(gamma=0.9, lam=0.8, whiten=False))
    wanted, returns = gae_reference([[0.0, 1.0], [0.0, 0.0, 0.25], [0.0, 0.0, 0.0]],
                                    [v + [0.0] * (3 - len(v)) for v in values], [2, 3, 0], 0.9, 0.8)
    for rollout, advantages, found_returns in zip(rollouts, wanted, returns):
        n = len(rollout.completion_ids)
        assert_close(rollout.token_advantages, advantages[:n])
        assert_close(rollout.returns, found_returns[:n])
        assert rollout.advantage == pytest.approx(sum(advantages[:n]) / max(1, n))
    set_gae_advantages(rollouts, Gae(gamma=0.9, lam=0.8))  # whitened over the batch's tokens
    tokens = [a for r in rollouts for a in r.token_advantages]
    assert sum(tokens) == pytest.approx(0.0, abs=1e-9) and len(tokens) == 5


def test_a_stages_token_rewards_join_each_tokens_reward_or_the_completions():
    """A stage's per-token rewards (Rollout.token_rewards): with GAE each on its token; with an outcome advantage,
    their sum on the completion's reward. A list that does not match the completion is refused, naming the stage."""
    from conftest import sampled
    from rlfleet.workers.controller.rollouts import Rollout, set_advantages, set_gae_advantages
    from rlfleet.workers.rl.config import Gae

    def rollout(index: int, reward: float, penalties: list[float]) -> Rollout:
        return Rollout(str(index), 0, [1], "", turns=sampled([5] * len(penalties)), values=[0.0] * len(penalties),
                       reward=reward, token_rewards={"length": penalties})

    rollouts = [rollout(0, 1.0, [-0.1, -0.2]), rollout(1, 0.0, [0.0, -0.3, -0.3])]
    set_gae_advantages(rollouts, Gae(gamma=1.0, lam=1.0, whiten=False))
    assert_close(rollouts[0].returns, [0.7, 0.8], rtol=0, atol=1e-12)
    assert_close(rollouts[1].returns, [-0.6, -0.6, -0.3], rtol=0, atol=1e-12)
    set_advantages(rollouts)  # group mean of 1.0 - 0.3 and 0.0 - 0.6
    assert [r.advantage for r in rollouts] == pytest.approx([0.65, -0.65])
    short = Rollout("2", 0, [1], "", turns=sampled([5, 5]), values=[0.0, 0.0], token_rewards={"length": [0.0]})
    with pytest.raises(ValueError, match="stage 'length' gave 1 token rewards for 2 completion tokens"):
        set_gae_advantages([short], Gae(gamma=1.0, lam=1.0, whiten=False))
