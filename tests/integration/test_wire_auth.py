"""Worker gRPC on a loopback port requires the job's token: without it or with another, UNAUTHENTICATED;
health checks alone stay open (Kubernetes probes send no metadata)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet.v1 import controller_pb2, controller_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token
from rlfleet.workers.controller.status import Progress, serve_controller
from rlfleet.workers.plan import free_port

pytestmark = pytest.mark.integration
TOKEN = new_token()


@pytest.fixture(scope="module")
def address():
    port = free_port()
    server, _ = serve_controller("t", Progress(step=3), port, token=TOKEN)
    try:
        address = f"127.0.0.1:{port}"
        wire.wait_ready(address, timeout=30)  # health, without a token
        yield address
    finally:
        server.stop(None).wait(10)


def _status(chan: grpc.Channel, metadata=None):
    return controller_pb2_grpc.ControllerStub(chan).Status(controller_pb2.ControllerStatusRequest(job_id="t"),
                                                           timeout=10, metadata=metadata)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    assert TOKEN not in (refused.value.details() or "")
    return refused.value


def test_the_right_token_is_served(address):
    with wire.channel(address, TOKEN) as chan:
        assert _status(chan).step == 3


def test_no_token_is_refused(address):
    with grpc.insecure_channel(address) as chan:
        _refused(lambda: _status(chan))


@pytest.mark.parametrize("header", [f"Bearer {new_token()}", TOKEN, f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}",
                                    f"bearer {TOKEN}", "Bearer "], ids=["other-token", "no-scheme", "longer",
                                                                        "prefix", "lowercase-scheme", "empty"])
def test_a_wrong_token_is_refused(address, header):
    with grpc.insecure_channel(address) as chan:
        _refused(lambda: _status(chan, metadata=[("authorization", header)]))
    with wire.channel(address, new_token()) as chan:
        _refused(lambda: _status(chan))


def test_streaming_calls_and_unknown_methods_are_refused_alike(address):
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(address) as chan:
        reflection = reflection_pb2_grpc.ServerReflectionStub(chan)
        _refused(lambda: list(reflection.ServerReflectionInfo(iter([request]), timeout=10)))
        # Without the token, a missing method is not told apart from a present one.
        unknown = chan.unary_unary("/rlfleet.v1.Controller/Nope")
        _refused(lambda: unknown(b"", timeout=10))
    with wire.channel(address, TOKEN) as chan:  # the client interceptor covers stream-stream calls too
        replies = list(reflection_pb2_grpc.ServerReflectionStub(chan).ServerReflectionInfo(iter([request]),
                                                                                            timeout=10))
        assert "rlfleet.v1.Controller" in {s.name for s in replies[0].list_services_response.service}


def test_health_needs_no_token(address):
    with grpc.insecure_channel(address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        for service in ("", "rlfleet.v1.Controller"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_server_and_no_channel_without_a_token():
    with pytest.raises(ValueError, match="token"):
        serve_controller("t", Progress(), free_port(), token="")
    with pytest.raises(ValueError, match="token"):
        wire.channel("127.0.0.1:1", "")
