"""The Generator gRPC service: segments for a batch of sequences, and weight updates at safe points."""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time

import grpc

from rlfleet.v1 import generator_pb2, generator_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import sync_key
from rlfleet.workers.engines.base import Engine, Sampling, SequenceIn
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import GeneratorMetrics
from rlfleet.workers.generator.config import MIN_TEMPERATURE
from rlfleet.workers.sync.buckets import DTYPES

log = logging.getLogger(__name__)
# The request's temperature is a float32: 0.01 arrives as 0.0099999998.
WIRE_MIN_TEMPERATURE = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]
SERVICE = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name
# A join request's bounds are the job schema's (trainer ranks: replicas x ranksPerPod, bucketMB, timeoutSeconds).
MAX_TRAINERS = 1024 * 64
MAX_BUCKET_BYTES = 16384 << 20
MAX_SYNC_TIMEOUT = 3600.0


class GeneratorService(generator_pb2_grpc.GeneratorServicer):
    METRICS = GeneratorMetrics
    """The metric families of the executor this service runs in."""

    def __init__(self, job_id: str, engine: Engine, tp_size: int = 1, metrics: WorkerMetrics | None = None,
                 sync_key: str = ""):
        self.job_id = job_id
        self.engine = engine
        self.tp_size = tp_size
        self.sync_key = sync_key
        """auth.sync_key of the token this service checks: what joining a sync group needs (never sent)."""
        # One engine, one user at a time: loading new weights waits for the running batch (a safe point).
        self.lock = threading.Lock()
        # Receiving needs no engine, but one weight version at a time.
        self.sync_lock = threading.Lock()
        self.joined = False
        """Whether a sync group was joined: UpdateWeights before that would wait on nothing."""
        self.staged: int | None = None
        """Version received into the staging buffers but not yet loaded."""
        self.load_seconds = 0.0
        self.policy_version = 0
        self.busy_seconds = 0.0
        self.tokens_generated = 0
        self.started = time.monotonic()
        self.metrics = self.METRICS(metrics or WorkerMetrics("generator", job=job_id))

    def Generate(self, request, context):
        self._check_job(request.job_id, context)
        problem = self._problem(request)
        if problem:
            wire.invalid(context, problem)
        sequences = [SequenceIn(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]
        sampling = Sampling(request.max_tokens, request.temperature, request.top_p, request.seed)
        with self.metrics.requests.track_inprogress(), self.lock:
            self._load_staged()
            start = time.monotonic()
            with self.metrics.clock.busy():
                segments = self.engine.generate(sequences, sampling)
            self.busy_seconds += time.monotonic() - start
            version = self.policy_version
        tokens = sum(len(s.token_ids) for s in segments)
        self.tokens_generated += tokens
        self.metrics.tokens.inc(tokens)
        return generator_pb2.GenerateResponse(
            job_id=self.job_id,
            policy_version=version,
            segments=[
                generator_pb2.Segment(sample_id=seq.sample_id, token_ids=seg.token_ids, logprobs=seg.logprobs,
                                      finished=seg.finished)
                for seq, seg in zip(request.sequences, segments)
            ],
        )

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
        return generator_pb2.JoinSyncGroupResponse(job_id=self.job_id, tensor_parallel_size=self.tp_size)

    def UpdateWeights(self, request, context):
        """Receive now (generation goes on); the weights are loaded at the next safe point.

        The reply comes once the weights are staged: every later Generate uses them.
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
            if self.lock.acquire(blocking=False):  # idle generator: load right away
                try:
                    self._load_staged()
                finally:
                    self.lock.release()
        log.info("policy version %d received in %.3f s", request.policy_version, received)
        return generator_pb2.UpdateWeightsResponse(job_id=self.job_id, policy_version=request.policy_version,
                                                   receive_seconds=received, load_seconds=self.load_seconds)

    def _load_staged(self) -> None:
        """Caller holds self.lock: swap in staged weights between two generate calls."""
        if self.staged is None:
            return
        with self.metrics.clock.idle("loading_weights"):
            self.load_seconds = self.engine.load_weights()
        self.policy_version, self.staged = self.staged, None
        self.metrics.load.observe(self.load_seconds)
        self.metrics.version.set(self.policy_version)
        log.info("policy version %d loaded in %.3f s", self.policy_version, self.load_seconds)

    def Status(self, request, context):
        self._check_job(request.job_id, context)
        wall = time.monotonic() - self.started
        return generator_pb2.GeneratorStatusResponse(
            job_id=self.job_id, policy_version=self.policy_version, busy_seconds=self.busy_seconds,
            idle_seconds=max(0.0, wall - self.busy_seconds), tokens_generated=self.tokens_generated)

    def _check_job(self, job_id: str, context: grpc.ServicerContext) -> None:
        if job_id != self.job_id:
            wire.invalid(context, f"job_id {job_id[:80]!r} is not this generator's job ({self.job_id!r})")

    def _problem(self, request) -> str | None:
        """Why a Generate request cannot be served, or None."""
        if not request.sequences or len(request.sequences) > wire.MAX_SEQUENCES:
            return f"sequences: need 1..{wire.MAX_SEQUENCES}, got {len(request.sequences)}"
        if not 1 <= request.max_tokens < self.engine.max_model_len:
            return f"max_tokens: need 1..{self.engine.max_model_len - 1}, got {request.max_tokens}"
        if not (request.temperature == 0.0 or WIRE_MIN_TEMPERATURE <= request.temperature <= 10.0):
            return f"temperature: need 0 (greedy) or [{MIN_TEMPERATURE}, 10], got {request.temperature}"
        if not 0.0 < request.top_p <= 1.0:
            return f"top_p: need (0, 1], got {request.top_p}"
        for index, seq in enumerate(request.sequences):
            problem = self._sequence_problem(seq, request.max_tokens)
            if problem:
                return f"sequences[{index}]: {problem}"
        return None

    def _sequence_problem(self, seq, max_tokens: int) -> str | None:
        length = len(seq.prompt_ids) + len(seq.completion_ids)
        if not seq.prompt_ids:
            return "prompt_ids is empty"
        if length + max_tokens > self.engine.max_model_len:
            return f"prompt + completion + max_tokens = {length + max_tokens} exceeds {self.engine.max_model_len}"
        ids = list(seq.prompt_ids) + list(seq.completion_ids)
        if min(ids) < 0 or max(ids) >= self.engine.vocab_size:
            return f"token ids must be in [0, {self.engine.vocab_size})"
        return None


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
    if not request.params:
        return "params is empty"
    for index, param in enumerate(request.params):
        if not param.name or not param.shape or min(param.shape) < 1:
            return f"params[{index}]: need a name and a shape of positive sizes"
    return None


def serve_generator(job_id: str, engine: Engine, port: int, host: str = "0.0.0.0", tp_size: int = 1,
                    metrics: WorkerMetrics | None = None, *, token: str) -> tuple[grpc.Server, GeneratorService]:
    service = GeneratorService(job_id, engine, tp_size, metrics, sync_key(token))
    server, _ = wire.serve(port, [lambda s: generator_pb2_grpc.add_GeneratorServicer_to_server(service, s)],
                           [SERVICE], host, token=token)
    return server, service
