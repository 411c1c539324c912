"""A Generate call whose reply passes gRPC's message limit (RESOURCE_EXHAUSTED) is split, never taken for a lost
replica: the batch is produced, nothing is handed back, and each sequence keeps the seed one call would give it."""

from __future__ import annotations

import grpc

from conftest import make_job
from fleet_fakes import FakeGenerator, InProcessScorer, RpcFailure, make_parts
from rlfleet.v1 import generator_pb2
from rlfleet.workers.controller.producer import RolloutProducer, _seed
from rlfleet.workers.evaluation.in_loop import HeldOutEvaluator
from rlfleet.workers.scorer.stage import remote_grader
from test_in_loop_evaluation import CharTokenizer


class RefusingGenerator(FakeGenerator):
    """Fails RESOURCE_EXHAUSTED on a call of more than `most` sequences, as gRPC fails a reply past its limit."""

    def __init__(self, most: int, **kwargs):
        super().__init__(**kwargs)
        self.most = most
        self.answered: list[generator_pb2.GenerateRequest] = []

    def Generate(self, request, timeout=None):
        if len(request.sequences) > self.most:
            self.calls += 1
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger than max")
        self.answered.append(request)
        return super().Generate(request, timeout)


def test_a_generate_reply_too_large_is_split_and_the_replica_stays_up(tmp_path):
    job = make_job(algorithm={"groupSize": 4, "promptsPerStep": 4, "steps": 1}, generation={"maxNewTokens": 2})
    generator = RefusingGenerator(most=5, tokens=2)
    parts, fleet = make_parts(job, tmp_path, [generator])
    RolloutProducer(parts, generator, 0)._produce(parts.dispatch.claim(0))
    batch = parts.buffer.take(0, timeout=1)
    assert fleet.marked_down == [], "a message too large is no lost replica"
    assert batch is not None and len(batch.rollouts) == 16
    assert all(r.completion_ids == [7, 7] and r.finished for r in batch.rollouts)
    assert all(len(r.sequences) <= 5 for r in generator.answered)
    # Sequence i of a visit is seeded seed + i, split or not.
    offsets = {r.seed - _index(r.sequences[0].sample_id) for r in generator.answered}
    assert sorted(offsets) == [_seed(0, 0, 0), _seed(0, 0, 1)]


def _index(sample_id: str) -> int:
    """Where a sample is in its batch's visit (every sequence is open): sample ids are batch-prompt-sample."""
    _, prompt, sample = sample_id.split("-")
    return int(prompt) * 4 + int(sample)


class Adder(RefusingGenerator):
    """Answers every held-out sum right; its weights move to the next version after each call it answers."""

    def __init__(self, most: int, version: int):
        super().__init__(most)
        self.version = version

    def Generate(self, request, timeout=None):
        if len(request.sequences) > self.most:
            return super().Generate(request, timeout)
        self.answered.append(request)
        self.version += 1
        return generator_pb2.GenerateResponse(policy_version=self.version - 1, segments=[
            generator_pb2.Segment(sample_id=s.sample_id, token_ids=[ord(c) for c in _sum(s.prompt_ids)])
            for s in request.sequences])


def _sum(prompt_ids) -> str:
    a, _, b = "".join(chr(i) for i in prompt_ids).rstrip("=").partition("+")
    return str(int(a) + int(b))


def test_held_out_prompts_too_large_for_one_reply_are_scored_in_parts_named_by_their_newest_version():
    job = make_job(data={"type": "arithmetic", "maxOperand": 9, "heldOut": 20}, generation={"maxNewTokens": 3},
                   evaluation={"everySteps": 2, "limit": 10})
    generator = Adder(most=4, version=4)
    scorer = InProcessScorer(job)
    try:
        held = HeldOutEvaluator(job, CharTokenizer(), [generator], lambda replica: 4, remote_grader(job, [scorer]))
        held.start(4)
        result = held.take(wait=True)
    finally:
        scorer.close()
    assert result is not None and (result.scores.correct, result.scores.total) == (10, 10)
    assert [len(r.sequences) for r in generator.answered] == [2, 3, 2, 3]  # 10 halved, then each 5 halved
    assert result.policy_version == 7, "scored partly by newer weights: not version 4's accuracy"
