"""The Generator gRPC service: segments for a batch of sequences; served beside the WeightSync service, whose
weights it loads at its safe points (between two Generate calls)."""

from __future__ import annotations

import os
import struct
import time

import grpc

from rlfleet.v1 import generator_pb2, generator_pb2_grpc, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import sync_key
from rlfleet.workers.engines.base import Engine, Sampling, SegmentOut, SequenceIn
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import GeneratorMetrics
from rlfleet.workers.generator.config import MIN_TEMPERATURE
from rlfleet.workers.sync.service import SERVICE as WEIGHT_SYNC_SERVICE
from rlfleet.workers.sync.service import WeightSyncService

# The request's temperature is a float32: 0.01 arrives as 0.0099999998.
WIRE_MIN_TEMPERATURE = struct.unpack("f", struct.pack("f", MIN_TEMPERATURE))[0]
SERVICE = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name
THROTTLE_ENV = "RLFLEET_GENERATOR_THROTTLE"
"""A test and benchmark knob, not for real jobs: `RANK=SECONDS[,RANK=SECONDS...]` makes generator replica RANK sleep
SECONDS per token it generated, within its busy time, as a slower GPU would (`rlfleet bench pools`)."""


class GeneratorService(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, job_id: str, engine: Engine, tp_size: int = 1, metrics: WorkerMetrics | None = None,
                 sync_key: str = "", throttle: float = 0.0):
        self.job_id = job_id
        self.engine = engine
        self.throttle = throttle
        """Seconds slept per generated token (THROTTLE_ENV)."""
        self.metrics = GeneratorMetrics(metrics or WorkerMetrics("generator", job=job_id))
        self.weights = WeightSyncService(job_id, engine, self.metrics, tp_size, sync_key)
        """The WeightSync service beside this one: it owns the engine's lock and the policy version."""
        self.busy_seconds = 0.0
        self.tokens_generated = 0
        self.started = time.monotonic()

    def Generate(self, request, context):
        self._check_job(request.job_id, context)
        problem = self.problem(request)
        if problem:
            wire.invalid(context, problem)
        version, segments = self.generate(request)
        return generator_pb2.GenerateResponse(
            job_id=self.job_id,
            policy_version=version,
            segments=[
                generator_pb2.Segment(sample_id=seq.sample_id, token_ids=seg.token_ids, logprobs=seg.logprobs,
                                      finished=seg.finished)
                for seq, seg in zip(request.sequences, segments)
            ],
        )

    def generate(self, request: generator_pb2.GenerateRequest) -> tuple[int, list[SegmentOut]]:
        """A checked request's segments and the policy version that sampled them, at a safe point: what Generate and
        the OpenAI-compatible endpoint (openai_api.py) both run."""
        sequences = [SequenceIn(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]
        sampling = Sampling(request.max_tokens, request.temperature, request.top_p, request.seed)
        with self.metrics.requests.track_inprogress(), self.weights.safe_point() as version:
            start = time.monotonic()
            with self.metrics.clock.busy():
                segments = self.engine.generate(sequences, sampling)
                tokens = sum(len(s.token_ids) for s in segments)
                time.sleep(self.throttle * tokens)
            self.busy_seconds += time.monotonic() - start
        self.tokens_generated += tokens
        self.metrics.tokens.inc(tokens)
        return version, segments

    def Status(self, request, context):
        self._check_job(request.job_id, context)
        wall = time.monotonic() - self.started
        return generator_pb2.GeneratorStatusResponse(
            job_id=self.job_id, policy_version=self.weights.policy_version, busy_seconds=self.busy_seconds,
            idle_seconds=max(0.0, wall - self.busy_seconds), tokens_generated=self.tokens_generated)

    def _check_job(self, job_id: str, context: grpc.ServicerContext) -> None:
        if job_id != self.job_id:
            wire.invalid(context, f"job_id {job_id[:80]!r} is not this generator's job ({self.job_id!r})")

    def problem(self, request) -> str | None:
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


def throttle(rank: int, environ: dict[str, str] | os._Environ = os.environ) -> float:
    """Seconds per generated token THROTTLE_ENV gives generator replica `rank` (0 unless it names it)."""
    found = 0.0
    for item in filter(None, environ.get(THROTTLE_ENV, "").split(",")):
        named, _, seconds = item.partition("=")
        try:
            if int(named) == rank:
                found = float(seconds)
        except ValueError:
            raise ValueError(f"{THROTTLE_ENV}={environ[THROTTLE_ENV]!r}: write RANK=SECONDS[,RANK=SECONDS...], "
                             f"e.g. 1=0.002") from None
    if found < 0:
        raise ValueError(f"{THROTTLE_ENV}: generator {rank}'s seconds per token is {found}: need >= 0")
    return found


def serve_generator(job_id: str, engine: Engine, port: int, host: str = "0.0.0.0", tp_size: int = 1,
                    metrics: WorkerMetrics | None = None, *, token: str,
                    throttle: float = 0.0) -> tuple[grpc.Server, GeneratorService]:
    service = GeneratorService(job_id, engine, tp_size, metrics, sync_key(token), throttle)
    server, _ = wire.serve(port, [lambda s: generator_pb2_grpc.add_GeneratorServicer_to_server(service, s),
                                  lambda s: weight_sync_pb2_grpc.add_WeightSyncServicer_to_server(service.weights, s)],
                           [SERVICE, WEIGHT_SYNC_SERVICE], host, token=token)
    return server, service
