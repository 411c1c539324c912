"""Advantage estimators (spec.algorithm.advantage): one advantage per completion from the rewards of its prompt's
group, or of the whole batch; or, with a critic (`gae`), one per completion token. Pure functions, checked against
plain-float references like the losses.

Every group estimator starts from the group-centred reward, which is exactly 0 for a group whose rewards are all
equal (such a group carries no learning signal, and dividing noise by a tiny spread would make a full-size one).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Added to a standard deviation before dividing by it (GRPO's and REINFORCE++'s epsilon).
STD_EPS = 1e-6


def advantages(kind: str, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """``[B]`` advantages of the estimator `kind` (spec.algorithm.advantage)."""
    centred, group, counts = _centred(rewards, group_ids)
    if kind == "group_mean":
        return centred
    if kind == "group_mean_std":  # GRPO: r - mean over the group, divided by the group's standard deviation
        squares = torch.zeros_like(counts).index_add_(0, group, centred**2)
        std = (squares / (counts - 1).clamp(min=1)).sqrt()
        return centred / (std[group] + STD_EPS)
    if kind == "rloo":  # leave one out: r_i - mean of the others' rewards = n / (n - 1) * (r_i - mean)
        n = counts[group]
        return torch.where(n > 1, centred * n / (n - 1).clamp(min=1), 0.0)
    if kind == "reinforce_pp":  # REINFORCE++ (baseline): group-centred, divided by the whole batch's spread
        spread = centred.std() if centred.numel() > 1 else centred.new_zeros(())
        return centred / (spread + STD_EPS)
    raise ValueError(f"unknown advantage estimator {kind!r}")


def group_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Group baseline: ``A_i = r_i - mean{r_j : group_j == group_i}`` (the `group_mean` estimator).

    Args:
        rewards: ``[B]`` scalar reward of each completion.
        group_ids: ``[B]`` integer id of the prompt group of each completion (any values).
    Returns:
        ``[B]`` advantages, float (the rewards' dtype if floating, else float32).
    """
    return _centred(rewards, group_ids)[0]


def _centred(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(r - its group's mean, each sample's group index, each group's size). The mean is taken of rewards shifted
    by the group's maximum, so equal rewards give an exact 0 whatever their value (0.1 * 3 / 3 != 0.1)."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    rewards = rewards.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    if rewards.numel() == 0:
        return rewards, group_ids.long(), rewards.new_zeros(0)
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1
    shift = torch.zeros(n_groups, dtype=rewards.dtype).scatter_reduce(
        0, group, rewards, reduce="amax", include_self=False
    )
    shifted = rewards - shift[group]
    sums = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, shifted)
    counts = torch.bincount(group, minlength=n_groups).to(rewards.dtype)
    return shifted - (sums / counts)[group], group, counts


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation: ``A_t = delta_t + gamma lam A_{t+1}``, ``delta_t = r_t + gamma V_{t+1} - V_t``.

    The value after a row's last real token is 0: only finished completions train, so that state is terminal.

    Args:
        rewards: ``[B, T]`` reward of each completion token (a completion's scalar reward on its last token).
        values: ``[B, T]`` the critic's V(s_t) of the state before completion token t.
        mask: ``[B, T]`` bool or 0/1: the real completion tokens, a prefix of each row (right padding).
        gamma: discount per token.
        lam: GAE's lambda: 0 is the one-step TD error, 1 the Monte Carlo return minus V_t.
    Returns:
        ``(advantages, returns)``, both ``[B, T]`` and 0 outside the mask; ``returns = advantages + values`` are the
        critic's targets.
    """
    mask = _prefix_mask(rewards, values, mask)
    # Zeroed padding comes after each row's last token: V there is the terminal 0, and its deltas and advantages
    # stay 0.
    rewards, values = torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0)
    following = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = rewards + gamma * following - values
    advantages = torch.zeros_like(deltas)
    running = torch.zeros_like(deltas[:, 0])
    for t in reversed(range(deltas.shape[1])):
        running = deltas[:, t] + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def whiten(values: Tensor, mask: Tensor) -> Tensor:
    """``(x - mean) / (std + STD_EPS)`` over the masked entries of the whole batch (PPO's advantage normalisation);
    0 outside the mask. The std is the unbiased one, as in `group_mean_std`."""
    mask = mask.bool()
    n = mask.sum()
    if n == 0:
        return torch.zeros_like(values)
    mean = torch.where(mask, values, 0.0).sum() / n
    centred = torch.where(mask, values - mean, 0.0)
    std = ((centred**2).sum() / (n - 1).clamp(min=1)).sqrt()
    return centred / (std + STD_EPS)


def _prefix_mask(rewards: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    if rewards.dim() != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(f"rewards, values and mask must all be [B, T], got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    mask = mask.bool()
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("mask must be a prefix of each row (right padding): V after the last token is taken as 0")
    return mask
