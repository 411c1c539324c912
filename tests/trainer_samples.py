"""The least a trainer needs of a rollout (policy.Sample): for tests that train without a controller."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    gen_logprobs: list[float]
    advantage: float
    ref_logprobs: list[float] = field(default_factory=list)
    token_advantages: list[float] = field(default_factory=list)
    sampled: list[bool] | None = None
    """None: every completion token sampled."""
    trained: list[bool] | None = None
    """None: every completion token trained."""

    def __post_init__(self):
        self.sampled = [True] * len(self.completion_ids) if self.sampled is None else self.sampled
        self.trained = [True] * len(self.completion_ids) if self.trained is None else self.trained
