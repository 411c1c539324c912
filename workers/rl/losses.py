"""Policy losses (spec.algorithm.loss): AIPO (LlamaRL, arXiv 2505.24034), PPO/GRPO with DAPO's clip-higher, GSPO,
CISPO and REINFORCE with token- or sequence-level TIS/MIS.

Pure functions on tensors, no model and no process group: the trainer calls them, the unit tests check each
against a per-token reference written with plain floats. mu is the generator's logprob of each sampled token, the
policy that sampled it (stale by up to maxStaleness versions), so the ratio r = pi/mu is what every clip and
correction acts on; with several optimizer steps per batch (algorithm.epochs, miniBatches) the later steps see pi
move further from mu, which the clip bounds as in PPO. Every loss is a token mean over the batch's completion tokens
(DAPO's token-level aggregation; a sequence-level term counts once per token of its sequence), which the
micro-batched trainer keeps exact by passing the token count of all the ranks' samples of the step as `normalizer`.
The advantage A is one per sequence (``[B]``, the group estimators) or one per token (``[B, T]``, GAE).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfleet.workers.rl.config import AipoLoss, CispoLoss, GspoLoss, PolicyLoss, PpoLoss, ReinforceLoss

# exp(20) ~ 4.9e8 is far above any clip, so clipping is unchanged, while the ratio and its square (used by the
# ESS) stay finite in float32 even when the generator's logprob underflows.
MAX_LOG_RATIO = 20.0
# The metrics of a batch without a completion token: nothing off-policy, so dashboards show no false alarm.
EMPTY_METRICS = {"clip_fraction": 0.0, "ess": 1.0, "logprob_gap": 0.0, "ratio_mean": 1.0, "tokens": 0.0}


def policy_loss(config: PolicyLoss, logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The loss the job chose, with its metrics (see aipo_loss for the arguments and the metrics)."""
    if isinstance(config, AipoLoss):
        return aipo_loss(logprobs, gen_logprobs, advantages, mask, config.rho, normalizer)
    if isinstance(config, PpoLoss):
        return ppo_loss(logprobs, gen_logprobs, advantages, mask, config.eps_low, config.eps_high, normalizer)
    if isinstance(config, GspoLoss):
        return gspo_loss(logprobs, gen_logprobs, advantages, mask, config.eps_low, config.eps_high, normalizer)
    if isinstance(config, CispoLoss):
        return cispo_loss(logprobs, gen_logprobs, advantages, mask, config.eps_low, config.eps_high, normalizer)
    if isinstance(config, ReinforceLoss):
        return reinforce_loss(logprobs, gen_logprobs, advantages, mask, config.correction, config.level, config.cap,
                              normalizer)
    raise ValueError(f"unknown loss {config!r}")


