"""Who generates what: the one owner of the work not yet taken and of every generator replica's state.

Producers (one per replica) take batches here; the links report which policy version each replica
holds and whether it is up. Both live under one lock, and every change that can make some waiting
producer's next batch startable (a batch handed back, a replica up again, newer weights) wakes them
all. A producer holds no batch while it waits, so work handed back by a failed replica goes to any
live replica that may start it, whatever the interleaving: at maxStaleness 0 a producer that held
batch k + 1 while waiting for version k + 1 would wait forever if batch k came back to the feed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rlfleet.workers.controller.ledger import TOO_LONG, PromptLedger
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.rollouts import Group, Stopped


@dataclass(frozen=True)
class Prompt:
    """One example of the training stream, tokenized."""

    position: int
    """Where it is in the stream (the prompt ledger's key)."""
    example: Any
    ids: list[int]


@dataclass
class Claim:
    """Batch `index`: it trains at step `index`, so it may start on weights of version >= index - maxStaleness."""

    index: int
    prompts: list[Prompt]
    data_position: int
    """Examples consumed up to and including this batch."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Prompts of this batch written down as not trainable, by ledger outcome."""
    failures: int = 0
    """Generate calls for this batch that failed with an engine error (not a lost replica)."""
    groups: list[Group] | None = None
    """Its groups once a producer started them: a batch handed back keeps every token already generated."""


class PromptFeed:
    """Batch k is the next `promptsPerStep` prompts of the stream that fit the generators' budget.

    A prompt longer than `max_prompt_tokens` could never be generated: it is written down once as
    dropped (TOO_LONG) and skipped. Groups a checkpoint saved (`restored`, partial rollouts included)
    are handed out in place of their examples.
    """

    def __init__(self, examples: Iterator[Any], first_batch: int, last_batch: int, per_batch: int, position: int,
                 encode: Callable[[Any], list[int]], max_prompt_tokens: int, ledger: PromptLedger,
                 restored: list[Group] | None = None):
        self._examples = examples
        self._next = first_batch
        self._last = last_batch
        self._per_batch = per_batch
        self._position = position
        self._encode = encode
        self._max_prompt_tokens = max_prompt_tokens
        self._ledger = ledger
        self._restored = {g.position: g for g in restored or []}

    def peek(self) -> int | None:
        """Index of the next new batch, or None when every batch was handed out."""
        return self._next if self._next < self._last else None

    def take(self) -> Claim:
        """The next new batch (the caller checked `peek`)."""
        claim = Claim(self._next, [], self._position)
        self._next += 1
        while len(claim.prompts) < self._per_batch and (example := next(self._examples, None)) is not None:
            position, self._position = self._position, self._position + 1
            group = self._restored.get(position)
            ids = group.rollouts[0].prompt_ids if group else self._encode(example)
            if len(ids) > self._max_prompt_tokens:
                self._ledger.dropped(position, claim.index + 1, TOO_LONG)
                claim.dropped[TOO_LONG] = claim.dropped.get(TOO_LONG, 0) + 1
                continue
            claim.prompts.append(Prompt(position, example, ids))
        claim.data_position = self._position
        return claim

    def restored(self, position: int) -> Group | None:
        """The saved group of the prompt at `position`, once."""
        return self._restored.pop(position, None)


class Dispatch(ReplicaStates):
    """Open batches (new and handed back) and every replica's version and liveness, under one lock."""

    def __init__(self, feed: PromptFeed, replicas: int, version: int, max_staleness: int):
        super().__init__(replicas, version)
        self.feed = feed
        self.max_staleness = max_staleness
        self._returned: list[Claim] = []

    def claim(self, replica: int) -> Claim:
        """The lowest open batch, once `replica` is up and holds weights fresh enough for it.

        Blocks while there is none (more may come back from a failed replica); Stopped at the end.
        """
        with self._cond:
            while True:
                if self._stopped:
                    raise Stopped()
                index = self._lowest_open()
                if self._up[replica] and index is not None and self._versions[replica] >= index - self.max_staleness:
                    return self._returned.pop(0) if self._returned else self.feed.take()
                self._cond.wait()

    def give_back(self, claim: Claim) -> None:
        """A batch whose replica failed: the next producer that may start it takes it first."""
        with self._cond:
            self._returned.append(claim)
            self._returned.sort(key=lambda c: c.index)
            self._cond.notify_all()

    def _lowest_open(self) -> int | None:
        """Handed-back batches are older than any new one, so the lowest open index is here."""
        return self._returned[0].index if self._returned else self.feed.peek()


def prompt_budget(max_model_len: int, max_new_tokens: int) -> int:
    """Longest prompt a generator can serve with room for a whole completion."""
    budget = max_model_len - max_new_tokens
    if budget < 1:
        raise ValueError(f"spec.generation.maxNewTokens ({max_new_tokens}) leaves no room for a prompt in the "
                         f"model's context of {max_model_len} tokens: lower maxNewTokens")
    return budget

