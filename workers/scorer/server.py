"""The Scorer gRPC service: scores batches of completions with the job's rule-based scorers."""

from __future__ import annotations

import json
import logging

import grpc

from rlfleet.v1 import scorer_pb2, scorer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import ScorerMetrics
from rlfleet.workers.scorer.batch import ScoreInput, Scoring, pool_size
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)

# A step is promptsPerStep * groupSize <= 65536 samples by the schema's own bounds.
MAX_ITEMS = 65536
# A completion of the longest allowed generation is well under this; more is a bug or an attack.
MAX_ITEM_BYTES = 1 << 20


class ScorerService(scorer_pb2_grpc.ScorerServicer):
    """Scores batches for one job with its scorers; requests naming another job are refused."""

    def __init__(self, job: RLJob, metrics: WorkerMetrics | None = None):
        self.job_id = job.metadata.name
        self.scoring = Scoring(job.spec.scorers, pool_size())
        worker = metrics or WorkerMetrics("scorer", job=self.job_id, namespace=job.metadata.namespace)
        self.metrics = ScorerMetrics(worker, lambda: self.error_counts, lambda: dict(self.scoring.failure_counts))

    @property
    def error_counts(self) -> dict[str, int]:
        """Failed scorer calls (batch.FAILURE_REASONS) per scorer name, since start."""
        return dict(self.scoring.error_counts)

    def Score(
        self, request: scorer_pb2.ScoreRequest, context: grpc.ServicerContext
    ) -> scorer_pb2.ScoreResponse:
        problem = request_problem(request, self.job_id)
        if problem:
            wire.invalid(context, problem)
        with self.metrics.requests.track_inprogress(), self.metrics.clock.busy():
            results = self.scoring.score([score_input(item) for item in request.items])
        self.metrics.items.inc(len(results))
        failed = sum(bool(result.errors) for result in results)
        log.debug("scored %d items, %d with scorer errors", len(results), failed)
        return scorer_pb2.ScoreResponse(
            job_id=self.job_id,
            scores=[
                scorer_pb2.Score(sample_id=item.sample_id, reward=result.reward, errors=result.errors,
                                 reasons=result.reasons, scorer_scores=result.scores, components=result.components)
                for item, result in zip(request.items, results)
            ],
        )

    def close(self) -> None:
        """Stop the scoring child process."""
        self.scoring.close()


def score_input(item: scorer_pb2.ScoreItem) -> ScoreInput:
    return ScoreInput(item.completion, item.answer, item.prompt, json.loads(item.fields_json or "{}"))


def request_problem(request: scorer_pb2.ScoreRequest, job_id: str) -> str | None:
    """Why a Score request is refused (INVALID_ARGUMENT), or None; shared by every server of the Scorer service."""
    if request.job_id != job_id:
        return f"job_id {request.job_id[:64]!r} is not this scorer's job {job_id!r}"
    if not request.items:
        return "empty batch: items must hold at least one item"
    if len(request.items) > MAX_ITEMS:
        return f"{len(request.items)} items: at most {MAX_ITEMS} per request"
    for index, item in enumerate(request.items):
        if item.ByteSize() > MAX_ITEM_BYTES:
            return f"items[{index}] is {item.ByteSize()} bytes: at most {MAX_ITEM_BYTES}"
        if item.fields_json and not _json_object(item.fields_json):
            return f"items[{index}].fields_json: not a JSON object"
    return None


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def serve_scorer(
    job: RLJob, port: int, host: str = "0.0.0.0", service: ScorerService | None = None, *, token: str
) -> grpc.Server:
    """Serve the Scorer (with health and reflection) on host:port.

    Pass `service` to keep a handle on it (error counts, `close()`); by default one is built from job.
    """
    svc = service or ScorerService(job)
    server, _ = wire.serve(
        port,
        [lambda s: scorer_pb2_grpc.add_ScorerServicer_to_server(svc, s)],
        [scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name],
        host,
        token=token,
    )
    log.info("scorer for job %s serving on %s:%d", svc.job_id, host, port)
    return server
