"""The Reference gRPC service: log pi_ref of given tokens, on weights that arrive over DDMA.

The same server answers the WeightSync service, so the trainer pushes to a reference replica exactly as to a
generator replica (one sync group each, staged, loaded at a safe point between two calls).
"""

from __future__ import annotations

import logging

import grpc

from rlfleet.v1 import reference_pb2, reference_pb2_grpc, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import sync_key
from rlfleet.workers.engines.base import SequenceIn
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import ReferenceMetrics
from rlfleet.workers.spec import RLJob
from rlfleet.workers.sync.service import SERVICE as WEIGHT_SYNC_SERVICE
from rlfleet.workers.sync.service import WeightSyncService

log = logging.getLogger(__name__)
SERVICE = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name


class ReferenceService(reference_pb2_grpc.ReferenceServicer):
    def __init__(self, job: RLJob, weights: WeightSyncService):
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
        with self.metrics.requests.track_inprogress(), self.weights.safe_point() as version, self.metrics.clock.busy():
            found = self.engine.logprobs(sequences, self.generation.temperature, self.generation.top_p)
        self.metrics.scored.inc(sum(len(s.completion_ids) for s in sequences))
        return reference_pb2.LogProbsResponse(job_id=self.job_id, policy_version=version, sequences=[
            reference_pb2.TokenLogProbs(sample_id=s.sample_id, logprobs=lp) for s, lp in zip(request.sequences, found)])


def serve_reference(job: RLJob, engine, port: int, host: str = "0.0.0.0", metrics: WorkerMetrics | None = None, *,
                    token: str) -> tuple[grpc.Server, ReferenceService]:
    families = ReferenceMetrics(metrics or WorkerMetrics("reference", job=job.metadata.name))
    weights = WeightSyncService(job.metadata.name, engine, families, 1, sync_key(token))
    service = ReferenceService(job, weights)
    server, _ = wire.serve(port, [lambda s: weight_sync_pb2_grpc.add_WeightSyncServicer_to_server(weights, s),
                                  lambda s: reference_pb2_grpc.add_ReferenceServicer_to_server(service, s)],
                           [WEIGHT_SYNC_SERVICE, SERVICE], host, token=token)
    return server, service
