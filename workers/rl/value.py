"""The critic's loss (algorithm.advantage: gae): PPO's clipped value loss towards the GAE returns.

A pure function like the policy losses, checked against plain floats; the critic executor calls it. The returns
and the old values are those the batch's advantages were computed with, so value clipping keeps each of the
critic's several optimizer steps per batch (algorithm.epochs, miniBatches) near the values the advantages used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfleet.workers.rl.losses import token_mean


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None,
               normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO value loss ``(1/N) sum mask * 0.5 * max((V - R)^2, (V_clip - R)^2)``,
    ``V_clip = V_old + clip(V - V_old, -clip, clip)``.

    The gradient flows only through the term the max chose: where the clipped one is larger, V has moved more
    than `clip` from V_old towards R, and the token gives no gradient (it may not move further in one batch).

    Args:
        values: ``[B, T]`` the critic's V of the state before each completion token (requires grad).
        old_values: ``[B, T]`` V_old, the values the advantages were computed with.
        returns: ``[B, T]`` R, the targets (advantages.gae's returns).
        mask: ``[B, T]`` bool or 0/1: the completion tokens that count.
        clip: how far V may move from V_old before the clipped term takes over; None: the plain squared error.
        normalizer: N, as in the policy losses (losses.token_mean): the masked tokens by default.
    Returns:
        ``(loss, metrics)``; metrics are floats over masked tokens, computed without grad:
        ``value_clip_fraction`` (share of tokens where the clipped term was chosen and differs),
        ``explained_variance`` (``1 - Var(R - V) / Var(R)``; 0.0 when Var(R) is 0 or no token is masked).
    """
    _check_shapes(values, old_values, returns, mask)
    mask = mask.bool()
    # Padding may hold anything; zeroed before any arithmetic so that no NaN reaches the gradient.
    values, old_values, returns = (torch.where(mask, x, 0.0) for x in (values, old_values, returns))
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token, chosen = unclipped, torch.zeros_like(mask)
    else:
        moved = values - old_values
        # V itself where it moved less than clip: old + (V - old) is V only up to rounding, which would count (and
        # train) a one-ulp larger "clipped" term on some machines' arithmetic and not others'.
        bounded = torch.where(moved.abs() > clip, old_values + moved.clamp(-clip, clip), values)
        clipped = (bounded - returns) ** 2
        chosen = clipped > unclipped
        per_token = torch.where(chosen, clipped, unclipped)
    return token_mean(0.5 * per_token, mask, normalizer), _metrics(values, returns, mask, chosen)


def _metrics(values: Tensor, returns: Tensor, mask: Tensor, chosen: Tensor) -> dict[str, float]:
    with torch.no_grad():
        if not mask.any():
            return {"value_clip_fraction": 0.0, "explained_variance": 0.0}
        targets, errors = returns[mask].double(), (returns - values.detach())[mask].double()
        spread = targets.var(unbiased=False)
        explained = float(1.0 - errors.var(unbiased=False) / spread) if spread > 0 else 0.0
        return {"value_clip_fraction": float(chosen[mask].double().mean()), "explained_variance": explained}


def _check_shapes(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor) -> None:
    if values.dim() != 2 or any(x.shape != values.shape for x in (old_values, returns, mask)):
        raise ValueError(f"values, old_values, returns and mask must all be [B, T], got {tuple(values.shape)}, "
                         f"{tuple(old_values.shape)}, {tuple(returns.shape)}, {tuple(mask.shape)}")
