"""AIPO (LlamaRL, arXiv 2505.24034): group advantages and the importance-weighted policy loss.

Pure functions on tensors, no model and no process group: the trainer calls them, the unit tests
check them against a per-token reference written with plain floats.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# exp(20) ~ 4.9e8 is far above any rho (<= 10), so clipping is unchanged, while the ratio and its
# square (used by the ESS) stay finite in float32 even when the generator's logprob underflows.
MAX_LOG_RATIO = 20.0
# The metrics of a batch without a completion token: nothing off-policy, so dashboards show no false alarm.
EMPTY_METRICS = {"clip_fraction": 0.0, "ess": 1.0, "logprob_gap": 0.0, "ratio_mean": 1.0, "tokens": 0.0}


def group_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Group baseline: ``A_i = r_i - mean{r_j : group_j == group_i}``.

    No division by the group's standard deviation: a group whose rewards are all equal carries no
    learning signal and must give exactly zero advantage, not 0/0 (or 0/eps, which turns float
    noise into a full-size signal). The mean is taken of rewards shifted by the group's maximum, so
    equal rewards give an exact 0 whatever their value (0.1 * 3 / 3 != 0.1 in floating point).

    Args:
        rewards: ``[B]`` scalar reward of each completion.
        group_ids: ``[B]`` integer id of the prompt group of each completion (any values).
    Returns:
        ``[B]`` advantages, float (the rewards' dtype if floating, else float32).
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if rewards.numel() == 0:
        return rewards.to(_float_dtype(rewards))
    rewards = rewards.to(_float_dtype(rewards))
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1
    shift = torch.zeros(n_groups, dtype=rewards.dtype).scatter_reduce(
        0, group, rewards, reduce="amax", include_self=False
    )
    shifted = rewards - shift[group]
    sums = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, group, shifted)
    counts = torch.bincount(group, minlength=n_groups).to(rewards.dtype)
    return shifted - (sums / counts)[group]


def aipo_loss(
    logprobs: Tensor,
    gen_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rho: float,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AIPO loss ``-(1/N) * sum_{b,t} mask * w_bt * A_b * log pi(y_bt)``, ``w = min(pi/mu, rho)``.

    ``w = min(exp(log pi - log mu), rho)`` is detached and clipped from above only: it corrects
    for the generator's (stale) policy mu without letting one token dominate. The gradient with
    respect to ``log pi(y_bt)`` is therefore ``-w_bt * A_b / N`` on masked tokens and 0 elsewhere.

    Args:
        logprobs: ``[B, T]`` trainer's log pi of each sampled token (requires grad).
        gen_logprobs: ``[B, T]`` generator's log mu of the same tokens.
        advantages: ``[B]`` one advantage per sequence.
        mask: ``[B, T]`` bool or 0/1: the completion tokens that count.
        rho: upper clip of the importance weight.
        normalizer: N; defaults to the number of masked tokens. Under data parallelism pass the
            global token count so every token weighs the same on every rank. Clamped to >= 1, so
            an empty mask gives a zero loss that still backpropagates (zero grads, no NaN).
    Returns:
        ``(loss, metrics)``; metrics are floats over masked tokens, computed without grad:
        ``clip_fraction`` (share with pi/mu > rho), ``ess`` (normalised effective sample size of
        the unclipped ratios r: ``(sum r)^2 / (n * sum r^2)``, 1.0 when all equal),
        ``logprob_gap`` (mean ``|log pi - log mu|``), ``ratio_mean`` (mean r), ``tokens`` (n).
        With no masked token: clip_fraction 0, ess 1, logprob_gap 0, ratio_mean 1, tokens 0,
        the values of a batch with nothing off-policy in it, so dashboards show no false alarm.
    """
    _check_shapes(logprobs, gen_logprobs, advantages, mask)
    mask = mask.bool()
    log_ratio = torch.where(mask, logprobs.detach() - gen_logprobs, 0.0).clamp(max=MAX_LOG_RATIO)
    weights = log_ratio.exp().clamp(max=rho)
    # where(), not a product with the mask: padding may hold -inf logprobs and -inf * 0 is NaN.
    per_token = torch.where(mask, weights * advantages[:, None] * logprobs, 0.0)
    if normalizer is None:
        normalizer = mask.sum()
    normalizer = torch.as_tensor(normalizer, dtype=logprobs.dtype).clamp(min=1.0)
    loss = -per_token.sum() / normalizer
    return loss, _metrics(log_ratio, logprobs.detach() - gen_logprobs, mask, rho)


def _metrics(log_ratio: Tensor, raw_log_ratio: Tensor, mask: Tensor, rho: float) -> dict[str, float]:
    with torch.no_grad():
        n = int(mask.sum())
        if n == 0:
            return dict(EMPTY_METRICS)
        chosen = log_ratio[mask].double()
        ratios = chosen.exp()
        return {
            "clip_fraction": float((chosen > math.log(rho)).double().mean()),
            "ess": float(ratios.sum() ** 2 / (n * (ratios**2).sum())),
            "logprob_gap": float(raw_log_ratio[mask].double().abs().mean()),
            "ratio_mean": float(ratios.mean()),
            "tokens": float(n),
        }


def _check_shapes(logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> None:
    if logprobs.dim() != 2 or gen_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, gen_logprobs and mask must all be [B, T], got "
            f"{tuple(logprobs.shape)}, {tuple(gen_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")


def _float_dtype(tensor: Tensor) -> torch.dtype:
    return tensor.dtype if tensor.is_floating_point() else torch.float32
