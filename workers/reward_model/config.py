"""What a reward-model pod is (`spec.roles.rewardModel`, role id `reward`). Torch-free: part of the RLJob schema.

A learned reward model: a Hugging Face `AutoModelForSequenceClassification` directory with one label (num_labels=1)
and its own tokenizer; its architecture need not be the policy's. It serves the Scorer service: every completion is
read as its prompt followed by the completion, and its score, times `weight`, adds to the rule scorers' sum.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlfleet.workers.roles import Resources, Role, one_gpu_at_most

# The name a failed forward puts in Score.errors and in rlfleet_scorer_errors_total{scorer}.
ERROR_NAME = "reward_model"


class RewardModelRole(Role):
    path: str = Field(min_length=1, max_length=4096)
    """The model's HF directory (config.json with num_labels 1, weights, tokenizer), as its pods see it: on a
    cluster, under one of spec.storage.volumes mounted for the `reward` role."""
    weight: float = Field(1.0, ge=-1000.0, le=1000.0)
    """Factor of the model's score in the reward: reward = sum of the rule scorers + weight x score."""
    batch_size: int = Field(32, ge=1, le=4096)
    """Sequences per forward pass."""
    timeout_seconds: float = Field(1.0, gt=0.0, le=600.0)
    """Per sequence: a forward slower than this times its batch's sequences scores them 0 and counts an error."""
    max_length: int = Field(2048, ge=8, le=1 << 20)
    """Tokens the model reads per sequence; a longer one keeps its end (the completion)."""
    template: Literal["plain", "chat"] = "plain"
    """plain: the prompt's text then the completion's, as one text. chat: the reward model's own chat template on
    a user turn (the prompt) and an assistant turn (the completion)."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """Unset: float32 on CPU, bfloat16 on a GPU."""

    @field_validator("resources")
    @classmethod
    def _one_gpu(cls, value: Resources) -> Resources:
        return one_gpu_at_most(value, "a reward-model replica", ": add replicas instead")
