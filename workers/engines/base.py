"""What a generator engine must do; vLLM (the real one) and plain torch (the reference) both do it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SequenceIn:
    """A prompt and, for a resumed partial rollout, the completion tokens generated so far."""

    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass(frozen=True)
class SegmentOut:
    """Tokens one visit added, the log-prob each was sampled with, and whether the sequence ended."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    seed: int


class Engine(Protocol):
    max_model_len: int
    vocab_size: int
    concurrent_receive: bool
    """Whether receive_weights may run while generate runs (only load_weights stalls generation)."""

    def generate(self, sequences: list[SequenceIn], sampling: Sampling) -> list[SegmentOut]:
        """Sample one segment per sequence; logprobs are of the distribution sampled from, as rl/sampling.py
        defines it (temperature, then top-p); temperature 0 is greedy, with the raw logits' logprobs."""

    def join_sync_group(self, join: dict[str, Any]) -> None:
        """Join this replica's weight-sync group; `join` holds sync.shards.SyncSettings fields, host, port,
        epoch and the parameter shapes."""

    def receive_weights(self) -> float:
        """Receive this replica's shards of one weight version into staging buffers; returns seconds."""

    def load_weights(self) -> float:
        """Load the staged weights into the model (a safe point between generate calls); returns seconds."""
