"""Read a job's progress from its controller (trainer rank 0, or the leading controller pod) over the Controller gRPC
Status call."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlfleet.operator import names
from rlfleet.operator.assess import Progress
from rlfleet.operator.kube import Kube, collection_path
from rlfleet.operator.objects import secret_token
from rlfleet.workers.plan import cluster_endpoints, cluster_port, pod_host, replicas
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
# Called every status interval for every job: an unreachable controller (starting, suspended, or no
# cluster at all in tests) must cost little and never fail the status update.
STATUS_TIMEOUT_SECONDS = 2.0


async def job_token(kube: Kube, job: RLJob) -> str | None:
    """The job's gRPC token from its Secret, or None while there is none."""
    path = f"{collection_path('v1', 'Secret', job.metadata.namespace)}/{names.token_secret_name(job)}"
    secret = await kube.get(path)
    return secret_token(secret) if secret else None


async def controller_address(kube: Kube, job: RLJob) -> str:
    """Where the job's controller serves its status. A controller of its own (spec.roles.controller) serves it only
    while it leads: the pod its Lease names as holder (controller/lease.py), or pod 0 while none of the job's does
    (none yet, or released: whoever leads next answers there or is found at the next look)."""
    fallback = cluster_endpoints(job).controller
    if job.spec.roles.controller is None:
        return fallback
    lease = await kube.get(f"{collection_path('coordination.k8s.io/v1', 'Lease', job.metadata.namespace)}/"
                           f"{names.controller_name(job)}")
    holder = ((lease or {}).get("spec") or {}).get("holderIdentity") or ""
    ordinal = holder.removeprefix(f"{names.role_name(job, 'control')}-")
    if ordinal == holder or not ordinal.isdigit() or int(ordinal) >= replicas(job, "control"):
        return fallback
    return f"{pod_host(job, 'control', int(ordinal))}:{cluster_port('grpc')}"


async def read_progress(address: str, job_id: str, token: str,
                        timeout: float = STATUS_TIMEOUT_SECONDS) -> Progress | None:
    """The controller's progress, or None when it does not answer (yet)."""
    return await asyncio.to_thread(_read, address, job_id, token, timeout)


def _read(address: str, job_id: str, token: str, timeout: float) -> Progress | None:
    from rlfleet.v1 import controller_pb2, controller_pb2_grpc
    from rlfleet.workers import wire

    try:
        with wire.channel(address, token) as channel:
            reply = controller_pb2_grpc.ControllerStub(channel).Status(
                controller_pb2.ControllerStatusRequest(job_id=job_id), timeout=timeout)
    except grpc.RpcError as error:
        log.debug("controller %s not answering: %s", address, error.code())
        return None
    return Progress(phase=reply.phase, step=reply.step, total_steps=reply.total_steps,
                    policy_version=reply.policy_version, reward_mean=reply.reward_mean)
