"""The Reference gRPC service: log pi_ref of given tokens, on weights that arrive over DDMA.

The same server answers the Generator service's JoinSyncGroup and UpdateWeights, so the trainer pushes to a
reference replica exactly as to a generator replica (one sync group each, staged, loaded at a safe point between
two calls); it does not generate.
"""

from __future__ import annotations

import logging
import time

import grpc

from rlfleet.v1 import generator_pb2_grpc, reference_pb2, reference_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import sync_key
from rlfleet.workers.engines.base import SequenceIn
from rlfleet.workers.generator.server import SERVICE as GENERATOR_SERVICE
from rlfleet.workers.generator.server import GeneratorService
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import ReferenceMetrics
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
SERVICE = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name


class WeightsOnly(GeneratorService):
    """The weight-sync half of the Generator service (join, update, status), on the reference's engine."""

    METRICS = ReferenceMetrics

    def Generate(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "a reference executor does not generate")


class ReferenceService(reference_pb2_grpc.ReferenceServicer):
    def __init__(self, job: RLJob, weights: WeightsOnly):
        self.job_id = job.metadata.name
        self.generation = job.spec.generation
        self.weights = weights
        self.engine = weights.engine
        self.metrics = weights.metrics

    def LogProbs(self, request, context):
        if request.job_id != self.job_id:
            wire.invalid(context, f"job_id {request.job_id[:80]!r} is not this reference's job ({self.job_id!r})")
        problem = wire.sequences_problem(request.sequences, self.engine.max_model_len, self.engine.vocab_size)
        if problem:
            wire.invalid(context, problem)
        sequences = [SequenceIn(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]
        with self.metrics.requests.track_inprogress(), self.weights.lock:
            self.weights._load_staged()  # a safe point: no forward runs
            start = time.monotonic()
            with self.metrics.clock.busy():
                found = self.engine.logprobs(sequences, self.generation.temperature, self.generation.top_p)
            self.weights.busy_seconds += time.monotonic() - start
            version = self.weights.policy_version
        self.metrics.scored.inc(sum(len(s.completion_ids) for s in sequences))
        return reference_pb2.LogProbsResponse(job_id=self.job_id, policy_version=version, sequences=[
            reference_pb2.TokenLogProbs(sample_id=s.sample_id, logprobs=lp) for s, lp in zip(request.sequences, found)])


def serve_reference(job: RLJob, engine, port: int, host: str = "0.0.0.0", metrics: WorkerMetrics | None = None, *,
                    token: str) -> tuple[grpc.Server, ReferenceService]:
    weights = WeightsOnly(job.metadata.name, engine, 1, metrics or WorkerMetrics("reference", job=job.metadata.name),
                          sync_key(token))
    service = ReferenceService(job, weights)
    server, _ = wire.serve(port, [lambda s: generator_pb2_grpc.add_GeneratorServicer_to_server(weights, s),
                                  lambda s: reference_pb2_grpc.add_ReferenceServicer_to_server(service, s)],
                           [GENERATOR_SERVICE, SERVICE], host, token=token)
    return server, service
