"""The Scorer gRPC server on a loopback port: rewards, refused requests, health."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.v1 import scorer_pb2, scorer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.scorer.server import ScorerService, serve_scorer
from rlfleet.workers.spec import parse_job

pytestmark = pytest.mark.integration
SCORERS = [
    {"type": "math_answer"},
    {"type": "regex_format", "pattern": r"(?s).*\\boxed\{.*\}.*", "weight": 0.5},
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def scorer():
    job = parse_job({"metadata": {"name": "t"}, "spec": {"scorers": SCORERS}})
    service = ScorerService(job)
    address = f"127.0.0.1:{_free_port()}"
    server = serve_scorer(job, int(address.split(":")[1]), host="127.0.0.1", service=service)
    try:
        wire.wait_ready(address, timeout=30)
        with wire.channel(address) as chan:
            yield chan, service
    finally:
        server.stop(None).wait(10)
        service.close()


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
    ],
    ids=["wrong-job", "empty", "too-many-items", "item-too-large"],
)
def test_refuses_bad_requests_and_keeps_serving(scorer, request_):
    chan, _ = scorer
    with pytest.raises(grpc.RpcError) as refused:
        _score(chan, request_)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    health = health_pb2_grpc.HealthStub(chan)
    service_name = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name
    status = health.Check(health_pb2.HealthCheckRequest(service=service_name), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert [s.reward for s in _score(chan, _request("t", ("a", "7", "7"))).scores] == [1.0]
