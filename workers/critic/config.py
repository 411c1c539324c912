"""What a critic pod is (`spec.roles.critic`). Torch-free: part of the RLJob schema.

The critic is the policy's backbone (spec.model, loaded from its storage) with a value head that starts at zero. It
values every completion token when its rollout finishes and learns from the GAE returns of each batch the trainer
trains (algorithm.advantage: gae), with the algorithm's epochs and mini-batches, on ranks of its own: ranksPerPod
processes (one per GPU) that shard the value model FSDP2-style and share each batch.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from rlfleet.workers.roles import RankedRole


class CriticRole(RankedRole):
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate of the value model."""
    value_clip: float = Field(0.2, ge=0.0, le=1e6)
    """PPO's value clipping: a token's new value moves at most this far from the value it had at sampling time in
    the loss's clipped term; 0 turns the clipping off."""
    grad_clip: float = Field(1.0, gt=0.0, le=1e6)
    """Max global gradient norm of the value model."""

    @field_validator("replicas")
    @classmethod
    def _one_pod(cls, value: int) -> int:
        if value != 1:
            raise ValueError("the critic runs in one pod, whose ranks restart together: set 1, and give it more "
                             "GPUs (resources.gpu, one rank each) to train a larger value model")
        return value
