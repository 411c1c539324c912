"""The staleness bound: producers never sample a batch too old for its step, and stale rollouts never train."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlfleet.v1 import generator_pb2, scorer_pb2
from rlfleet.workers.controller.ledger import PromptLedger
from rlfleet.workers.controller.links import VersionGate
from rlfleet.workers.controller.producer import ProducerParts, PromptFeed, RolloutProducer
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


class FakeLinks:
    def __init__(self, gates: list[VersionGate]):
        self.gates = gates
        self.down = []

    def mark_down(self, replica, reason):
        self.down.append((replica, str(reason)))
        self.gates[replica].set_down()


class FakeScorer:
    def Score(self, request):
        return scorer_pb2.ScoreResponse(scores=[scorer_pb2.Score(sample_id=i.sample_id, reward=float(n % 2))
                                                for n, i in enumerate(request.items)])


def parts_for(job, examples, gates: list[VersionGate], buffer: RolloutBuffer, run_dir: Path, last: int,
              per_batch: int) -> ProducerParts:
    """What producers share, with fakes for the generator links and the scorer."""
    return ProducerParts(job=job, feed=PromptFeed(iter(examples), 0, last, per_batch, 0), links=FakeLinks(gates),
                         buffer=buffer, ledger=PromptLedger(run_dir), encode=lambda e: [1, 2],
                         decode=lambda ids: "x", scorers=[FakeScorer()])


def _examples():
    return (SimpleNamespace(prompt=str(n), answer="1") for n in itertools.count())


def _train_with_producer(max_staleness: int, steps: int, run_dir: Path) -> list[tuple[int, list[Rollout]]]:
    job = make_job(algorithm={"maxStaleness": max_staleness, "steps": steps, "promptsPerStep": 2, "groupSize": 2})
    gate, buffer = VersionGate(0), RolloutBuffer()
    parts = parts_for(job, _examples(), [gate], buffer, run_dir, steps, 2)
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
def test_producers_keep_every_batch_within_the_bound(max_staleness, tmp_path):
    trained = _train_with_producer(max_staleness, steps=12, run_dir=tmp_path)
    staleness = [step - r.version for step, rollouts in trained for r in rollouts]
    assert max(staleness) <= max_staleness
    assert min(staleness) >= 0


def test_synchronous_baseline_trains_only_current_policy_samples(tmp_path):
    trained = _train_with_producer(0, steps=6, run_dir=tmp_path)
    assert all(r.version == step for step, rollouts in trained for r in rollouts)


def test_group_advantages_are_attached(tmp_path):
    (step, rollouts), *_ = _train_with_producer(1, steps=1, run_dir=tmp_path)
    assert [r.advantage for r in rollouts] == [-0.5, 0.5, -0.5, 0.5]


def test_split_stale_uses_the_oldest_token():
    mixed = Rollout(sample_id="a", prompt=0, prompt_ids=[1], answer="", completion_ids=[1, 2], versions=[3, 5])
    fresh = Rollout(sample_id="b", prompt=0, prompt_ids=[1], answer="", completion_ids=[1], versions=[5])
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


class SegmentedGenerator:
    """One token per visit; sample ids ending in -0 stop after 3 tokens, the rest after 1.
    The policy version moves on after every visit, as if new weights arrived in between."""

    def __init__(self):
        self.version = 0

    def Generate(self, request):
        segments = []
        for s in request.sequences:
            done = len(s.completion_ids) + 1 >= (3 if s.sample_id.endswith("-0") else 1)
            segments.append(generator_pb2.Segment(sample_id=s.sample_id, token_ids=[7 + len(s.completion_ids)],
                                                  logprobs=[-0.5 - self.version], finished=done))
        reply = generator_pb2.GenerateResponse(job_id=request.job_id, policy_version=self.version, segments=segments)
        self.version += 1
        return reply


def test_partial_rollouts_resume_with_their_own_versions_and_logprobs(tmp_path):
    job = make_job(algorithm={"maxStaleness": 8, "steps": 2, "promptsPerStep": 1, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    examples = _examples()
    parts = parts_for(job, examples, [VersionGate(100)], RolloutBuffer(), tmp_path, 2, 1)
    producer = RolloutProducer(parts, SegmentedGenerator(), 0)
    first = producer.roll(0, [producer._new_group(0, 0, next(examples))], 1)
    # The group needs 3 visits (its -0 sample is long); the later visits resumed that sample.
    assert first.visits == 3 and first.resumed == 2
    long = next(r for r in first.rollouts if r.sample_id.endswith("-0"))
    assert long.completion_ids == [7, 8, 9]
    assert long.versions == [0, 1, 2] and long.gen_logprobs == [-0.5, -1.5, -2.5]
    assert long.version == 0, "staleness is measured from the oldest token"
