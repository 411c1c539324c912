"""Writing an environment: a class whose `reset` opens an episode for one example and whose `step` answers each of
the policy's turns, until it says the episode is done.

    class Guess(Environment):
        def reset(self, example):
            self.target = int(example.answer)
            return None                      # the data's own prompt opens the chat

        def step(self, reply):
            guess = int(reply.strip() or 0)
            if guess == self.target:
                return Step(reward=1.0, done=True)
            return Step(messages=[{"role": "user", "content": "higher" if guess < self.target else "lower"}])

The executor renders the environment's messages with the model's chat template and appends their tokens to the
policy's own: the policy's tokens are never re-tokenised (workers/environment/episode.py). One instance serves one
episode, in a thread of the environment executor; a step that raises or hangs ends that episode, counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
"""A chat turn: {"role": ..., "content": ...}, as chat templates take them."""


@dataclass
class Step:
    """What the environment answers to one of the policy's turns."""

    messages: list[Message] = field(default_factory=list)
    """Its next turns ({role, content}, role "tool" or "user"), which the policy answers; none once done."""
    reward: float = 0.0
    """Added to the episode's reward, on top of what the job's scorers give its final answer."""
    done: bool = False
    tool_calls: dict[str, int] = field(default_factory=dict)
    """Tools this step ran, by tool name (the metrics' tool_calls)."""
    tool_errors: dict[str, int] = field(default_factory=dict)
    """Of those, the ones that failed, by tool name ("malformed" for a call that did not parse)."""


class Environment:
    """One episode's environment. Subclass it; an instance lives for one episode."""

    tools: list[dict[str, Any]] = []
    """JSON schemas of the tools the policy may call, as chat templates take them (`tools=`): tools.py's."""

    def reset(self, example: Any) -> list[Message] | None:
        """A new episode for `example` (workers/data/tasks.py Example: prompt, answer, fields, messages). Returns the
        opening chat, or None for the data's own (its messages, or its prompt as the one user turn)."""
        return None

    def step(self, reply: str) -> Step:
        """The policy's turn, as text; returns the environment's answer."""
        raise NotImplementedError

    def close(self) -> None:
        """The episode ended (done, a limit, or an error): free what it holds."""
