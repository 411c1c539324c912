"""The Scorer gRPC server on a loopback port: rewards, refused requests, health."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_fuzz import UNDECODABLE, call_raw, oversized, unlimited_channel, wrong_answers_to_random_bytes
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.v1 import controller_pb2, generator_pb2, scorer_pb2, scorer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token
from rlfleet.workers.scorer.server import ScorerService, serve_scorer
from rlfleet.workers.spec import parse_job

pytestmark = pytest.mark.integration
TOKEN = new_token()
SCORERS = [
    {"type": "math_answer"},
    {"type": "regex_format", "pattern": r"(?s).*\\boxed\{.*\}.*", "weight": 0.5},
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def scorer_server():
    job = parse_job({"metadata": {"name": "t"}, "spec": {"scorers": SCORERS}})
    service = ScorerService(job)
    address = f"127.0.0.1:{_free_port()}"
    server = serve_scorer(job, int(address.split(":")[1]), host="127.0.0.1", service=service, token=TOKEN)
    try:
        wire.wait_ready(address, timeout=30)
        yield address, service
    finally:
        server.stop(None).wait(10)
        service.close()


@pytest.fixture
def scorer(scorer_server):
    address, service = scorer_server
    with wire.channel(address, TOKEN) as chan:
        yield chan, service


def _request(job_id: str, *triples: tuple[str, str, str]) -> scorer_pb2.ScoreRequest:
    items = [scorer_pb2.ScoreItem(sample_id=s, completion=c, answer=a) for s, c, a in triples]
    return scorer_pb2.ScoreRequest(job_id=job_id, items=items)


def _score(chan: grpc.Channel, request: scorer_pb2.ScoreRequest) -> scorer_pb2.ScoreResponse:
    return scorer_pb2_grpc.ScorerStub(chan).Score(request, timeout=60)


def test_scores_a_batch(scorer):
    chan, service = scorer
    reply = _score(chan, _request("t", ("a", "so \\boxed{4}", "4"), ("b", "4", "4"), ("c", "5", "4")))
    assert reply.job_id == "t"
    assert [s.sample_id for s in reply.scores] == ["a", "b", "c"]
    assert [s.reward for s in reply.scores] == [1.5, 1.0, 0.0]
    assert all(not s.errors for s in reply.scores)
    assert service.error_counts == {"math_answer": 0, "regex_format": 0}


@pytest.mark.parametrize(
    "request_",
    [
        _request("other-job", ("a", "4", "4")),
        _request("t"),
        _request("t", *[(str(i), "", "") for i in range(65537)]),
        _request("t", ("a", "x" * ((1 << 20) + 1), "4")),
        scorer_pb2.ScoreRequest(job_id="t", items=[scorer_pb2.ScoreItem(sample_id="a", fields_json="[1]")]),
        scorer_pb2.ScoreRequest(job_id="t", items=[scorer_pb2.ScoreItem(sample_id="a", fields_json="{")]),
    ],
    ids=["wrong-job", "empty", "too-many-items", "item-too-large", "fields-not-an-object", "fields-not-json"],
)
def test_refuses_bad_requests_and_keeps_serving(scorer, request_):
    chan, _ = scorer
    with pytest.raises(grpc.RpcError) as refused:
        _score(chan, request_)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _assert_serving(chan)


def _assert_serving(chan: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(chan)
    service_name = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name
    status = health.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert [s.reward for s in _score(chan, _request("t", ("a", "7", "7"))).scores] == [1.0]


SCORE = "/rlfleet.v1.Scorer/Score"


def test_random_bytes_are_refused_and_the_scorer_keeps_serving(scorer):
    chan, _ = scorer
    assert wrong_answers_to_random_bytes(chan, SCORE, scorer_pb2.ScoreRequest, "t", seed=1) == []
    _assert_serving(chan)


def test_oversized_message_is_resource_exhausted_and_the_scorer_keeps_serving(scorer_server, scorer):
    address, _ = scorer_server
    with unlimited_channel(address, TOKEN) as big:
        code, details = call_raw(big, SCORE, oversized())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    _assert_serving(scorer[0])


# Protobuf carries no type: another message decodes as a ScoreRequest whenever its fields line up. These decode
# into requests the scorer must refuse (no items) or into nothing at all (varints where UTF-8 is due).
WRONG_TYPES = {
    "controller-status": (controller_pb2.ControllerStatusRequest(job_id="t"), grpc.StatusCode.INVALID_ARGUMENT),
    "generate-request": (generator_pb2.GenerateRequest(job_id="t", max_tokens=8, sequences=[
        generator_pb2.Sequence(sample_id="a", prompt_ids=[200, 300])]), UNDECODABLE),
}


@pytest.mark.parametrize("message, code", WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_a_message_of_another_type_is_refused(scorer, message, code):
    chan, _ = scorer
    assert call_raw(chan, SCORE, message.SerializeToString())[0] == code
    _assert_serving(chan)
