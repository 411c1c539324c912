"""Controller tests' stand-ins for the generator side, built so they assume nothing the controller should prove.

A FakeGenerator holds its own weights version, changed only when a push lands on it (after a delay, as
a real push does) and reported in every Generate reply, so the staleness of what it produced is measured
from the generator's side, not read back from the dispatch. It can be killed and revived. FakeFleet
plays trainer rank 0: it takes batch t, pushes t + 1 to the live generators, and rejoins revived ones.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from rlfleet.v1 import generator_pb2, scorer_pb2
from rlfleet.workers.controller.dispatch import Dispatch, PromptFeed
from rlfleet.workers.controller.ledger import PromptLedger
from rlfleet.workers.controller.producer import ProducerParts, RolloutProducer
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.rollouts import Batch, Group, RolloutBuffer, set_advantages, split_stale
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.scorer.server import ScorerService
from rlfleet.workers.scorer.stage import RuleScoring


class RpcFailure(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = ""):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeGenerator:
    """One token per visit; a sequence ends after `tokens` tokens. Unavailable while dead."""

    def __init__(self, tokens: int = 2, seconds: float = 0.0):
        self.tokens = tokens
        self.seconds = seconds
        self.version = 0
        self.alive = True
        self.calls = 0
        self.called = threading.Event()

    def Generate(self, request, timeout=None):
        self.calls += 1
        self.called.set()
        version = self.version  # the weights this call samples with
        time.sleep(self.seconds)
        if not self.alive:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "dead")
        return generator_pb2.GenerateResponse(job_id=request.job_id, policy_version=version, segments=[
            generator_pb2.Segment(sample_id=s.sample_id, token_ids=[7], logprobs=[-1.0 - version],
                                  finished=len(s.completion_ids) + 1 >= self.tokens)
            for s in request.sequences])


class DiesOnCall(FakeGenerator):
    """Answers `calls` Generate calls, then dies for good (a lost node)."""

    def __init__(self, calls: int, **kwargs):
        super().__init__(**kwargs)
        self.left = calls

    def Generate(self, request, timeout=None):
        if self.left == 0:
            self.alive = False
        self.left -= 1
        return super().Generate(request, timeout)


class FakeScorer:
    def Score(self, request, timeout=None):
        return scorer_pb2.ScoreResponse(scores=[scorer_pb2.Score(sample_id=i.sample_id, reward=float(n % 2))
                                                for n, i in enumerate(request.items)])


class InProcessScorer:
    """A scorer replica's stub whose Score runs the job's real Scorer service in this process (its scorers in their
    child processes); close() stops them."""

    def __init__(self, job):
        self.service = ScorerService(job)

    def Score(self, request, timeout=None):
        return self.service.Score(request, None)

    def close(self):
        self.service.close()


def examples(start: int = 0):
    return (Example(id=str(n), prompt=f"{n}+0=", answer=str(n)) for n in itertools.count(start))


class FakeFleet:
    """Trainer rank 0's side of the receivers: pushes land on live generators after `push_seconds`."""

    def __init__(self, generators: list[FakeGenerator], replicas: ReplicaStates, push_seconds: float = 0.01):
        self.generators = generators
        self.replicas = replicas
        self.push_seconds = push_seconds
        self.version = 0
        self.marked_down: list[int] = []

    def mark_down(self, replica: int, reason: Any) -> None:
        self.marked_down.append(replica)
        self.replicas.set_down(replica)

    def push(self, version: int) -> None:
        self.version = version
        for replica, generator in enumerate(self.generators):
            if self.replicas.is_up(replica):
                threading.Timer(self.push_seconds, self._land, (replica, generator, version)).start()

    def rejoin_returned(self) -> None:
        for replica in self.replicas.down():
            generator = self.generators[replica]
            if generator.alive:
                generator.version = self.version
                self.replicas.set_up(replica, self.version)

    def _land(self, replica: int, generator: FakeGenerator, version: int) -> None:
        if generator.alive:
            generator.version = max(generator.version, version)
            self.replicas.advance(replica, version)


def make_parts(job, run_dir: Path, generators: list[FakeGenerator], *, data=None, max_prompt_tokens: int = 1000,
               restored: list[Group] | None = None, first: int = 0, position: int = 0,
               encode=lambda example: [1, 2]) -> tuple[ProducerParts, FakeFleet]:
    alg = job.spec.algorithm
    ledger = PromptLedger(run_dir)
    for group in restored or []:
        ledger.opened(group)
    feed = PromptFeed(data if data is not None else examples(position), first, alg.steps, alg.prompts_per_step,
                      position, encode=encode, max_prompt_tokens=max_prompt_tokens, ledger=ledger, restored=restored)
    replicas = ReplicaStates(len(generators), first)
    dispatch = Dispatch(feed, replicas, alg.max_staleness)
    fleet = FakeFleet(generators, replicas)
    fleet.version = first
    for generator in generators:
        generator.version = first
    parts = ProducerParts(job=job, dispatch=dispatch, receivers=fleet, buffer=RolloutBuffer(), ledger=ledger,
                          stages=[RuleScoring(job, [FakeScorer()], lambda ids: "x")])
    return parts, fleet


def start_producers(parts: ProducerParts, generators: list[FakeGenerator],
                    replicas: list[int] | None = None) -> list[RolloutProducer]:
    """One producer per replica (or per replica listed), as the controller starts them."""
    producers = [RolloutProducer(parts, generators[index], index)
                 for index in (range(len(generators)) if replicas is None else replicas)]
    for producer in producers:
        producer.start()
    return producers


def train(parts: ProducerParts, fleet: FakeFleet, steps: range, seconds: float = 30.0) -> list[tuple[int, Batch]]:
    """The controller's loop without a model: take batch t (failing the test if it does not come within
    `seconds`), settle it in the ledger, push t + 1."""
    trained = []
    alg = parts.job.spec.algorithm
    try:
        for step in steps:
            fleet.rejoin_returned()
            deadline = time.monotonic() + seconds
            while (batch := parts.buffer.take(step, timeout=0.05)) is None:
                assert time.monotonic() < deadline, f"batch {step} never came: the run stalled"
                fleet.rejoin_returned()
            fresh, _ = split_stale(batch.rollouts, step, alg.max_staleness)
            set_advantages(fresh)
            parts.ledger.settle(step, batch.rollouts, fresh, trained=bool(fresh))
            trained.append((step, batch))
            fleet.push(step + 1)
        parts.ledger.close(steps.stop - 1)
    finally:
        parts.dispatch.replicas.stop()
    return trained
