"""One episode's chat and its token record, token in and token out.

The policy's tokens are kept exactly as sampled and never re-tokenised; only the environment's turns are rendered
with the model's chat template, and appended. To render a turn, the whole chat is rendered with it: if the tokens
so far are an exact prefix of that rendering, the turn's tokens are what follows them. If not (the template rewrites
earlier turns, or the policy's reply tokenises differently from how the template writes it), appending would train
the policy on a context it never sees at inference: a new training sample starts instead, its prompt the rendering
(prime-rl's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlfleet.workers.environment.protocol import Message


@dataclass(frozen=True)
class Appended:
    """What an environment turn adds to the record: its tokens, or a new sample's prompt."""

    token_ids: list[int]
    restart_ids: list[int]
    """The whole rendered chat when it stopped being an exact prefix (token_ids is then empty)."""


class Conversation:
    """An episode's messages and the token ids of its current training sample (prompt, then every turn)."""

    def __init__(self, tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.messages = list(messages)
        self.ids = self.render()
        """The current sample's tokens: its prompt and the turns after it, as the generator saw them."""

    def render(self) -> list[int]:
        """The chat as the template writes it, ready for the policy's next turn."""
        return render_chat(self.tokenizer, self.messages, self.tools)

    def reply(self, token_ids: list[int]) -> str:
        """The policy's turn, as sampled: its tokens join the record; returns its text (special tokens left out)."""
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def observe(self, messages: list[Message]) -> Appended:
        """The environment's turn: appended as tokens if the rendering keeps the record as its prefix."""
        self.messages.extend(messages)
        rendered = self.render()
        if rendered[:len(self.ids)] == self.ids:
            appended = Appended(rendered[len(self.ids):], [])
        else:
            appended = Appended([], rendered)
        self.ids = rendered
        return appended


def render_chat(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """`messages` as the model's chat template writes them, ready for the policy's next turn (token ids)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(token) for token in ids]
