"""The Controller gRPC service: progress for the operator and the CLI."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

from rlfleet.v1 import controller_pb2, controller_pb2_grpc
from rlfleet.workers import wire

SERVICE = controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name


@dataclass
class Progress:
    phase: str = "Running"
    step: int = 0
    total_steps: int = 0
    policy_version: int = 0
    reward_mean: float = 0.0
    samples_trained: int = 0
    samples_dropped_stale: int = 0
    tokens_generated: int = 0


class ControllerService(controller_pb2_grpc.ControllerServicer):
    def __init__(self, job_id: str, progress: Progress):
        self.job_id = job_id
        self.progress = progress
        self.lock = threading.Lock()

    def set(self, **fields) -> None:
        with self.lock:
            for name, value in fields.items():
                setattr(self.progress, name, value)

    def count(self, **increments) -> None:
        with self.lock:
            for name, value in increments.items():
                setattr(self.progress, name, getattr(self.progress, name) + value)

    def Status(self, request, context):
        if request.job_id != self.job_id:
            wire.invalid(context, f"job_id {request.job_id[:80]!r} is not this controller's job ({self.job_id!r})")
        with self.lock:
            return controller_pb2.ControllerStatusResponse(job_id=self.job_id, **self.progress.__dict__)


def serve_controller(job_id: str, progress: Progress, port: int, host: str = "0.0.0.0", *,
                     token: str) -> tuple[grpc.Server, ControllerService]:
    service = ControllerService(job_id, progress)
    server, _ = wire.serve(port, [lambda s: controller_pb2_grpc.add_ControllerServicer_to_server(service, s)],
                           [SERVICE], host, token=token)
    return server, service
