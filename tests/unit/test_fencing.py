"""Fencing: executors refuse a deposed controller's late calls. Real servers on loopback (a generator on an engine
that records what it was made to do, a critic that counts what it learns, the scorer): once a call of leader epoch
N + 1 arrived, a state-changing call of epoch N is refused with FAILED_PRECONDITION, and its client stops with
wire.Fenced instead of retrying; calls that only read stay open to anyone."""

from __future__ import annotations

import grpc
import pytest
from fleet_fakes import FakeGenerator, make_parts, train
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_critic_state import CountingCritic, _train
from test_generator_staging import StagingEngine, _generate, _join, _update

from rlfleet.v1 import (controller_pb2, critic_pb2, critic_pb2_grpc, environment_pb2, generator_pb2,
                        generator_pb2_grpc, reference_pb2, scorer_pb2, scorer_pb2_grpc, weight_sync_pb2,
                        weight_sync_pb2_grpc)
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token
from rlfleet.workers.controller.calls import call_replica
from rlfleet.workers.controller.producer import RolloutProducer
from rlfleet.workers.controller.receivers import WeightReceivers
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.rollouts import Stopped
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.critic.server import serve_critic
from rlfleet.workers.generator.server import serve_generator
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port
from rlfleet.workers.scorer.server import ScorerService, serve_scorer

from conftest import make_job

TOKEN = new_token()


@pytest.fixture
def generator():
    """(address, engine) of a generator server on loopback."""
    engine, port = StagingEngine(), free_port()
    server, _ = serve_generator("t", engine, port, "127.0.0.1", token=TOKEN)
    try:
        yield f"127.0.0.1:{port}", engine
    finally:
        server.stop(None).wait(10)


@pytest.fixture
def scorer():
    job = make_job()
    service, port = ScorerService(job), free_port()
    server = serve_scorer(job, port, host="127.0.0.1", service=service, token=TOKEN)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(10)
        service.close()


def _stubs(address: str, epoch: int | None):
    chan = wire.channel(address, TOKEN, epoch)
    return generator_pb2_grpc.GeneratorStub(chan), weight_sync_pb2_grpc.WeightSyncStub(chan)


