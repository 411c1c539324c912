"""The trainer's input: one rollout as per-token lists. Torch-free, so that the controller, which builds them,
starts without the trainer's libraries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """What the trainer needs of one rollout, per-token lists (controller/rollouts.py training_samples builds them);
    any object with these attributes will do."""

    prompt_ids: list[int]
    completion_ids: list[int]
    gen_logprobs: list[float]
    """Generator's log mu of each completion token, one per token (0 where `sampled` is False)."""
    sampled: list[bool]
    """Whether the policy sampled each completion token. A token it did not sample but that trains (a guide's,
    controller/guidance.py) has its mu taken as pi: ratio 1, its loss term the advantage-weighted log-likelihood."""
    trained: list[bool]
    """Whether each completion token enters the loss; one that does not (an environment's observation) is context
    for the tokens after it and nothing else."""
    ref_logprobs: list[float]
    """The reference executor's log pi_ref of each completion token; empty in a job without a reference."""
    advantage: float
    token_advantages: list[float]
    """One advantage per completion token (GAE); empty: `advantage` for every token."""
