"""The staleness bound: producers never sample a batch too old for its step, and stale rollouts never train."""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest

from rlfleet.v1 import generator_pb2, scorer_pb2
from rlfleet.workers.controller.producer import ProducerParts, PromptFeed, RolloutProducer, VersionGate
from rlfleet.workers.controller.rollouts import Rollout, RolloutBuffer, split_stale

from conftest import make_job


class FakeGenerator:
    """Answers with whatever version the 'generator' holds now: the gate's."""

    def __init__(self, gate: VersionGate):
        self.gate = gate

    def Generate(self, request):
        return generator_pb2.GenerateResponse(job_id=request.job_id, policy_version=self.gate.version, segments=[
            generator_pb2.Segment(sample_id=s.sample_id, token_ids=[5, 6], logprobs=[-1.0, -1.0], finished=True)
            for s in request.sequences
        ])


class FakeScorer:
    def Score(self, request):
        return scorer_pb2.ScoreResponse(scores=[scorer_pb2.Score(sample_id=i.sample_id, reward=float(n % 2))
                                                for n, i in enumerate(request.items)])


def _train_with_producer(max_staleness: int, steps: int) -> list[tuple[int, list[Rollout]]]:
    job = make_job(algorithm={"maxStaleness": max_staleness, "steps": steps, "promptsPerStep": 2, "groupSize": 2})
    gate, buffer = VersionGate(0), RolloutBuffer()
    examples = (SimpleNamespace(prompt=str(n), answer="1") for n in itertools.count())
    parts = ProducerParts(job=job, feed=PromptFeed(examples, 0, steps, 2, 0), gate=gate, buffer=buffer,
                          encode=lambda e: [1, 2], decode=lambda ids: "x", scorers=[FakeScorer()])
    producer = RolloutProducer(parts, FakeGenerator(gate), 0)
    producer.start()
    trained = []
    for step in range(steps):
        batch = buffer.take(step)
        trained.append((step, batch.rollouts))
        gate.advance(step + 1)  # the trainer published the next version
    producer.join(timeout=10)
    assert not producer.is_alive()
    return trained


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_producers_keep_every_batch_within_the_bound(max_staleness):
    trained = _train_with_producer(max_staleness, steps=12)
    staleness = [step - r.version for step, rollouts in trained for r in rollouts]
    assert max(staleness) <= max_staleness
    assert min(staleness) >= 0


def test_synchronous_baseline_trains_only_current_policy_samples():
    trained = _train_with_producer(0, steps=6)
    assert all(r.version == step for step, rollouts in trained for r in rollouts)


def test_group_advantages_are_attached():
    (step, rollouts), *_ = _train_with_producer(1, steps=1)
    assert [r.advantage for r in rollouts] == [-0.5, 0.5, -0.5, 0.5]


def test_split_stale_uses_the_oldest_token():
    mixed = Rollout(sample_id="a", group=0, prompt_ids=[1], answer="", completion_ids=[1, 2], versions=[3, 5])
    fresh = Rollout(sample_id="b", group=0, prompt_ids=[1], answer="", completion_ids=[1], versions=[5])
    kept, dropped = split_stale([mixed, fresh], step=5, max_staleness=1)
    assert kept == [fresh] and dropped == [mixed]
    kept, dropped = split_stale([mixed, fresh], step=5, max_staleness=2)
    assert kept == [mixed, fresh] and dropped == []


def test_a_failed_producer_wakes_the_trainer():
    buffer = RolloutBuffer()
    threading.Timer(0.05, buffer.fail, args=(RuntimeError("generator gone"),)).start()
    with pytest.raises(Exception) as raised:
        buffer.take(0)
    assert "generator gone" in str(raised.value.__cause__)
