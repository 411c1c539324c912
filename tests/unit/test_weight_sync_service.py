"""Weight sync is its own gRPC service, served by every executor that receives weights: the generator serves it
beside Generator, the reference beside Reference and no Generator service. Real servers on loopback, each on an
engine that records what the trainer's calls did to it."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from rlfleet.v1 import generator_pb2, generator_pb2_grpc, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token
from rlfleet.workers.generator.server import serve_generator
from rlfleet.workers.plan import free_port
from rlfleet.workers.reference.server import serve_reference

from conftest import make_job
from test_generator_staging import StagingEngine, _join, _update

TOKEN = new_token()
SERVES = {"generator": {"rlfleet.v1.Generator", "rlfleet.v1.WeightSync"},
          "reference": {"rlfleet.v1.Reference", "rlfleet.v1.WeightSync"}}


@contextlib.contextmanager
def _serving(role: str):
    """(channel, engine) of `role`'s server on loopback."""
    engine, port = StagingEngine(), free_port()
    if role == "generator":
        server, _ = serve_generator("t", engine, port, "127.0.0.1", token=TOKEN)
    else:
        server, _ = serve_reference(make_job(roles={"reference": {}}), engine, port, "127.0.0.1", token=TOKEN)
    try:
        with wire.channel(f"127.0.0.1:{port}", TOKEN) as chan:
            yield chan, engine
    finally:
        server.stop(None).wait(10)


@pytest.fixture(params=sorted(SERVES))
def served(request):
    """(role, channel, engine) of each receiving role's server."""
    with _serving(request.param) as (chan, engine):
        yield request.param, chan, engine


def test_health_and_reflection_list_what_each_executor_serves(served):
    role, chan, _ = served
    stub = reflection_pb2_grpc.ServerReflectionStub(chan)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    listed = {s.name for s in next(iter(replies)).list_services_response.service}
    assert listed - {health.SERVICE_NAME, reflection.SERVICE_NAME} == SERVES[role]
    for service in SERVES[role]:
        reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, (role, service)


def test_the_trainers_calls_join_and_load_weights_on_every_receiving_executor(served):
    role, chan, engine = served
    stub = weight_sync_pb2_grpc.WeightSyncStub(chan)
    assert stub.JoinSyncGroup(_join(1), timeout=10).tensor_parallel_size == 1, role
    assert stub.UpdateWeights(_update(4), timeout=10).policy_version == 4, role
    assert engine.loaded == [{"epoch": 1, "filled": True}], f"the {role} loaded {engine.loaded}"


def test_the_reference_serves_no_generator_method():
    with _serving("reference") as (chan, _):
        stub = generator_pb2_grpc.GeneratorStub(chan)
        with pytest.raises(grpc.RpcError) as generate:
            stub.Generate(generator_pb2.GenerateRequest(job_id="t"), timeout=10)
        with pytest.raises(grpc.RpcError) as status:
            stub.Status(generator_pb2.GeneratorStatusRequest(job_id="t"), timeout=10)
    assert generate.value.code() == status.value.code() == grpc.StatusCode.UNIMPLEMENTED, status.value.details()
