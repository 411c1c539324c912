"""Batches whose messages pass gRPC's message limit, over real gRPC on loopback: the controller's calls to a
generator, a scorer, the reference and the critic arrive in parts and every sample is answered; no replica is taken
for lost.

The peer's limit is lowered to 1 MiB (instead of building 107 MiB batches): either its replies fail
RESOURCE_EXHAUSTED and the caller halves its calls, or the caller knows the limit and plans parts that fit."""

from __future__ import annotations

from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from conftest import make_job, sampled
from fleet_fakes import make_parts
from rlfleet.v1 import (critic_pb2, critic_pb2_grpc, generator_pb2, generator_pb2_grpc, reference_pb2,
                        reference_pb2_grpc, scorer_pb2, scorer_pb2_grpc)
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token
from rlfleet.workers.controller.producer import RolloutProducer
from rlfleet.workers.controller.rollouts import Group, Rollout
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.critic.stage import CriticLink
from rlfleet.workers.plan import Endpoints, free_port
from rlfleet.workers.reference.stage import ReferencePolicy
from rlfleet.workers.scorer.stage import RuleScoring

pytestmark = pytest.mark.integration
TOKEN = new_token()
LIMIT = 1 << 20
# Token ids as long as varints get: replies of known, large size.
ID = (1 << 31) - 1
# 16 samples of 32 Ki tokens: a 4.5 MiB Generate reply, and as much in a Values reply.
TOKENS = 1 << 15
EXAMPLE = Example(id="0", prompt="0+0=", answer="0")


class Generator(generator_pb2_grpc.GeneratorServicer):
    """Every sequence gets TOKENS tokens and ends: replies grow with the call's sequences."""

    def __init__(self):
        self.calls: list[int] = []

    def Generate(self, request, context):
        self.calls.append(len(request.sequences))
        return generator_pb2.GenerateResponse(job_id=request.job_id, policy_version=3, segments=[
            generator_pb2.Segment(sample_id=s.sample_id, token_ids=[ID] * request.max_tokens,
                                  logprobs=[-1.0] * request.max_tokens, finished=True)
            for s in request.sequences])


class Critic(critic_pb2_grpc.CriticServicer):
    def __init__(self):
        self.calls: list[int] = []
        self.learned: list[list[int]] = []
        """The targets of each message of every Train call, as the servicer saw them (gRPC ends a stream early,
        with no error to the servicer, at a message past the limit)."""
        self.version = 0
        """One per whole step learned, as the critic counts (the controller checks it)."""

    def Values(self, request, context):
        self.calls.append(len(request.sequences))
        return critic_pb2.ValuesResponse(job_id=request.job_id, sequences=[
            critic_pb2.TokenValues(sample_id=s.sample_id, values=[0.5] * len(s.completion_ids))
            for s in request.sequences])


    def Train(self, request_iterator, context):
        messages = list(request_iterator)
        self.learned.append([len(m.targets) for m in messages])
        targets = sum(len(m.targets) for m in messages)
        self.version += targets == (messages[0].step_targets or len(messages[0].targets))
        return critic_pb2.TrainResponse(job_id="t", value_loss=targets, critic_version=self.version)


class Reference(reference_pb2_grpc.ReferenceServicer):
    def __init__(self):
        self.calls: list[int] = []

    def LogProbs(self, request, context):
        self.calls.append(len(request.sequences))
        return reference_pb2.LogProbsResponse(job_id=request.job_id, sequences=[
            reference_pb2.TokenLogProbs(sample_id=s.sample_id, logprobs=[-0.5] * len(s.completion_ids))
            for s in request.sequences])


class Scorer(scorer_pb2_grpc.ScorerServicer):
    def __init__(self):
        self.calls: list[int] = []

    def Score(self, request, context):
        self.calls.append(len(request.items))
        return scorer_pb2.ScoreResponse(scores=[scorer_pb2.Score(sample_id=i.sample_id, reward=len(i.completion))
                                                for i in request.items])


