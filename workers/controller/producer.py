"""Rollout producers: one thread per generator replica turns prompts into scored rollout batches.

Partial rollouts: a visit gives every unfinished sequence at most `segmentTokens` new tokens, and the
next visit resumes it, under newer weights if the generator loaded some in between (every token keeps
its version). A batch is emitted once all its `promptsPerStep` groups have finished.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc
import torch

from rlfleet.v1 import generator_pb2, scorer_pb2
from rlfleet.workers.controller.links import GeneratorLinks
from rlfleet.workers.controller.ledger import PromptLedger
from rlfleet.workers.controller.rollouts import Batch, GeneratorDown, Group, Rollout, RolloutBuffer, Stopped
from rlfleet.workers.rl.aipo import group_advantages
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
# A scorer replica that went away gets this long to come back before the run fails.
SCORER_RETRY_SECONDS = 120.0


class PromptFeed:
    """Hands out batches in order: batch k is the k-th slice of `promptsPerStep` examples.

    A batch whose generator failed comes back here and is handed out again first. Groups a checkpoint
    saved (`restored`, partial rollouts included) are handed out in place of their examples.
    """

    def __init__(self, examples: Iterator[Any], first_batch: int, last_batch: int, per_batch: int, position: int,
                 restored: list[Group] | None = None):
        self._examples = examples
        self._next = first_batch
        self._last = last_batch
        self._per_batch = per_batch
        self._position = position
        self._returned: list[tuple[int, list[Any], int]] = []
        self._restored = {g.position: g for g in restored or []}
        self._lock = threading.Lock()

    def claim(self) -> tuple[int, list[Any], int] | None:
        with self._lock:
            if self._returned:
                return self._returned.pop(0)
            if self._next >= self._last:
                return None
            index, self._next = self._next, self._next + 1
            examples = list(itertools.islice(self._examples, self._per_batch))
            self._position += len(examples)
            return index, examples, self._position

    def give_back(self, claim: tuple[int, list[Any], int]) -> None:
        """A batch whose generator failed: the next producer to claim takes it first."""
        with self._lock:
            self._returned.append(claim)
            self._returned.sort(key=lambda c: c[0])

    def restored(self, position: int) -> Group | None:
        """The saved group of the example at `position`, once."""
        with self._lock:
            return self._restored.pop(position, None)


@dataclass
class ProducerParts:
    """What every producer shares."""

    job: RLJob
    feed: PromptFeed
    links: GeneratorLinks
    buffer: RolloutBuffer
    ledger: PromptLedger
    encode: Callable[[Any], list[int]]
    decode: Callable[[list[int]], str]
    scorers: list[Any]


class RolloutProducer(threading.Thread):
    def __init__(self, parts: ProducerParts, generator: Any, index: int):
        super().__init__(name=f"producer-{index}", daemon=True)
        self.parts = parts
        self.generator = generator
        self.index = index

    def run(self) -> None:
        gate = self.parts.links.gates[self.index]
        try:
            # A replica that is down claims nothing: its work stays with the others until it is back.
            while gate.wait_up() and (claim := self.parts.feed.claim()) is not None:
                self._produce(claim)
        except Stopped:
            return
        except Exception as error:  # noqa: BLE001 - handed to the trainer loop, which fails the run
            log.exception("rollout producer %d failed", self.index)
            self.parts.buffer.fail(error)

    def _produce(self, claim: tuple[int, list[Any], int]) -> None:
        index, examples, position = claim
        try:
            # Batch k trains at step >= k, so sampling it with version >= k - bound keeps it fresh.
            self.parts.links.gates[self.index].wait_for(index - self.parts.job.spec.algorithm.max_staleness)
        except GeneratorDown:
            self.parts.feed.give_back(claim)
            return
        first = position - len(examples)
        groups = [self.parts.feed.restored(first + p) or self._new_group(index, first + p, example)
                  for p, example in enumerate(examples)]
        try:
            self.parts.buffer.put(self.roll(index, groups, position))
        except GeneratorDown as down:
            self.parts.feed.give_back(claim)  # its groups start over; partial tokens of a dead replica are dropped
            self.parts.links.mark_down(self.index, down)

    def roll(self, index: int, groups: list[Group], position: int) -> Batch:
        """Generate, one segment a visit, until every group has finished; then score."""
        visits = resumed = 0
        while not all(g.finished for g in groups):
            resumed += self.visit(index, visits, groups)
            visits += 1
        rollouts = [r for g in groups for r in g.rollouts]
        self.score(index, rollouts, groups)
        return Batch(index, rollouts, position, visits=visits, resumed=resumed)

    def visit(self, index: int, visit: int, groups: list[Group]) -> int:
        """One segment for every unfinished rollout; returns how many of them were resumed."""
        spec = self.parts.job.spec
        limit = spec.generation.max_new_tokens
        open_ = [r for g in groups for r in g.rollouts if not r.finished]
        room = min(spec.generation.segment_tokens or limit, limit - min(len(r.completion_ids) for r in open_))
        resumed = sum(1 for r in open_ if r.completion_ids)
        request = generator_pb2.GenerateRequest(
            job_id=self.parts.job.metadata.name,
            sequences=[generator_pb2.Sequence(sample_id=r.sample_id, prompt_ids=r.prompt_ids,
                                              completion_ids=r.completion_ids) for r in open_],
            max_tokens=room, temperature=spec.generation.temperature, top_p=spec.generation.top_p,
            seed=_seed(spec.algorithm.seed, index, visit),
        )
        try:
            reply = self.generator.Generate(request)
        except grpc.RpcError as error:
            raise GeneratorDown(f"Generate failed: {error.code().name}") from error
        with self.parts.ledger.lock:
            for rollout, segment in zip(open_, reply.segments):
                _extend(rollout, segment, reply.policy_version, limit)
        return resumed

    def score(self, index: int, rollouts: list[Rollout], groups: list[Group]) -> None:
        prompts = {id(r): g.example.prompt for g in groups for r in g.rollouts}
        request = scorer_pb2.ScoreRequest(job_id=self.parts.job.metadata.name, items=[
            scorer_pb2.ScoreItem(sample_id=r.sample_id, prompt=prompts[id(r)],
                                 completion=self.parts.decode(r.completion_ids), answer=r.answer)
            for r in rollouts
        ])
        reply = self._score_anywhere(index, request)
        for rollout, score in zip(rollouts, reply.scores):
            rollout.reward = score.reward
            rollout.scorer_errors = list(score.errors)
        advantages = group_advantages(torch.tensor([r.reward for r in rollouts]),
                                      torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts]))
        for rollout, advantage in zip(rollouts, advantages.tolist()):
            rollout.advantage = advantage

    def _score_anywhere(self, index: int, request: Any) -> Any:
        """Any scorer replica will do; one that is restarting gets a grace period."""
        scorers = self.parts.scorers
        deadline = time.monotonic() + SCORER_RETRY_SECONDS
        for attempt in itertools.count():
            try:
                return scorers[(index + attempt) % len(scorers)].Score(request)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                log.warning("scorer %d unavailable, trying another", (index + attempt) % len(scorers))
                time.sleep(min(1.0, 0.1 * attempt))

    def _new_group(self, index: int, position: int, example: Any) -> Group:
        ids = self.parts.encode(example)
        size = self.parts.job.spec.algorithm.group_size
        group = Group(position, example, [Rollout(sample_id=f"{index}-{position}-{g}", prompt=position,
                                                  prompt_ids=ids, answer=example.answer) for g in range(size)])
        self.parts.ledger.opened(group)
        return group


def _extend(rollout: Rollout, segment: Any, version: int, limit: int) -> None:
    room = limit - len(rollout.completion_ids)
    tokens = list(segment.token_ids)[:room]
    rollout.completion_ids += tokens
    rollout.gen_logprobs += list(segment.logprobs)[:room]
    rollout.versions += [version] * len(tokens)
    rollout.finished = segment.finished or len(rollout.completion_ids) >= limit


def _seed(job_seed: int, batch: int, visit: int) -> int:
    """Distinct per job, batch and visit; the engine adds the sequence index."""
    return (job_seed * 1_000_003 + batch * 1_009 + visit) * 65_536 % (1 << 63)