def _fenced(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
    return refused.value


def _score(stub):
    return stub.Score(scorer_pb2.ScoreRequest(job_id="t", items=[scorer_pb2.ScoreItem(sample_id="a", completion="1",
                                                                                       answer="1")]), timeout=30)


def test_a_restarted_worker_still_refuses_the_leaders_it_had_refused(tmp_path, monkeypatch):
    """The newest epoch outlives the worker's process (a file in its folder of the run directory, which cli.py names):
    a generator restarted on its port refuses a deposed leader's late call before the new leader calls it again."""
    monkeypatch.setenv(wire.FENCE_DIR_ENV, str(tmp_path / "fence" / "generator-0"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    for restarted in (False, True):
        server, _ = serve_generator("t", StagingEngine(), port, "127.0.0.1", token=TOKEN)
        try:
            if restarted:
                _fenced(lambda: _stubs(address, 3)[1].JoinSyncGroup(_join(2), timeout=10))
                _fenced(lambda: _stubs(address, 3)[0].Generate(_generate(), timeout=10))
            assert _stubs(address, 4)[1].JoinSyncGroup(_join(1), timeout=10).tensor_parallel_size == 1
        finally:
            server.stop(None).wait(10)
    assert (tmp_path / "fence" / "generator-0" / f"{port}.epoch").read_text() == "4\n"


def test_a_deposed_leaders_late_calls_are_refused_and_reads_stay_open(generator):
    address, engine = generator
    old_generate, old_sync = _stubs(address, 3)
    new_generate, new_sync = _stubs(address, 4)
    assert old_sync.JoinSyncGroup(_join(1), timeout=10).tensor_parallel_size == 1  # epoch 3 leads
    new_sync.JoinSyncGroup(_join(2), timeout=10)  # epoch 4 takes over
    refused = _fenced(lambda: old_generate.Generate(_generate(), timeout=10))
    assert "a deposed controller (epoch 3)" in refused.details() and "leader is epoch 4" in refused.details()
    assert dict(refused.trailing_metadata())[wire.EPOCH_HEADER] == "4"
    _fenced(lambda: old_sync.UpdateWeights(_update(7), timeout=10))
    _fenced(lambda: old_sync.JoinSyncGroup(_join(3), timeout=10))
    assert [r["epoch"] for r in engine.receivers] == [1, 2], "a deposed controller's join reached the engine"
    assert engine.loaded == [], "a deposed controller's push was loaded"
    # Reads stay open to it, and to callers that send no epoch at all.
    reply = old_generate.Status(generator_pb2.GeneratorStatusRequest(job_id="t"), timeout=10)
    assert reply.policy_version == 0
    with wire.channel(address, TOKEN) as chan:
        generator_pb2_grpc.GeneratorStub(chan).Status(generator_pb2.GeneratorStatusRequest(job_id="t"), timeout=10)
        health = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # The leader goes on.
    assert new_sync.UpdateWeights(_update(7), timeout=10).policy_version == 7
    assert new_generate.Generate(_generate(), timeout=10).policy_version == 7


def test_the_same_epoch_goes_on_and_a_newer_one_fences_the_last(scorer):
    leaders = {epoch: scorer_pb2_grpc.ScorerStub(wire.channel(scorer, TOKEN, epoch)) for epoch in (5, 6, 9)}
    for epoch in (5, 5, 6, 6, 9):
        assert len(_score(leaders[epoch]).scores) == 1, epoch
    for epoch in (5, 6):
        refused = _fenced(lambda: _score(leaders[epoch])).details()
        assert f"(epoch {epoch})" in refused and "leader is epoch 9" in refused, refused


def test_a_call_without_an_epoch_is_served_until_a_leader_calls(scorer):
    with wire.channel(scorer, TOKEN) as chan:
        anyone = scorer_pb2_grpc.ScorerStub(chan)
        assert len(_score(anyone).scores) == 1  # a standalone server: tools, benchmarks, tests
        _score(scorer_pb2_grpc.ScorerStub(wire.channel(scorer, TOKEN, 1)))
        refused = _fenced(lambda: _score(anyone))
    assert f"without {wire.EPOCH_HEADER}: controller epoch 1 leads" in refused.details()


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", "", str(1 << 63)])
def test_an_epoch_that_is_no_leader_epoch_is_an_invalid_argument(scorer, value):
    with grpc.insecure_channel(scorer) as chan:
        with pytest.raises(grpc.RpcError) as bad:
            scorer_pb2_grpc.ScorerStub(chan).Score(scorer_pb2.ScoreRequest(job_id="t"), timeout=10, metadata=[
                (wire.AUTH_HEADER, f"Bearer {TOKEN}"), (wire.EPOCH_HEADER, value)])
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value
    assert wire.EPOCH_HEADER in bad.value.details()


def test_a_call_refused_its_token_moves_no_epoch(scorer):
    """Else anyone who reaches the port could fence the leader out with a large epoch."""
    with grpc.insecure_channel(scorer) as chan:
        with pytest.raises(grpc.RpcError) as refused:
            scorer_pb2_grpc.ScorerStub(chan).Score(scorer_pb2.ScoreRequest(job_id="t"), timeout=10,
                                                   metadata=[(wire.EPOCH_HEADER, "1000")])
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(_score(scorer_pb2_grpc.ScorerStub(wire.channel(scorer, TOKEN, 1))).scores) == 1


def test_a_streamed_call_is_fenced_before_it_is_read_and_a_methods_own_precondition_is_no_fence(tmp_path):
    critic, port = CountingCritic(), free_port()
    server, _ = serve_critic(make_job(), critic, port, 64, tmp_path, host="127.0.0.1", token=TOKEN)
    try:
        address = f"127.0.0.1:{port}"
        old, new = (critic_pb2_grpc.CriticStub(wire.channel(address, TOKEN, epoch)) for epoch in (1, 2))
        _train(old, 0)
        _train(new, 1)
        refused = _fenced(lambda: _train(old, 2))
        with pytest.raises(wire.Fenced, match="epoch 1"):
            wire.raise_if_misconfigured(refused, "Train on the critic")
        assert critic.learned == [0, 1]
        # Restore refuses a step never saved with FAILED_PRECONDITION too: its caller must not take it for a fence.
        missing = _fenced(lambda: new.Restore(critic_pb2.CheckpointRequest(job_id="t", step=7), timeout=10))
        wire.raise_if_misconfigured(missing, "Restore on the critic")
    finally:
        server.stop(None).wait(10)


def test_a_fenced_call_stops_its_caller_at_once_instead_of_trying_another_replica(scorer):
    _score(scorer_pb2_grpc.ScorerStub(wire.channel(scorer, TOKEN, 2)))
    deposed = [scorer_pb2_grpc.ScorerStub(wire.channel(scorer, TOKEN, 1)) for _ in range(2)]
    tried = []

    def score(stub):
        tried.append(stub)
        return stub.Score

    with pytest.raises(wire.Fenced, match=r"Score on replica 0: .*deposed controller \(epoch 1\)"):
        call_replica(deposed, score, scorer_pb2.ScoreRequest(job_id="t"), what="Score", deadline=10, grace=60)
    assert tried == deposed[:1]


def test_a_producer_fenced_by_its_generator_stops_the_run_and_marks_no_replica_down(generator, tmp_path):
    address, _ = generator
    _, leader = _stubs(address, 2)
    leader.JoinSyncGroup(_join(1), timeout=10)
    job = make_job(algorithm={"maxStaleness": 1, "steps": 2, "promptsPerStep": 1, "groupSize": 2})
    parts, fleet = make_parts(job, tmp_path, [FakeGenerator()])
    RolloutProducer(parts, _stubs(address, 1)[0], 0).start()
    with pytest.raises(Stopped) as stopped:
        train(parts, fleet, range(2), seconds=30)
    assert isinstance(stopped.value.__cause__, wire.Fenced), stopped.value.__cause__
    assert not fleet.marked_down, "a deposed controller has no replica to mark down: it stops"


class PushingTrainer:
    """Trainer rank 0's side of a push, sending nothing."""

    push_shapes = {"w": (2,)}

    def connect(self, role, replica, host, port, epoch):
        return None

    def publish(self, role, targets):
        return 0.0


def test_a_push_refused_by_the_fence_stops_the_deposed_controller(generator):
    address, engine = generator
    ctx = WorkerContext(job=make_job(), role="trainer", rank=0, grpc_port=0, metrics_port=0, run_dir="",
                        endpoints=Endpoints("", servers={"generator": [address]},
                                            sync={"generator": ["127.0.0.1:1"]}),
                        token=TOKEN, leader_epoch=1)
    receivers = WeightReceivers(ctx, PushingTrainer(), ReplicaStates(1, 0), PolicyVersion(0))
    try:
        receivers.join_all()
        assert engine.loaded, "epoch 1 led: its push was loaded"
        _stubs(address, 2)[1].JoinSyncGroup(_join(9), timeout=10)  # epoch 2 takes over
        receivers.publish()
        with pytest.raises(wire.Fenced, match="UpdateWeights of the generators"):
            receivers.wait()
    finally:
        receivers.stop()


def test_the_read_only_methods_are_methods_of_our_services():
    """A renamed one would be fenced: safe, but a deposed controller, the operator and the CLI could not read it."""
    methods = {f"/{service.full_name}/{method.name}"
               for module in (controller_pb2, critic_pb2, environment_pb2, generator_pb2, reference_pb2, scorer_pb2,
                              weight_sync_pb2)
               for service in module.DESCRIPTOR.services_by_name.values() for method in service.methods}
    assert wire.READ_ONLY_METHODS < methods
    assert all(method.startswith(wire.FENCED_PREFIX) for method in methods)
