"""One trainer step: pack rollouts, recompute log pi under the current weights, apply AIPO.

Token ids come from the generator unchanged (the trainer never re-tokenizes), and log mu is the
generator's logprob of each sampled token under the temperature and top-p it sampled with.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from rlfleet.workers.rl.config import AipoLoss, KlPenalty, PolicyLoss
from rlfleet.workers.rl.kl import kl_loss
from rlfleet.workers.rl.losses import EMPTY_METRICS, policy_loss
from rlfleet.workers.rl.sampling import sampled_logprobs
from rlfleet.workers.trainer.micro_batches import micro_batches
from rlfleet.workers.trainer.sample import Sample
from rlfleet.workers.trainer.shared_prompts import SharedBatch, forward_of, pack_shared

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded batch. Columns of the ``[B, L-1]`` tensors are next-token targets:
    column t holds the token at position t + 1, predicted from positions 0..t."""

    input_ids: Tensor
    """``[B, L]`` prompt + completion, padded with pad_id on the right."""
    attention_mask: Tensor
    """``[B, L]`` 1 on real tokens."""
    targets: Tensor
    """``[B, L-1]`` input_ids shifted left by one."""
    completion_mask: Tensor
    """``[B, L-1]`` bool, True where the target is a completion token."""
    gen_logprobs: Tensor
    """``[B, L-1]`` float32 log mu of each target (0 outside the completion, or where not sampled)."""
    sampled: Tensor
    """``[B, L-1]`` bool, True where the policy sampled the target."""
    trained: Tensor
    """``[B, L-1]`` bool, True where the target enters the loss."""
    ref_logprobs: Tensor
    """``[B, L-1]`` float32 log pi_ref of each target (0 outside the completion, or without a reference)."""
    advantages: Tensor
    """``[B, L-1]`` float32 advantage of each target (0 outside the completion)."""

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack_samples(samples: Sequence[Sample], pad_id: int) -> PackedBatch:
    """Right-pad ``prompt_ids + completion_ids`` and align the completion with next-token targets."""
    if not samples:
        raise ValueError("pack_samples needs at least one sample")
    for index, sample in enumerate(samples):
        check_sample(index, sample)
    batch, length = len(samples), max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    completion_mask = torch.zeros((batch, length - 1), dtype=torch.bool)
    gen_logprobs = torch.zeros((batch, length - 1), dtype=torch.float32)
    sampled = torch.zeros((batch, length - 1), dtype=torch.bool)
    trained = torch.zeros((batch, length - 1), dtype=torch.bool)
    ref_logprobs = torch.zeros((batch, length - 1), dtype=torch.float32)
    advantages = torch.zeros((batch, length - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompt, completion = len(sample.prompt_ids), len(sample.completion_ids)
        input_ids[row, : prompt + completion] = torch.tensor(
            list(sample.prompt_ids) + list(sample.completion_ids), dtype=torch.long
        )
        attention_mask[row, : prompt + completion] = 1
        # The completion's first token is predicted from the last prompt position.
        completion_mask[row, prompt - 1 : prompt - 1 + completion] = True
        gen_logprobs[row, prompt - 1 : prompt - 1 + completion] = torch.tensor(
            list(sample.gen_logprobs), dtype=torch.float32
        )
        sampled[row, prompt - 1 : prompt - 1 + completion] = torch.tensor(list(sample.sampled), dtype=torch.bool)
        trained[row, prompt - 1 : prompt - 1 + completion] = torch.tensor(list(sample.trained), dtype=torch.bool)
        if sample.ref_logprobs:
            ref_logprobs[row, prompt - 1 : prompt - 1 + completion] = torch.tensor(
                list(sample.ref_logprobs), dtype=torch.float32)
        advantages[row, prompt - 1 : prompt - 1 + completion] = (
            torch.tensor(list(sample.token_advantages), dtype=torch.float32) if sample.token_advantages
            else float(sample.advantage))
    targets = input_ids[:, 1:].clone()
    return PackedBatch(input_ids, attention_mask, targets, completion_mask, gen_logprobs, sampled, trained,
                       ref_logprobs, advantages)


def token_logprobs(model: nn.Module, batch: PackedBatch, temperature: float, top_p: float) -> Tensor:
    """``[B, L-1]`` float32 log pi of each next-token target under the generators' sampling distribution: the
    reference path, logits of every position of the batch at once (the trainer shares prompts and chunks them,
    shared_prompts.py).

    The generator samples from temperature-scaled, top-p-truncated, renormalised logits and reports
    that distribution's logprobs, so pi must apply the same temperature and nucleus or pi/mu would be
    off even at equal weights (rl/sampling.py has the rule, what vLLM does, and the edge cases).
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    # The last position predicts past the sequence: drop it before the float32 copy.
    return sampled_logprobs(out.logits[:, :-1], batch.targets, temperature, top_p)


@dataclass(frozen=True)
class Passes:
    """How one step's forward and backward are cut up; the loss and its gradient do not depend on it.

    The defaults are the reference path: the whole batch in one pass, logits of every position at once
    (`token_logprobs`). With `chunk_tokens`, samples are packed end to end, share their prompt's forward, and log pi
    is computed in one pass or `chunk_tokens` completion tokens at a time (shared_prompts.py).
    """

    micro_batch_tokens: int | None = None
    """Tokens per forward/backward (micro_batches.py counts them), gradients accumulated over them; None: the whole
    batch at once."""
    chunk_tokens: int | None = None
    """Completion tokens whose logits exist at once when the micro-batch's do not fit in memory; None: the reference
    path."""


@dataclass(frozen=True)
class Padding:
    """A sample with no completion: a micro-batch of it adds nothing to the loss or the gradient, but runs
    the same collectives, so that every rank does as many passes as the busiest one (FSDP needs that)."""

    prompt_ids: list[int]
    completion_ids: tuple = ()
    gen_logprobs: tuple = ()
    sampled: tuple = ()
    trained: tuple = ()
    ref_logprobs: tuple = ()
    advantage: float = 0.0
    token_advantages: tuple = ()


def plan_passes(samples: Sequence[Sample], passes: Passes, count: int | None = None) -> list[list[Sample]]:
    """This rank's micro-batches, padded to `count` with ones that add nothing."""
    batches = micro_batches(samples, passes.micro_batch_tokens, shared=passes.chunk_tokens is not None)
    return batches + [[Padding(list(samples[0].prompt_ids))]] * ((count or 0) - len(batches))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    *,
    loss: PolicyLoss = AipoLoss(),
    temperature: float,
    top_p: float,
    grad_clip: float,
    pad_id: int,
    normalizer: float | None = None,
    world_size: int = 1,
    before_update: Callable[[], object] | None = None,
    passes: Passes = Passes(),
    micro_batch_count: int | None = None,
    kl: KlPenalty | None = None,
) -> dict[str, float]:
    """Pack, forward, policy loss (`loss`), backward (per micro-batch), clip, step. Returns loss, grad_norm and the
    loss's off-policy metrics.

    Runs in the model's current mode: keep dropout off so pi equals mu at equal weights.
    With DDP or FSDP pass the wrapped model, ``normalizer`` = the trained tokens over all ranks,
    ``world_size`` and ``micro_batch_count`` = the most micro-batches any rank has (plan_passes); ``loss``
    and the AIPO metrics in the result are then over all ranks' samples (an all-reduce of the default
    process group). The forward computes in the dtype of the parameters it sees, with no autocast: the
    trainer's FSDP units gather their float32 shards in the job's dtype (world.shard). ``before_update`` runs
    just before the optimizer changes the weights. A step whose gradient norm is not finite is skipped
    (``skipped`` = 1.0); after the gradients' all-reduce every rank sees the same norm, so all ranks skip
    together.

    With ``kl`` (a job with a reference executor, whose log pi_ref every sample carries) the result has
    ``kl_mean``, the token mean of the KL estimate, and a KL used as a loss joins the loss (rl/kl.py).
    """
    device = next(model.parameters()).device
    if normalizer is None:  # every micro-batch's loss is divided by the whole batch's token count
        normalizer = trained_tokens(samples)
    batches = plan_passes(samples, passes, micro_batch_count)
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
    for index, micro in enumerate(batches):
        if isinstance(model, FSDPModule):  # reduce the accumulated gradients once, after the last micro-batch
            model.set_requires_gradient_sync(index == len(batches) - 1)
        value, metrics = _micro_batch_loss(model, micro, passes, pad_id, device, temperature, top_p, loss,
                                           normalizer, kl)
        # DDP averages gradients over ranks; the loss is already divided by the global token count,
        # so scaling by world_size turns that average back into the sum over all ranks' tokens.
        (value * world_size).backward()
        sums += batch_sums(value, metrics, device)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    skipped = update(optimizer, grad_norm, before_update)
    return step_metrics(sums, grad_norm, skipped, kl, reduce=world_size > 1)


def update(optimizer: torch.optim.Optimizer, grad_norm: float, before_update: Callable[[], object] | None) -> bool:
    """The optimizer step on the accumulated (clipped) gradients, skipped when their norm is not finite; then the
    gradients are cleared. Returns whether it was skipped."""
    skipped = not math.isfinite(grad_norm)
    if skipped:
        log.warning("gradient norm is %s: optimizer step skipped", grad_norm)
    else:
        if before_update is not None:  # e.g. weight sends still reading these parameters
            before_update()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped


def step_metrics(sums: Tensor, grad_norm: float, skipped: bool, kl: KlPenalty | None,
                 reduce: bool) -> dict[str, float]:
    """A step's result from its micro-batches' `sums` (SUMS), added up over the default group's ranks if `reduce`."""
    if reduce:
        dist.all_reduce(sums)
    total, metrics = _from_sums(sums)
    if kl is None:
        del metrics["kl_mean"]
    return {"loss": total, "grad_norm": grad_norm, "skipped": float(skipped), **metrics}


def _micro_batch_loss(model: nn.Module, samples: Sequence[Sample], passes: Passes, pad_id: int, device: torch.device,
                      temperature: float, top_p: float, loss: PolicyLoss, normalizer: float,
                      kl: KlPenalty | None) -> tuple[Tensor, dict[str, float]]:
    shared = passes.chunk_tokens is not None
    batch = (pack_shared(samples) if shared else pack_samples(samples, pad_id)).to(device)
    if shared:
        logprobs = forward_of(model)(batch, temperature, top_p, passes.chunk_tokens)
    else:
        logprobs = token_logprobs(model, batch, temperature, top_p)
    return batch_loss(batch, logprobs, loss, normalizer, kl)


def batch_loss(batch: PackedBatch | SharedBatch, logprobs: Tensor, loss: PolicyLoss, normalizer: float,
               kl: KlPenalty | None) -> tuple[Tensor, dict[str, float]]:
    """A micro-batch's loss (its share of the step's, divided by the step's `normalizer`) and its metrics, from its
    log pi."""
    # A token the policy did not sample (a guide's, controller/guidance.py) has mu taken as pi: ratio 1.
    gen_logprobs = torch.where(batch.sampled, batch.gen_logprobs, logprobs.detach())
    value, metrics = policy_loss(loss, logprobs, gen_logprobs, batch.advantages, batch.trained, normalizer)
    if kl is None:
        return value, metrics | {"kl_mean": 0.0}
    coef = kl.coef if kl.use == "loss" else 0.0  # as a reward penalty it acted on the advantages already
    term, metrics["kl_mean"] = kl_loss(logprobs, gen_logprobs, batch.ref_logprobs, batch.trained,
                                       kl.estimator, coef, normalizer)
    return value + term, metrics


# What adds up over micro-batches and ranks; the AIPO metrics and the KL mean are ratios of these.
SUMS = ("loss", "tokens", "clipped", "gap", "ratios", "squares", "kl")


def batch_sums(loss: Tensor, metrics: dict[str, float], device: torch.device) -> Tensor:
    """A micro-batch's SUMS, which add up over micro-batches and ranks."""
    n = metrics["tokens"]
    ratios = metrics["ratio_mean"] * n
    # ess = (sum r)^2 / (n * sum r^2), so the sum of squared ratios is (sum r)^2 / (n * ess).
    squares = ratios**2 / (n * metrics["ess"]) if n else 0.0
    return torch.tensor([float(loss.detach()), n, metrics["clip_fraction"] * n, metrics["logprob_gap"] * n,
                         ratios, squares, metrics["kl_mean"] * n], dtype=torch.float64, device=device)


def _from_sums(sums: Tensor) -> tuple[float, dict[str, float]]:
    """The loss and AIPO metrics of all the summed samples together (one micro-batch's or rank's own means
    describe only its share of the batch)."""
    total, n, clipped, gap, ratios, squares, kl = sums.tolist()
    if n == 0:
        return total, EMPTY_METRICS | {"kl_mean": 0.0}
    return total, {"clip_fraction": clipped / n, "ess": ratios**2 / (n * squares), "logprob_gap": gap / n,
                   "ratio_mean": ratios / n, "tokens": n, "kl_mean": kl / n}


def trained_tokens(samples: Sequence[Sample]) -> int:
    """The tokens that enter the loss: a step's loss is their mean."""
    return sum(sum(sample.trained) for sample in samples)


def check_sample(index: int, sample: Sample) -> None:
    """ValueError naming what is wrong with sample `index` (its per-token lists' lengths, an empty prompt)."""
    if not sample.prompt_ids:
        raise ValueError(f"sample {index}: empty prompt (the first completion token needs a context)")
    if sample.ref_logprobs and len(sample.ref_logprobs) != len(sample.completion_ids):
        raise ValueError(f"sample {index}: {len(sample.ref_logprobs)} ref_logprobs for "
                         f"{len(sample.completion_ids)} completion tokens")
    if sample.token_advantages and len(sample.token_advantages) != len(sample.completion_ids):
        raise ValueError(f"sample {index}: {len(sample.token_advantages)} token_advantages for "
                         f"{len(sample.completion_ids)} completion tokens")
    for name in ("gen_logprobs", "sampled", "trained"):
        if len(getattr(sample, name)) != len(sample.completion_ids):
            raise ValueError(f"sample {index}: {len(getattr(sample, name))} {name} for "
                             f"{len(sample.completion_ids)} completion tokens")
