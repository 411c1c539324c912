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

    def generate(self, sequences: list[SequenceIn], sampling: Sampling) -> list[SegmentOut]:
        """Sample one segment per sequence; logprobs are of the processed (temperature, top-p) distribution."""

    def join_sync_group(self, address: dict[str, Any], rank: int, layout: dict[str, Any]) -> None:
        """Join this replica's weight-sync group (see sync.weights) with a fixed bucket layout."""

    def receive_weights(self) -> tuple[float, float]:
        """Receive and load one weight version; returns (receive seconds, load seconds)."""
