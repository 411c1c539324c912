"""PPO's epochs and mini-batches: several optimizer steps per batch (algorithm.epochs, miniBatches).

An epoch cuts the batch into mini-batches, one optimizer step (policy.train_step) each, and deals each mini-batch
to the ranks as a single step deals the batch (``[rank::world_size]``), so the steps are the same whatever the
number of ranks. Every rank computes the whole plan, the other ranks' shares included, so that all agree on each
step's token count over ranks (its normalizer) and on the most micro-batches any rank has (FSDP pairs up the
collectives); a rank with nothing for a step runs it on padding, which adds nothing.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rlfleet.workers.trainer.pipeline import Pipeline, filling, pipeline_step
from rlfleet.workers.trainer.policy import Padding, Passes, Sample, plan_passes, train_step, trained_tokens


def train_epochs(model: nn.Module, optimizer: torch.optim.Optimizer, rollouts: Sequence[Sample], *, step: int,
                 seed: int, epochs: int = 1, mini_batches: int = 1, rank: int = 0, world_size: int = 1,
                 passes: Passes = Passes(), before_update: Callable[[], object] | None = None,
                 pipeline: Pipeline | None = None, **options) -> dict[str, float]:
    """`epochs` passes over the whole batch `rollouts` (every rank's samples), each in `mini_batches` optimizer
    steps, the order of each epoch's mini-batches picked by `seed`, `step` and the epoch. `options` go to every
    train_step (loss, temperature, top_p, grad_clip, pad_id, kl).

    ``before_update`` runs once, before the first step that changes the weights. Returns the last epoch's metrics
    (train_step's, token-weighted over its steps; ``tokens`` their sum), ``skipped`` (steps skipped over all
    epochs), ``epochs`` and ``optimizer_steps`` (the steps taken). One epoch of one mini-batch is train_step on
    the rank's share, exactly. With a `pipeline`, `rank` and `world_size` are its index and the pipelines' count,
    and each step is this stage's part of it (pipeline.pipeline_step).
    """
    once = functools.cache(before_update) if before_update else None  # cache: a zero-argument call runs once
    results = []
    for epoch in range(epochs):
        plan = mini_batch_plan(rollouts, world_size, mini_batches, random.Random(f"{seed}/{step}/{epoch}"))
        results.append([_step(model, optimizer, shares, rank, passes, pipeline, world_size=world_size,
                              before_update=once, **options) for shares in plan])
    skipped = sum(result["skipped"] for epoch in results for result in epoch)
    return _merged(results[-1]) | {"skipped": skipped, "epochs": float(epochs),
                                   "optimizer_steps": sum(map(len, results)) - skipped}


def mini_batch_plan(rollouts: Sequence[Sample], world_size: int, mini_batches: int,
                    rng: random.Random) -> list[list[list[Sample]]]:
    """One epoch's steps: ``plan[k][r]`` is rank r's samples for step k.

    The batch is cut into at most `mini_batches` runs of nearly equal numbers of samples (no more runs than
    samples, so that every step trains on something), each dealt to the ranks as a whole batch is,
    ``run[r::world_size]``. With several runs the prompt groups are shuffled first (by `rng`) and kept together.
    A rank with nothing in a run gets padding.
    """
    count = min(mini_batches, len(rollouts))
    # One run keeps the batch's order: it fixes the float sums, so the step is exactly a plain train_step's.
    ordered = list(rollouts) if count == 1 else _shuffled_groups(rollouts, rng)
    runs = [ordered[k * len(ordered) // count : (k + 1) * len(ordered) // count] for k in range(count)]
    padding = [Padding(list(rollouts[0].prompt_ids))]
    return [[run[r::world_size] or padding for r in range(world_size)] for run in runs]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, shares: list[list[Sample]], rank: int,
          passes: Passes, pipeline: Pipeline | None, **options) -> dict[str, float]:
    """One optimizer step on ``shares[rank]``; its loss is the token mean over every rank's share.

    Without a KL term, a sample whose advantage is 0 on every token (a group whose rewards were all equal) adds
    exactly 0 to the loss and its gradient: it is not run, and the step is the same, only cheaper. It still counts
    in the normalizer. The step's metrics (clip fraction, ratios) are then over the samples that ran.
    """
    tokens = trained_tokens([sample for share in shares for sample in share])
    if options.get("kl") is None:
        shares = [[s for s in share if _has_advantage(s)] or [Padding(list(share[0].prompt_ids))]
                  for share in shares]
    train = train_step
    if pipeline is not None:
        passes = filling(shares, passes, pipeline.stages)
        train = functools.partial(pipeline_step, pipeline=pipeline)
    count = max(len(plan_passes(share, passes)) for share in shares)  # as many passes as the busiest rank
    return train(model, optimizer, shares[rank], normalizer=tokens, passes=passes, micro_batch_count=count,
                 **options)


def _has_advantage(sample: Sample) -> bool:
    return sample.advantage != 0.0 or any(a != 0.0 for a in sample.token_advantages)


def _shuffled_groups(samples: Sequence[Sample], rng: random.Random) -> list[Sample]:
    """The samples, those of one prompt next to each other, the prompts in a random order."""
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for sample in samples:
        groups.setdefault(tuple(sample.prompt_ids), []).append(sample)
    order = list(groups.values())
    rng.shuffle(order)
    return [sample for group in order for sample in group]


def _merged(results: list[dict[str, float]]) -> dict[str, float]:
    """One epoch's step metrics as one: each a token-weighted mean (equal weights without tokens), tokens summed."""
    tokens = sum(result["tokens"] for result in results)
    weights = [result["tokens"] / tokens if tokens else 1 / len(results) for result in results]
    merged = {name: sum(w * result[name] for w, result in zip(weights, results)) for name in results[0]}
    return merged | {"tokens": tokens}
