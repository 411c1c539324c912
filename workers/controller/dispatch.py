"""Who generates what: the one owner of the work not yet taken, composed with the generator replicas' state.

Producers (one per replica) take parts of batches here; the receivers report to the replicas' state (replicas.py)
which policy version each replica holds and whether it is up. The open parts are kept under that state's lock, so
every change that can make some waiting producer's next part startable (a part handed back, or split off, a replica
up again, newer weights) wakes them all. A new batch's index is taken under that lock, its prompts are read and
tokenized outside it. A producer holds no part while it waits, so work handed back by a failed replica goes to any
live replica that may start it, whatever the interleaving: at maxStaleness 0 a producer that held a part of batch
k + 1 while waiting for version k + 1 would wait forever if a part of batch k came back to the feed.

A slower replica is no straggler: a new batch is split, in whole groups (a group's advantages need all of it), among
the replicas that are up, each part sized by its replica's measured throughput (throughput.py), so that the parts
finish about together. Up, not only holding weights fresh enough for the batch: a push lands on the replicas at
different moments, and at maxStaleness 0 the first to load it would otherwise take every batch whole. The replica that
took the batch keeps its own part; the others are open, each for its replica. A replica that may start a part (the
version gate) takes it if the part is its own, or its replica may not start it now (down, or without the weights it
needs: lost without a word yet, or still loading them), or is no faster than itself (an idle replica takes a busy
one's part when that is no slower); never the part of a faster replica that is up, fresh enough and busy, which would
make it the straggler. A part handed back is anyone's, as a whole batch was. So a part waits only for a replica that
may start it and is working, and at maxStaleness 0, where a replica works on one batch at a time, any replica that
may start a part of batch k takes it. The rollout buffer assembles a batch once all its parts are in.
Each prompt is in one part only, so it is still generated once; the ledger and a checkpoint's in-flight groups are
by prompt, whatever part it is in. With one replica that may start a batch, the batch is one part.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from rlfleet.workers.controller.ledger import TOO_LONG, PromptLedger
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.rollouts import Group
from rlfleet.workers.controller.throughput import Throughput, part_sizes

log = logging.getLogger(__name__)
# A run fails once this many prompts in a row (or a whole pass over the data, if fewer) are too long: no batch
# would ever fill. A cap, for an arithmetic space of millions of problems that all render alike.
MAX_TOO_LONG_IN_A_ROW = 10_000
WHOLE_BATCHES_ENV = "RLFLEET_WHOLE_BATCHES"
"""A benchmark knob, not for real jobs: set (to anything), the controller hands out whole batches, never split, as
before batches were split by throughput (`rlfleet bench pools` compares the two)."""


@dataclass(frozen=True)
class Prompt:
    """One example of the training stream, tokenized."""

    position: int
    """Where it is in the stream (the prompt ledger's key)."""
    example: Any
    ids: list[int]


@dataclass
class Claim:
    """A part of batch `index` (all of it unless split): it trains at step `index`, so it may start on weights of
    version >= index - maxStaleness."""

    index: int
    prompts: list[Prompt]
    data_position: int
    """Examples consumed up to and including this batch."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Prompts of this batch written down as not trainable, by ledger outcome."""
    failures: int = 0
    """Generate calls for this batch that failed with an engine error (not a lost replica)."""
    groups: list[Group] | None = None
    """Its groups once a producer started them: a part handed back keeps every token already generated."""
    parts: int = 1
    """How many parts its batch was split into: the rollout buffer assembles the batch from that many."""
    offset: int = 0
    """Where its first prompt is in its batch (the sampling seeds of its sequences follow the batch's)."""
    owner: int | None = None
    """The replica it was sized for; None: anyone's (a whole batch, or a part handed back)."""

    def split(self, sizes: list[int], owners: list[int]) -> list[Claim]:
        """This new batch as consecutive parts of `sizes` prompts for `owners` (the empty ones left out, all of an
        empty batch to the first owner); the first keeps the batch's drops."""
        kept = [(size, owner) for size, owner in zip(sizes, owners) if size] or [(0, owners[0])]
        parts, start = [], 0
        for size, owner in kept:
            parts.append(Claim(self.index, self.prompts[start:start + size], self.data_position, parts=len(kept),
                               offset=start, owner=owner))
            start += size
        parts[0].dropped = self.dropped
        return parts


class PromptFeed:
    """Batch k is the next `promptsPerStep` prompts of the stream that fit the generators' budget.

    A prompt longer than `max_prompt_tokens` could never be generated: it is written down once as
    dropped (TOO_LONG) and skipped; once a whole pass over the data (`pass_size` prompts, at most
    MAX_TOO_LONG_IN_A_ROW) is too long in a row, no prompt fits and every later take raises NoPromptFits.
    Groups a checkpoint saved (`restored`, partial rollouts included) are handed out in place of their examples.
    """

    def __init__(self, examples: Iterator[Any], first_batch: int, last_batch: int, per_batch: int, position: int,
                 encode: Callable[[Any], list[int]], max_prompt_tokens: int, ledger: PromptLedger,
                 restored: list[Group] | None = None, pass_size: int = MAX_TOO_LONG_IN_A_ROW):
        self._examples = examples
        self._next = first_batch
        self._last = last_batch
        self._per_batch = per_batch
        self._position = position
        self._encode = encode
        self._max_prompt_tokens = max_prompt_tokens
        self._ledger = ledger
        self._restored = {g.position: g for g in restored or []}
        self._pass_size = pass_size
        self._too_long = TooLongRun()
        self._filled = first_batch
        self._turn = threading.Condition()
        self._failed: NoPromptFits | None = None

    def peek(self) -> int | None:
        """Index of the next new batch, or None when every batch was handed out."""
        return self._next if self._next < self._last else None

    def reserve(self) -> int:
        """Index of the next new batch, now the caller's (it checked `peek`); `take` fills it."""
        self._next += 1
        return self._next - 1

    def take(self, index: int) -> Claim:
        """Batch `index`'s prompts, once every lower batch took its own: batches take the stream in order."""
        with self._turn:
            self._turn.wait_for(lambda: self._filled == index)
            try:
                if self._failed:
                    raise self._failed
                return self._fill(Claim(index, [], self._position))
            finally:
                self._filled += 1
                self._turn.notify_all()

    def _fill(self, claim: Claim) -> Claim:
        while len(claim.prompts) < self._per_batch and (example := next(self._examples, None)) is not None:
            position, self._position = self._position, self._position + 1
            group = self._restored.get(position)
            ids = group.rollouts[0].prompt_ids if group else self._encode(example)
            if len(ids) > self._max_prompt_tokens:
                self._drop_too_long(claim, position, example, len(ids))
                continue
            self._too_long = TooLongRun()
            claim.prompts.append(Prompt(position, example, ids))
        if claim.dropped:
            log.warning("batch %d: %d prompts longer than the generators' prompt budget of %d tokens dropped",
                        claim.index, claim.dropped[TOO_LONG], self._max_prompt_tokens)
        claim.data_position = self._position
        return claim

    def _drop_too_long(self, claim: Claim, position: int, example: Any, tokens: int) -> None:
        self._ledger.dropped(position, claim.index, TOO_LONG)
        claim.dropped[TOO_LONG] = claim.dropped.get(TOO_LONG, 0) + 1
        self._too_long.add(position, example, tokens)
        if self._too_long.count >= min(self._pass_size, MAX_TOO_LONG_IN_A_ROW):
            self._failed = NoPromptFits(self._too_long, self._max_prompt_tokens,
                                        self._pass_size <= MAX_TOO_LONG_IN_A_ROW)
            raise self._failed

    def restored(self, position: int) -> Group | None:
        """The saved group of the prompt at `position`, once."""
        return self._restored.pop(position, None)


@dataclass
class TooLongRun:
    """Prompts too long in a row, and the longest of them."""

    count: int = 0
    longest: tuple[int, Any, int] | None = None
    """(data position, example, tokens)."""

    def add(self, position: int, example: Any, tokens: int) -> None:
        self.count += 1
        if self.longest is None or tokens > self.longest[2]:
            self.longest = (position, example, tokens)


class NoPromptFits(ValueError):
    """So many prompts in a row are longer than the generators' prompt budget that no batch would ever fill."""

    def __init__(self, run: TooLongRun, budget: int, whole_pass: bool):
        position, example, tokens = run.longest
        which = "a whole pass over the data" if whole_pass else "the most a run skips"
        super().__init__(
            f"no prompt of spec.data fits the generators: {run.count} prompts in a row ({which}) are longer than "
            f"their prompt budget of {budget} tokens (the model's context less spec.generation.maxNewTokens); the "
            f"longest, example {example.id!r} at data position {position}, has {tokens} tokens: "
            f"shorten the prompts of spec.data, or lower spec.generation.maxNewTokens to leave them room")


class Dispatch:
    """Open parts of batches (split off a new batch, or handed back), handed to the replicas whose state `replicas`
    keeps, under its lock; a new batch is split by the replicas' `throughput`."""

    def __init__(self, feed: PromptFeed, replicas: ReplicaStates, max_staleness: int, split: bool = True):
        self.feed = feed
        self.replicas = replicas
        self.max_staleness = max_staleness
        self.split = split
        """False: whole batches (WHOLE_BATCHES_ENV)."""
        self.throughput = Throughput()
        self._open: list[Claim] = []

    def claim(self, replica: int) -> Claim:
        """The lowest open part, or `replica`'s part of a new batch, once `replica` is up and holds weights fresh
        enough for it.

        Blocks while there is none (more may come back from a failed replica); Stopped at the end. A new batch's
        prompts are read outside the lock: pushes acknowledged and parts handed back meanwhile never wait for them.
        """
        found = self.replicas.wait_for(lambda: self._startable(replica))
        return found if isinstance(found, Claim) else self._split(self.feed.take(found), replica)

    def give_back(self, claim: Claim) -> None:
        """A part whose replica failed: the next producer that may start it takes it first."""
        with self.replicas.changing():
            claim.owner = None
            self._add_open([claim])

    def _split(self, claim: Claim, replica: int) -> Claim:
        """`replica`'s part of the new batch `claim`; the parts of the other replicas up are open."""
        if not self.split:
            return claim
        with self.replicas.changing():
            sharing = [replica, *(other for other in self.replicas.up() if other != replica)]
            mine, *others = claim.split(part_sizes(len(claim.prompts), self.throughput.shares(sharing)), sharing)
            self._add_open(others)
        return mine

    def _add_open(self, parts: list[Claim]) -> None:
        self._open.extend(parts)
        self._open.sort(key=lambda c: c.index)

    def _startable(self, replica: int) -> Claim | int | None:
        """Under the replicas' lock: the lowest open part `replica` may take, or else the index of a new batch (open
        parts are of older batches), if it may start it now."""
        part = next((p for p in self._open if self._may_take(replica, p)), None)
        index = part.index if part else self.feed.peek()
        if index is None or not self.replicas.holds(replica, index - self.max_staleness):
            return None
        if part:
            self._open.remove(part)
            return part
        return self.feed.reserve()

    def _may_take(self, replica: int, part: Claim) -> bool:
        """Its own part, anyone's, that of a replica that may not start it now, or of one no faster than itself
        (module docstring)."""
        owner = part.owner
        return (owner is None or owner == replica or not self.replicas.holds(owner, part.index - self.max_staleness)
                or self.throughput.rate(replica) >= self.throughput.rate(owner))


def prompt_budget(max_model_len: int, max_new_tokens: int) -> int:
    """Longest prompt a generator can serve with room for a whole completion."""
    budget = max_model_len - max_new_tokens
    if budget < 1:
        raise ValueError(f"spec.generation.maxNewTokens ({max_new_tokens}) leaves no room for a prompt in the "
                         f"model's context of {max_model_len} tokens: lower maxNewTokens")
    return budget

