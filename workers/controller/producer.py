"""Rollout producers: one thread per generator replica turns prompts into scored rollouts."""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from rlfleet.v1 import generator_pb2, scorer_pb2
from rlfleet.workers.controller.rollouts import Batch, Rollout, RolloutBuffer, Stopped
from rlfleet.workers.rl.aipo import group_advantages
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)


class VersionGate:
    """The newest policy version every generator holds; producers wait here to respect maxStaleness."""

    def __init__(self, version: int):
        self.version = version
        self._cond = threading.Condition()
        self._stopped = False

    def advance(self, version: int) -> None:
        with self._cond:
            self.version = max(self.version, version)
            self._cond.notify_all()

    def wait_for(self, version: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.version >= version or self._stopped)
            if self._stopped:
                raise Stopped()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


class PromptFeed:
    """Hands out batches in order: batch k is the k-th slice of `promptsPerStep` examples."""

    def __init__(self, examples: Iterator[Any], first_batch: int, last_batch: int, per_batch: int, position: int):
        self._examples = examples
        self._next = first_batch
        self._last = last_batch
        self._per_batch = per_batch
        self._position = position
        self._lock = threading.Lock()

    def claim(self) -> tuple[int, list[Any], int] | None:
        with self._lock:
            if self._next >= self._last:
                return None
            index, self._next = self._next, self._next + 1
            examples = list(itertools.islice(self._examples, self._per_batch))
            self._position += len(examples)
            return index, examples, self._position


@dataclass
class ProducerParts:
    """What every producer shares."""

    job: RLJob
    feed: PromptFeed
    gate: VersionGate
    buffer: RolloutBuffer
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
        try:
            while (claim := self.parts.feed.claim()) is not None:
                index, examples, position = claim
                # Batch k trains at step >= k, so sampling it with version >= k - bound keeps it fresh.
                self.parts.gate.wait_for(index - self.parts.job.spec.algorithm.max_staleness)
                self.parts.buffer.put(Batch(index, self.roll(index, examples), position))
        except Stopped:
            return
        except Exception as error:  # noqa: BLE001 - handed to the trainer loop, which fails the run
            log.exception("rollout producer %d failed", self.index)
            self.parts.buffer.fail(error)

    def roll(self, index: int, examples: list[Any]) -> list[Rollout]:
        group_size = self.parts.job.spec.algorithm.group_size
        rollouts = [
            Rollout(sample_id=f"{index}-{p}-{g}", group=p, prompt_ids=self.parts.encode(example), answer=example.answer)
            for p, example in enumerate(examples)
            for g in range(group_size)
        ]
        self.generate(index, rollouts)
        self.score(index, rollouts, examples)
        advantages = group_advantages(torch.tensor([r.reward for r in rollouts]),
                                      torch.tensor([r.group for r in rollouts]))
        for rollout, advantage in zip(rollouts, advantages.tolist()):
            rollout.advantage = advantage
        return rollouts

    def generate(self, index: int, rollouts: list[Rollout]) -> None:
        """Visit the generator segment by segment until every rollout finished or hit maxNewTokens."""
        spec = self.parts.job.spec
        limit = spec.generation.max_new_tokens
        segment = spec.generation.segment_tokens or limit
        for visit in itertools.count():
            open_ = [r for r in rollouts if not r.finished]
            if not open_:
                return
            room = min(segment, limit - min(len(r.completion_ids) for r in open_))
            reply = self.generator.Generate(generator_pb2.GenerateRequest(
                job_id=self.parts.job.metadata.name,
                sequences=[generator_pb2.Sequence(sample_id=r.sample_id, prompt_ids=r.prompt_ids,
                                                  completion_ids=r.completion_ids) for r in open_],
                max_tokens=room, temperature=spec.generation.temperature, top_p=spec.generation.top_p,
                seed=_seed(spec.algorithm.seed, index, visit),
            ))
            for rollout, seg in zip(open_, reply.segments):
                _extend(rollout, seg, reply.policy_version, limit)

    def score(self, index: int, rollouts: list[Rollout], examples: list[Any]) -> None:
        scorer = self.parts.scorers[index % len(self.parts.scorers)]
        reply = scorer.Score(scorer_pb2.ScoreRequest(job_id=self.parts.job.metadata.name, items=[
            scorer_pb2.ScoreItem(sample_id=r.sample_id, prompt=examples[r.group].prompt,
                                 completion=self.parts.decode(r.completion_ids), answer=r.answer)
            for r in rollouts
        ]))
        for rollout, score in zip(rollouts, reply.scores):
            rollout.reward = score.reward
            rollout.scorer_errors = list(score.errors)


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
