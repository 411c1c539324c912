"""KL(pi || pi_ref) against the reference executor (spec.algorithm.kl): the k1, k2 and k3 estimators (Schulman,
"Approximating KL divergence"), as a loss term or as a reward penalty.

Each estimator is a function of the per-token log-ratio ``d = log pi - log pi_ref`` of a token sampled from pi:
``k1 = d`` (unbiased, can be negative), ``k2 = d^2 / 2`` (biased, low variance), ``k3 = exp(-d) - 1 + d``
(unbiased and never negative). Unbiased as *values*; as a loss, what counts is the expected gradient through
``log pi`` (docs/algorithms.md: Reference policy and KL; tests/unit/test_kl.py enumerates it on a small softmax):
k1's is 0, k2's is that of KL(pi || pi_ref), k3's that of KL(pi_ref || pi). As a reward penalty only k1's is that
of KL(pi || pi_ref). The spec refuses the other two combinations (KlPenalty). Pure functions, checked against
plain-float references like the losses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlfleet.workers.rl.losses import MAX_LOG_RATIO

# A completion token can have no mass under the reference's top-p nucleus (log pi_ref = -inf): the log-ratio is
# bounded so that one such token costs a large but finite penalty, never an inf or NaN loss.
MAX_KL_LOG_RATIO = 20.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from ``log pi`` (with or without grad) and ``log pi_ref``."""
    d = (logprobs - ref_logprobs).clamp(-MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r} (k1, k2 or k3)")


def kl_loss(logprobs: Tensor, gen_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str, coef: float,
            normalizer: float | Tensor | None = None) -> tuple[Tensor, float]:
    """``coef * (1/N) sum mask * w * k(log pi - log pi_ref)`` (gradient through log pi) and the token mean of the
    estimate itself (the `kl_mean` metric, without the coefficient or w). N as in the policy losses: the masked
    tokens by default, the whole batch's under micro-batching.

    ``w = pi/mu`` of the token, detached: the tokens were sampled by the generator's mu (stale by up to
    maxStaleness versions), and the weight makes the expected gradient the one under pi. It is not clipped, so
    that expectation stays exact; it is bounded like the losses' ratio (exp 20) and the step by grad_clip."""
    mask = mask.bool()
    per_token = torch.where(mask, kl_estimate(logprobs, torch.where(mask, ref_logprobs, 0.0), estimator), 0.0)
    log_ratio = torch.where(mask, logprobs.detach() - gen_logprobs, 0.0).clamp(max=MAX_LOG_RATIO)
    n = mask.sum()
    norm = torch.as_tensor(n if normalizer is None else normalizer, dtype=per_token.dtype).clamp(min=1.0)
    mean = float(per_token.detach().sum() / n.clamp(min=1))
    return coef * (log_ratio.exp() * per_token).sum() / norm, mean


def kl_penalties(gen_logprobs: Sequence[Sequence[float]], ref_logprobs: Sequence[Sequence[float]], estimator: str,
                 coef: float) -> list[float]:
    """Per completion, ``coef * sum_t k(log mu_t - log pi_ref_t)`` over the tokens given (those the policy sampled):
    the KL of the policy that sampled them, subtracted from its reward before advantages (the reward-penalty form of
    RLHF; mu is the sampling policy's logprob)."""
    penalties = []
    for mu, ref in zip(gen_logprobs, ref_logprobs, strict=True):
        if len(mu) != len(ref):
            raise ValueError(f"{len(ref)} reference logprobs for {len(mu)} completion tokens")
        tokens = kl_estimate(torch.tensor(mu, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), estimator)
        penalties.append(coef * float(tokens.sum()))
    return penalties
