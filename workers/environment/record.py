"""A session's calls to the generators' OpenAI-compatible endpoint (generator/openai_api.py), as training samples.

The endpoint records, for each call, the prompt token ids as it rendered them and the tokens it sampled with their
log mu and policy version. An agent's calls usually repeat the whole chat each time: when a call's prompt starts
with the previous call's prompt and completion, the new part of the prompt is the environment's turn (tool output,
feedback: unsampled) and its completion the policy's next turn. When it does not (the agent edited the history, or
the template writes the policy's reply differently from how it was sampled), a new sample starts whose prompt is
that call's prompt: the same prefix rule as episode.Conversation, and the sampled tokens are never re-tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfleet.workers.controller.rollouts import OBSERVATION, Turn, sampled_turn, unsampled_turn


@dataclass(frozen=True)
class Call:
    """One call of a session, as the endpoint served it."""

    prompt_ids: list[int]
    """The prompt as the generator saw it (a chat rendered with the model's template)."""
    token_ids: list[int]
    """The completion's tokens, as sampled (a stop string's included: the text returned ends before it)."""
    logprobs: list[float]
    """log mu of each completion token, under the temperature and top-p of the call (rl/sampling.py)."""
    version: int
    """The policy version that sampled the completion (one per call: weights load between calls only)."""
    temperature: float = 1.0
    top_p: float = 1.0
    finish_reason: str = "length"
    """"stop" (end of sequence or a stop string) or "length" (max_tokens)."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Call:
        return cls(**data)


@dataclass
class AgentSample:
    """One training sample of an agent's episode: its prompt and the turns after it."""

    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """The prompt and every turn's tokens: what the next call's prompt must start with to continue it."""
        return self.prompt_ids + [token for turn in self.turns for token in turn.token_ids]

    @property
    def version(self) -> int:
        """The newest policy version of the sample's context: what an unsampled turn appended to it carries."""
        return max((v for turn in self.turns for v in turn.versions), default=0)


def assemble(calls: list[Call]) -> list[AgentSample]:
    """A session's calls, in order, as training samples (the module's docstring says how)."""
    samples: list[AgentSample] = []
    for call in calls:
        current = samples[-1] if samples else None
        context = current.ids if current else None
        if context is not None and call.prompt_ids[:len(context)] == context:
            observation = call.prompt_ids[len(context):]
            if observation:
                current.turns.append(unsampled_turn(OBSERVATION, observation, current.version))
        else:
            current = AgentSample(list(call.prompt_ids))
            samples.append(current)
        if call.token_ids:
            current.turns.append(sampled_turn(call.token_ids, call.logprobs, [call.version] * len(call.token_ids)))
    return samples
