"""The staleness bound: producers never sample a batch too old for its step, and stale rollouts never train.

Staleness is measured from the versions the fake generators report (their own weights, which change
only when a push lands), so a dispatch that let producers run ahead of the weights would show here.
"""

from __future__ import annotations

import threading

import pytest
from fleet_fakes import FakeGenerator, examples, make_parts, start_producers, train

from rlfleet.workers.controller.rollouts import Rollout, RolloutBuffer, set_advantages, split_stale

from conftest import make_job, sampled


def _staleness(max_staleness: int, steps: int, generators: int, tmp_path) -> list[int]:
    job = make_job(algorithm={"maxStaleness": max_staleness, "steps": steps, "promptsPerStep": 2, "groupSize": 2})
    # Generation is fast next to a push: producers that ignored the weights would run far ahead.
    fakes = [FakeGenerator(tokens=1) for _ in range(generators)]
    parts, fleet = make_parts(job, tmp_path, fakes)
    fleet.push_seconds = 0.02
    start_producers(parts, fakes)
    trained = train(parts, fleet, range(steps))
    return [step - r.version for step, batch in trained for r in batch.rollouts]


@pytest.mark.parametrize("max_staleness, generators", [(0, 1), (1, 1), (3, 1), (0, 2), (2, 3)])
def test_producers_keep_every_batch_within_the_bound(max_staleness, generators, tmp_path):
    staleness = _staleness(max_staleness, 12, generators, tmp_path)
    assert 0 <= min(staleness) and max(staleness) <= max_staleness


def test_the_bound_is_used_when_generation_is_fast(tmp_path):
    """The producers do run ahead as far as the bound allows (else the checks above prove little)."""
    assert max(_staleness(3, 12, 1, tmp_path)) == 3


def test_split_stale_uses_the_oldest_token():
    mixed = Rollout(sample_id="a", prompt=0, prompt_ids=[1], answer="", turns=sampled([1, 2], versions=[3, 5]))
    fresh = Rollout(sample_id="b", prompt=0, prompt_ids=[1], answer="", turns=sampled([1], versions=[5]))
    kept, dropped = split_stale([mixed, fresh], step=5, max_staleness=1)
    assert kept == [fresh] and dropped == [mixed]
    kept, dropped = split_stale([mixed, fresh], step=5, max_staleness=2)
    assert kept == [mixed, fresh] and dropped == []


def _rollout(prompt: int, reward: float) -> Rollout:
    return Rollout(sample_id=f"{prompt}-{reward}", prompt=prompt, prompt_ids=[1], answer="", reward=reward)


def test_advantages_use_only_the_samples_that_train():
    group = [_rollout(0, 1.0), _rollout(0, 0.0), _rollout(0, 0.0), _rollout(1, 0.5), _rollout(1, 0.5)]
    fresh = group[:2] + group[3:]  # group[2] was dropped as stale: no part of prompt 0's baseline
    set_advantages(fresh)
    assert [r.advantage for r in fresh] == [0.5, -0.5, 0.0, 0.0]


def test_a_failed_producer_wakes_the_trainer():
    buffer = RolloutBuffer()
    threading.Timer(0.05, buffer.fail, args=(RuntimeError("generator gone"),)).start()
    with pytest.raises(Exception) as raised:
        buffer.take(0)
    assert "generator gone" in str(raised.value.__cause__)


class SegmentedGenerator(FakeGenerator):
    """One token per visit; sample ids ending in -0 stop after 3 tokens, the rest after 1. Its version
    moves on after every visit, as if new weights arrived in between."""

    def Generate(self, request, timeout=None):
        reply = super().Generate(request, timeout)
        for segment, sequence in zip(reply.segments, request.sequences):
            segment.token_ids[:] = [7 + len(sequence.completion_ids)]
            segment.finished = len(sequence.completion_ids) + 1 >= (3 if sequence.sample_id.endswith("-0") else 1)
        self.version += 1
        return reply


def test_partial_rollouts_resume_with_their_own_versions_and_logprobs(tmp_path):
    job = make_job(algorithm={"maxStaleness": 8, "steps": 2, "promptsPerStep": 1, "groupSize": 2},
                   generation={"maxNewTokens": 4, "segmentTokens": 1})
    generator = SegmentedGenerator()
    parts, _ = make_parts(job, tmp_path, [generator], data=examples())
    producer = start_producers(parts, [generator])[0]
    first = parts.buffer.take(0, timeout=10)
    parts.dispatch.replicas.stop()
    producer.join(10)
    # The group needs 3 visits (its -0 sample is long); the later visits resumed that sample.
    assert first.visits == 3 and first.resumed == 2
    long = next(r for r in first.rollouts if r.sample_id.endswith("-0"))
    assert long.completion_ids == [7, 8, 9]
    assert long.versions == [0, 1, 2] and long.gen_logprobs == [-1.0, -2.0, -3.0]
    assert long.version == 0, "staleness is measured from the oldest token"
