"""The Controller gRPC service on a loopback port: progress, refused job ids, reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_fuzz import call_raw, oversized, unlimited_channel, wrong_answers_to_random_bytes
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet.v1 import controller_pb2, controller_pb2_grpc, scorer_pb2
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token
from rlfleet.workers.controller.status import Progress, serve_controller
from rlfleet.workers.plan import free_port

pytestmark = pytest.mark.integration
SERVICE = "rlfleet.v1.Controller"
TOKEN = new_token()


@pytest.fixture
def controller_server():
    port = free_port()
    progress = Progress(step=3, total_steps=10, policy_version=3, reward_mean=0.25, samples_trained=96,
                        samples_dropped_stale=4, tokens_generated=1234)
    server, service = serve_controller("t", progress, port, token=TOKEN)
    try:
        address = f"127.0.0.1:{port}"
        wire.wait_ready(address, timeout=30)
        yield address, service
    finally:
        server.stop(None).wait(10)


@pytest.fixture
def controller(controller_server):
    address, service = controller_server
    with wire.channel(address, TOKEN) as chan:
        yield chan, service


def _status(chan, job_id="t"):
    return controller_pb2_grpc.ControllerStub(chan).Status(controller_pb2.ControllerStatusRequest(job_id=job_id),
                                                           timeout=10)


def test_status_returns_progress(controller):
    chan, service = controller
    reply = _status(chan)
    assert (reply.job_id, reply.phase, reply.step, reply.total_steps, reply.policy_version) == ("t", "Running", 3, 10, 3)
    assert (reply.reward_mean, reply.samples_trained, reply.samples_dropped_stale, reply.tokens_generated) == (
        0.25, 96, 4, 1234)

    service.set(phase="Succeeded", step=10, policy_version=10, reward_mean=0.75)
    service.count(samples_trained=5)
    service.count(samples_trained=7)
    reply = _status(chan)
    assert (reply.phase, reply.step, reply.policy_version, reply.reward_mean) == ("Succeeded", 10, 10, 0.75)
    assert reply.samples_trained == 96 + 5 + 7


@pytest.mark.parametrize("job_id", ["other", "", "t" * 10_000])
def test_wrong_job_is_invalid_argument(controller, job_id):
    chan, _ = controller
    with pytest.raises(grpc.RpcError) as refused:
        _status(chan, job_id)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(refused.value.details()) < 300
    assert _status(chan).step == 3


def test_reflection_lists_the_controller(controller):
    chan, _ = controller
    stub = reflection_pb2_grpc.ServerReflectionStub(chan)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


STATUS = "/rlfleet.v1.Controller/Status"


def test_random_bytes_are_refused_and_the_controller_keeps_serving(controller):
    chan, _ = controller
    assert wrong_answers_to_random_bytes(chan, STATUS, controller_pb2.ControllerStatusRequest, "t", seed=2) == []
    assert _status(chan).step == 3


def test_oversized_message_is_resource_exhausted_and_the_controller_keeps_serving(controller_server, controller):
    address, _ = controller_server
    with unlimited_channel(address, TOKEN) as big:
        code, details = call_raw(big, STATUS, oversized())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert _status(controller[0]).step == 3


# A Status request is a job id alone, so another message decodes as one whenever its field 1 is a string; these
# carry another job's id, or a number where the id is due (read as an unknown field: no id at all).
WRONG_TYPES = {
    "score-request": scorer_pb2.ScoreRequest(job_id="other", items=[scorer_pb2.ScoreItem(sample_id="a")]),
    "health-response": health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING),
}


@pytest.mark.parametrize("message", WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_a_message_of_another_type_is_refused(controller, message):
    chan, _ = controller
    assert call_raw(chan, STATUS, message.SerializeToString())[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert _status(chan).step == 3