def aipo_loss(
    logprobs: Tensor,
    gen_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rho: float,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AIPO loss ``-(1/N) * sum_{b,t} mask * w_bt * A_bt * log pi(y_bt)``, ``w = min(pi/mu, rho)``.

    ``w = min(exp(log pi - log mu), rho)`` is detached and clipped from above only: it corrects
    for the generator's (stale) policy mu without letting one token dominate. The gradient with
    respect to ``log pi(y_bt)`` is therefore ``-w_bt * A_bt / N`` on masked tokens and 0 elsewhere.

    Args:
        logprobs: ``[B, T]`` trainer's log pi of each sampled token (requires grad).
        gen_logprobs: ``[B, T]`` generator's log mu of the same tokens.
        advantages: ``[B]`` one advantage per sequence (``A_bt = A_b``), or ``[B, T]`` one per token.
        mask: ``[B, T]`` bool or 0/1: the completion tokens that count.
        rho: upper clip of the importance weight.
        normalizer: N; defaults to the number of masked tokens. Under data parallelism pass the
            global token count so every token weighs the same on every rank. Clamped to >= 1, so
            an empty mask gives a zero loss that still backpropagates (zero grads, no NaN).
    Returns:
        ``(loss, metrics)``; metrics are floats over masked tokens, computed without grad:
        ``clip_fraction`` (share of tokens whose weight the loss clipped or masked: here pi/mu > rho),
        ``ess`` (normalised effective sample size of the unclipped ratios r: ``(sum r)^2 / (n * sum r^2)``,
        1.0 when all equal), ``logprob_gap`` (mean ``|log pi - log mu|``), ``ratio_mean`` (mean r),
        ``tokens`` (n). With no masked token: clip_fraction 0, ess 1, logprob_gap 0, ratio_mean 1, tokens 0,
        the values of a batch with nothing off-policy in it, so dashboards show no false alarm.
    """
    return reinforce_loss(logprobs, gen_logprobs, advantages, mask, "tis", "token", rho, normalizer)


def reinforce_loss(logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor, mask: Tensor, correction: str,
                   level: str, cap: float, normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """``-(1/N) sum mask * w * A * log pi``: w detached, 1 (`none`), ``min(rho, cap)`` (`tis`) or
    ``rho * [rho <= cap]`` (`mis`), where rho is pi/mu of the token (`token`) or the product over the sequence's
    tokens (`sequence`)."""
    mask, log_ratio, advantages = _checked(logprobs, gen_logprobs, advantages, mask)
    if level == "sequence":
        log_ratio = torch.where(mask, log_ratio.sum(1, keepdim=True).clamp(max=MAX_LOG_RATIO), 0.0)
    ratio = log_ratio.exp()
    over = mask & (ratio > cap) if correction != "none" else torch.zeros_like(mask)
    weights = {"none": torch.ones_like(ratio), "tis": ratio.clamp(max=cap),
               "mis": torch.where(over, 0.0, ratio)}[correction]
    per_token = -weights * advantages * logprobs
    return token_mean(per_token, mask, normalizer), _metrics(logprobs, gen_logprobs, mask, over)


def ppo_loss(logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
             eps_high: float, normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """``-(1/N) sum mask * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, r = pi/mu of the token (with
    gradient). Clipped: tokens where the clipped term is the smaller one and differs (no gradient then)."""
    mask, _, advantages = _checked(logprobs, gen_logprobs, advantages, mask)
    ratio = torch.where(mask, logprobs - gen_logprobs, 0.0).clamp(max=MAX_LOG_RATIO).exp()
    surrogate, clipped = _clipped_surrogate(ratio, advantages, eps_low, eps_high)
    return token_mean(-surrogate, mask, normalizer), _metrics(logprobs, gen_logprobs, mask, mask & clipped)


def gspo_loss(logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
              eps_high: float, normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate of the sequence ratio ``s_b = exp(mean_t log(pi/mu))`` (with gradient) against each
    token's advantage, ``min(s_b A_bt, clip(s_b) A_bt)``, counted per token: with ``[B]`` advantages, once per
    token of the sequence."""
    mask, _, advantages = _checked(logprobs, gen_logprobs, advantages, mask)
    lengths = mask.sum(1).clamp(min=1)
    mean_log = (torch.where(mask, logprobs - gen_logprobs, 0.0).sum(1) / lengths).clamp(max=MAX_LOG_RATIO)
    surrogate, clipped = _clipped_surrogate(mean_log.exp()[:, None], advantages, eps_low, eps_high)
    return token_mean(-surrogate, mask, normalizer), _metrics(logprobs, gen_logprobs, mask, mask & clipped)


def cispo_loss(logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
               eps_high: float, normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """``-(1/N) sum mask * sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi``: every token keeps its
    gradient, only its weight is clipped."""
    mask, log_ratio, advantages = _checked(logprobs, gen_logprobs, advantages, mask)
    ratio = log_ratio.exp()
    weights = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = mask & (weights != ratio)
    return token_mean(-weights * advantages * logprobs, mask, normalizer), \
        _metrics(logprobs, gen_logprobs, mask, clipped)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """``min(r A, clip(r) A)`` and where the clip decided it."""
    unclipped = ratio * advantages
    bounded = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    return torch.minimum(unclipped, bounded), bounded < unclipped


def _checked(logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor,
             mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The bool mask, the detached, guarded log pi/mu of the masked tokens (0 elsewhere) and the ``[B, T]``
    advantage of each token (a ``[B]`` one expanded, so that both shapes give the same sums to the last bit)."""
    _check_shapes(logprobs, gen_logprobs, advantages, mask)
    mask = mask.bool()
    log_ratio = torch.where(mask, logprobs.detach() - gen_logprobs, 0.0).clamp(max=MAX_LOG_RATIO)
    return mask, log_ratio, advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages


def token_mean(per_token: Tensor, mask: Tensor, normalizer: float | Tensor | None) -> Tensor:
    """``(1/N) sum mask * per_token``; N defaults to the masked tokens' count and is clamped to >= 1."""
    # where(), not a product with the mask: padding may hold -inf logprobs and -inf * 0 is NaN.
    if normalizer is None:
        normalizer = mask.sum()
    normalizer = torch.as_tensor(normalizer, dtype=per_token.dtype).clamp(min=1.0)
    return torch.where(mask, per_token, 0.0).sum() / normalizer


def _metrics(logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor, clipped: Tensor) -> dict[str, float]:
    with torch.no_grad():
        n = int(mask.sum())
        if n == 0:
            return dict(EMPTY_METRICS)
        raw = (logprobs.detach() - gen_logprobs)[mask].double()
        ratios = raw.clamp(max=MAX_LOG_RATIO).exp()
        return {
            "clip_fraction": float(clipped[mask].double().mean()),
            "ess": float(ratios.sum() ** 2 / (n * (ratios**2).sum())),
            "logprob_gap": float(raw.abs().mean()),
            "ratio_mean": float(ratios.mean()),
            "tokens": float(n),
        }


def _check_shapes(logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> None:
    if logprobs.dim() != 2 or gen_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, gen_logprobs and mask must all be [B, T], got "
            f"{tuple(logprobs.shape)}, {tuple(gen_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must be [B]={tuple(logprobs.shape[:1])} or [B, T]={tuple(logprobs.shape)}, "
                         f"got {tuple(advantages.shape)}")

