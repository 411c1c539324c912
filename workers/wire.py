"""gRPC plumbing shared by every worker: servers with health and reflection, and client channels."""

from __future__ import annotations

from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Rollouts of long generations are a few MB of token ids; weights never travel over gRPC.
MAX_MESSAGE_BYTES = 64 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def serve(
    port: int,
    add_servicers: Iterable[Callable[[grpc.Server], None]],
    service_names: Iterable[str],
    host: str = "0.0.0.0",
    threads: int = 8,
) -> tuple[grpc.Server, health.HealthServicer]:
    """Start a server on host:port with our services, grpc.health.v1 (SERVING) and reflection."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=OPTIONS)
    for add in add_servicers:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port}")
    server.start()
    return server, health_servicer


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=OPTIONS)


def wait_ready(address: str, timeout: float) -> None:
    """Block until the server at address answers health checks with SERVING."""
    with channel(address) as chan:
        grpc.channel_ready_future(chan).result(timeout=timeout)
        stub = health_pb2_grpc.HealthStub(chan)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{address} is not serving")


def invalid(context: grpc.ServicerContext, message: str) -> None:
    """Refuse a bad request with INVALID_ARGUMENT (aborts the call)."""
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
