"""Cutting a step's samples into micro-batches of at most a token budget (padding included)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Pending:
    """A micro-batch being filled, and what its padded size depends on."""

    samples: list = field(default_factory=list)
    prompts: set = field(default_factory=set)
    longest_prompt: int = 0
    longest_completion: int = 0
    longest_sample: int = 0

    def cost_with(self, sample, shared: bool) -> int:
        """Tokens the forward processes with `sample` added: each distinct prompt once when `shared` (and the
        completions after it, less the last token), else every sample's prompt + completion padded to the longest."""
        count = len(self.samples) + 1
        if not shared:
            return count * max(self.longest_sample, len(sample.prompt_ids) + len(sample.completion_ids))
        prompts = len(self.prompts | {tuple(sample.prompt_ids)})
        prompt = max(self.longest_prompt, len(sample.prompt_ids))
        completion = max(self.longest_completion, len(sample.completion_ids))
        return prompts * prompt + count * max(1, completion - 1)

    def add(self, sample) -> None:
        self.samples.append(sample)
        self.prompts.add(tuple(sample.prompt_ids))
        self.longest_prompt = max(self.longest_prompt, len(sample.prompt_ids))
        self.longest_completion = max(self.longest_completion, len(sample.completion_ids))
        self.longest_sample = max(self.longest_sample, len(sample.prompt_ids) + len(sample.completion_ids))


def micro_batches(samples: Sequence, token_budget: int | None, shared: bool) -> list[list]:
    """Samples (policy.Sample) in micro-batches of at most `token_budget` padded tokens (a lone sample over
    it is a micro-batch of its own); None: one micro-batch. Samples of one prompt are kept next to each
    other, so that they share its forward (`shared`)."""
    if token_budget is None:
        return [list(samples)]
    first_seen: dict[tuple[int, ...], int] = {}
    ordered = sorted(samples, key=lambda s: first_seen.setdefault(tuple(s.prompt_ids), len(first_seen)))
    batches, pending = [], _Pending()
    for sample in ordered:
        if pending.samples and pending.cost_with(sample, shared) > token_budget:
            batches.append(pending.samples)
            pending = _Pending()
        pending.add(sample)
    return batches + [pending.samples]