@pytest.fixture
def peer():
    """A generator, a critic, a reference and a scorer whose server sends and takes messages of at most LIMIT
    bytes."""
    found = SimpleNamespace(generator=Generator(), critic=Critic(), reference=Reference(), scorer=Scorer())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
        ("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)])
    generator_pb2_grpc.add_GeneratorServicer_to_server(found.generator, server)
    critic_pb2_grpc.add_CriticServicer_to_server(found.critic, server)
    reference_pb2_grpc.add_ReferenceServicer_to_server(found.reference, server)
    scorer_pb2_grpc.add_ScorerServicer_to_server(found.scorer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    found.address = f"127.0.0.1:{port}"
    try:
        yield found
    finally:
        server.stop(None).wait(10)


def _generated(tmp_path, address: str) -> tuple[object, list[int]]:
    """Batch 0 of 4 prompts x 4 samples of TOKENS tokens, produced through a real channel; and the replicas marked
    down meanwhile."""
    job = make_job(algorithm={"groupSize": 4, "promptsPerStep": 4, "steps": 1}, generation={"maxNewTokens": TOKENS})
    with wire.channel(address, TOKEN) as chan:
        stub = generator_pb2_grpc.GeneratorStub(chan)
        parts, fleet = make_parts(job, tmp_path, [stub])
        RolloutProducer(parts, stub, 0)._produce(parts.dispatch.claim(0))
    return parts.buffer.take(0, timeout=1), fleet.marked_down


def _complete(batch) -> bool:
    return len(batch.rollouts) == 16 and all(
        r.finished and r.completion_ids == [ID] * TOKENS and r.versions == [3] * TOKENS for r in batch.rollouts)


def test_a_reply_past_the_peers_limit_is_halved_until_it_fits(tmp_path, peer):
    batch, marked_down = _generated(tmp_path, peer.address)
    assert marked_down == [], "a message too large is no lost replica"
    assert batch is not None and _complete(batch)
    assert peer.generator.calls[0] == 16 and sum(peer.generator.calls) > 16  # refused whole, then answered in parts


def test_a_caller_that_knows_the_limit_sends_parts_that_fit_at_once(tmp_path, peer, monkeypatch):
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", LIMIT)  # the caller's limit is the peer's
    batch, marked_down = _generated(tmp_path, peer.address)
    assert marked_down == [] and batch is not None and _complete(batch)
    assert sum(peer.generator.calls) == 16 and max(peer.generator.calls) < 16  # each sample generated once


def _critic(address: str) -> CriticLink:
    job = make_job(algorithm={"advantage": "gae"}, roles={"critic": {}})
    endpoints = Endpoints("", servers={"critic": [address]})
    return CriticLink(SimpleNamespace(job=job, endpoints=endpoints, token=TOKEN, leader_epoch=None))


def _rollouts() -> list[Rollout]:
    return [Rollout(sample_id=str(n), prompt=n, prompt_ids=[1], answer="", turns=sampled([ID] * TOKENS),
                    returns=[1.0] * TOKENS, values=[0.5] * TOKENS) for n in range(16)]


def test_critic_values_past_the_peers_limit_come_in_parts(peer):
    link, rollouts = _critic(peer.address), _rollouts()
    for rollout in rollouts:
        rollout.values = []
    try:
        link.annotate(0, [Group(0, EXAMPLE, rollouts)])
    finally:
        link.close()
    assert all(r.values == [0.5] * TOKENS for r in rollouts)
    # Requests past the limit are refused on arrival (never reach the critic), then sent in halves.
    assert sum(peer.critic.calls) == 16 and max(peer.critic.calls) < 16


def test_a_critic_train_past_the_peers_limit_streams_its_step_in_smaller_messages(peer):
    link = _critic(peer.address)
    try:
        link.learn(_rollouts(), step=4)
        metrics = link.after_train()
    finally:
        link.close()
    assert metrics["value_loss"] == 16  # one call learned every target of the step
    [messages] = [m for m in peer.critic.learned if sum(m) == 16]  # one stream of the whole step came through
    assert max(messages) < 16


def test_reference_logprobs_past_the_peers_limit_come_in_parts(peer):
    job = make_job(algorithm={"kl": {"coef": 0.1}}, roles={"reference": {}})
    endpoints = Endpoints("", servers={"reference": [peer.address]}, sync={"reference": ["127.0.0.1:1"]})
    reference = ReferencePolicy(SimpleNamespace(job=job, endpoints=endpoints, token=TOKEN, leader_epoch=None),
                                SimpleNamespace(push_shapes={}), PolicyVersion(0))
    rollouts = _rollouts()
    try:
        reference.annotate(0, [Group(0, EXAMPLE, rollouts)])
    finally:
        reference.close()
    assert all(r.ref_logprobs == [-0.5] * TOKENS for r in rollouts)
    assert sum(peer.reference.calls) == 16 and max(peer.reference.calls) < 16


def test_scores_past_the_peers_limit_come_in_parts(tmp_path, peer):
    job = make_job(algorithm={"groupSize": 16, "promptsPerStep": 1})
    with wire.channel(peer.address, TOKEN) as chan:
        group = Group(0, EXAMPLE, _rollouts())
        RuleScoring(job, [scorer_pb2_grpc.ScorerStub(chan)], lambda ids: "7" * 8 * len(ids)).annotate(0, [group])
    assert all(r.reward == 8 * TOKENS for r in group.rollouts)
    assert sum(peer.scorer.calls) == 16 and max(peer.scorer.calls) < 16
