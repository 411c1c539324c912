"""The WeightSync gRPC service: an executor that receives the policy's weights (a generator, the reference) joins
the trainers' sync group and receives each pushed version, staged, loaded into its engine at a safe point between
two of its own calls."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import grpc

from rlfleet.v1 import weight_sync_pb2, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.engines.base import Engine
from rlfleet.workers.metrics.families import GeneratorMetrics
from rlfleet.workers.sync.buckets import DTYPES

log = logging.getLogger(__name__)
SERVICE = weight_sync_pb2.DESCRIPTOR.services_by_name["WeightSync"].full_name
# A join request's bounds are the job schema's (trainer ranks: replicas x ranksPerPod, bucketMB, timeoutSeconds).
MAX_TRAINERS = 1024 * 64
MAX_BUCKET_BYTES = 16384 << 20
MAX_SYNC_TIMEOUT = 3600.0


class WeightSyncService(weight_sync_pb2_grpc.WeightSyncServicer):
    def __init__(self, job_id: str, engine: Engine, metrics: GeneratorMetrics, tp_size: int = 1, sync_key: str = ""):
        self.job_id = job_id
        self.engine = engine
        self.metrics = metrics
        """The executor's (a reference's are ReferenceMetrics): its clock, transfer, load and version."""
        self.tp_size = tp_size
        self.sync_key = sync_key
        """auth.sync_key of the token this service checks: what joining a sync group needs (never sent)."""
        # One engine, one user at a time: loading new weights waits for the running call (a safe point).
        self.lock = threading.Lock()
        # Receiving needs no engine, but one weight version at a time.
        self.sync_lock = threading.Lock()
        self.joined = False
        """Whether a sync group was joined: UpdateWeights before that would wait on nothing."""
        self.staged: int | None = None
        """Version received into the staging buffers but not yet loaded."""
        self.load_seconds = 0.0
        self.policy_version = 0

    @contextlib.contextmanager
    def safe_point(self) -> Iterator[int]:
        """Hold the engine for one call (generate, log-probs): weights staged before it are loaded first, none
        during it. Yields the policy version the call runs on."""
        with self.lock:
            self._load_staged()
            yield self.policy_version

    def JoinSyncGroup(self, request, context):
        self._check_job(request.job_id, context)
        problem = _join_problem(request)
        if problem:
            wire.invalid(context, problem)
        join = {
            "host": request.store_host, "port": request.store_port, "epoch": request.epoch,
            "trainers": request.trainers, "tp_size": self.tp_size, "dtype": request.dtype,
            "bucket_bytes": request.bucket_bytes, "backend": request.backend, "timeout": request.timeout_seconds,
            "verify": request.verify, "key": self.sync_key,
            "stages": max(request.pipeline_stages, 1),
            "shapes": [(p.name, list(p.shape)) for p in request.params],
        }
        with self.sync_lock, self.lock:
            self.joined = False  # a failed rejoin leaves no usable group
            # Staged weights belong to the old group: a new receiver's buffers hold nothing yet, and the
            # rejoin's push brings the current version anyway.
            self.staged = None
            try:
                self.engine.join_sync_group(join)
            except ValueError as error:  # the sync plan: shapes that do not fit this model
                wire.invalid(context, f"params: {str(error)[:200]}")
            self.joined = True
        return weight_sync_pb2.JoinSyncGroupResponse(job_id=self.job_id, tensor_parallel_size=self.tp_size)

    def UpdateWeights(self, request, context):
        """Receive now (the executor's calls go on); the weights are loaded at the next safe point.

        The reply comes once the weights are staged: every later call uses them.
        """
        self._check_job(request.job_id, context)
        if request.policy_version < 0:
            wire.invalid(context, f"policy_version must be >= 0, got {request.policy_version}")
        if not self.joined:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no weight-sync group joined (JoinSyncGroup first)")
        with self.sync_lock:
            if self.staged is not None:  # the staging buffers are about to be overwritten
                with self.lock:
                    self._load_staged()
            with contextlib.nullcontext() if self.engine.concurrent_receive else self.lock, \
                    self.metrics.clock.idle("receiving_weights"):
                received = self.engine.receive_weights()
            self.metrics.transfer.observe(received)
            self.staged = request.policy_version
            if self.lock.acquire(blocking=False):  # idle executor: load right away
                try:
                    self._load_staged()
                finally:
                    self.lock.release()
        log.info("policy version %d received in %.3f s", request.policy_version, received)
        return weight_sync_pb2.UpdateWeightsResponse(job_id=self.job_id, policy_version=request.policy_version,
                                                     receive_seconds=received, load_seconds=self.load_seconds)

    def _load_staged(self) -> None:
        """Caller holds self.lock: swap in staged weights between two calls of the engine."""
        if self.staged is None:
            return
        with self.metrics.clock.idle("loading_weights"):
            self.load_seconds = self.engine.load_weights()
        self.policy_version, self.staged = self.staged, None
        self.metrics.load.observe(self.load_seconds)
        self.metrics.version.set(self.policy_version)
        log.info("policy version %d loaded in %.3f s", self.policy_version, self.load_seconds)

    def _check_job(self, job_id: str, context: grpc.ServicerContext) -> None:
        if job_id != self.job_id:
            wire.invalid(context, f"job_id {job_id[:80]!r} is not this replica's job ({self.job_id!r})")


def _join_problem(request) -> str | None:
    """Why a JoinSyncGroup request cannot be served, or None; checked before anything waits on the group."""
    if not 0 < len(request.store_host) <= 253:
        return f"store_host: need 1..253 characters, got {len(request.store_host)}"
    if not 1 <= request.store_port <= 65535:
        return f"store_port: need 1..65535, got {request.store_port}"
    if not 1 <= request.trainers <= MAX_TRAINERS:
        return f"trainers: need 1..{MAX_TRAINERS}, got {request.trainers}"
    if request.backend not in ("gloo", "nccl"):
        return f"backend: need gloo or nccl, got {request.backend[:20]!r}"
    if request.dtype not in DTYPES:
        return f"dtype: need one of {', '.join(DTYPES)}, got {request.dtype[:20]!r}"
    if not 0.0 < request.timeout_seconds <= MAX_SYNC_TIMEOUT:
        return f"timeout_seconds: need (0, {MAX_SYNC_TIMEOUT:g}], got {request.timeout_seconds}"
    if not 1 <= request.bucket_bytes <= MAX_BUCKET_BYTES:
        return f"bucket_bytes: need 1..{MAX_BUCKET_BYTES}, got {request.bucket_bytes}"
    if request.epoch < 0:
        return f"epoch: need >= 0, got {request.epoch}"
    if not 0 <= request.pipeline_stages <= request.trainers or request.trainers % max(request.pipeline_stages, 1):
        return f"pipeline_stages: need a divisor of trainers ({request.trainers}), got {request.pipeline_stages}"
    if not request.params:
        return "params is empty"
    for index, param in enumerate(request.params):
        if not param.name or not param.shape or min(param.shape) < 1:
            return f"params[{index}]: need a name and a shape of positive sizes"
    return None
