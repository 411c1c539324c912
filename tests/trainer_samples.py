"""The least a trainer needs of a rollout (policy.Sample): for tests that train without a controller."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    gen_logprobs: list[float]
    advantage: float
