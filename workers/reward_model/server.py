"""The reward model served as the Scorer gRPC service: the same request as the rule scorers', one learned score
per item.

Forwards run one at a time on a thread of their own, `batchSize` sequences each. A batch that does not come back
within its budget (`timeoutSeconds` x its sequences, waiting included), or whose forward raises, scores its items 0
and names `reward_model` in their errors, counted in rlfleet_scorer_errors_total as a rule scorer's failures are; so
does a score that is not a finite number. A request therefore answers within `timeoutSeconds` x its items. A forward
cannot be interrupted: one past its budget runs to its end in the background, and the batches queued behind it wait,
within their own budgets.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol, Sequence

import grpc

from rlfleet.v1 import scorer_pb2, scorer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import ScorerMetrics
from rlfleet.workers.reward_model.config import ERROR_NAME
from rlfleet.workers.scorer.server import request_problem
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
SERVICE = scorer_pb2.DESCRIPTOR.services_by_name["Scorer"].full_name


class Scores(Protocol):
    def score(self, items: Sequence[tuple[str, str]]) -> list[float]:
        """One score per (prompt, completion), in order."""


class RewardModelService(scorer_pb2_grpc.ScorerServicer):
    """Scores batches for one job with its reward model; requests naming another job are refused."""

    def __init__(self, job: RLJob, model: Scores, metrics: WorkerMetrics | None = None):
        self.job_id = job.metadata.name
        self.role = job.spec.roles.reward_model
        self.model = model
        self.failed = 0
        self._count_lock = threading.Lock()
        worker = metrics or WorkerMetrics("reward", job=self.job_id, namespace=job.metadata.namespace)
        self.metrics = ScorerMetrics(worker, lambda: self.error_counts)
        self._forwards = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-forward")

    @property
    def error_counts(self) -> dict[str, int]:
        """Items scored 0 because the model failed on them (raised, too slow, not a finite number), since start."""
        return {ERROR_NAME: self.failed}

    def Score(self, request: scorer_pb2.ScoreRequest, context: grpc.ServicerContext) -> scorer_pb2.ScoreResponse:
        problem = request_problem(request, self.job_id)
        if problem:
            wire.invalid(context, problem)
        items = [(item.prompt, item.completion) for item in request.items]
        size = self.role.batch_size
        with self.metrics.requests.track_inprogress():
            # All batches are queued at once: the forward thread never waits on this thread between two of them.
            pending = [(items[start:start + size], self._forwards.submit(self._forward, items[start:start + size]))
                       for start in range(0, len(items), size)]
            scores = [score for batch, future in pending for score in self._collect(batch, future)]
        self.metrics.items.inc(len(items))
        return scorer_pb2.ScoreResponse(job_id=self.job_id, scores=[
            scorer_pb2.Score(sample_id=item.sample_id, reward=value, errors=[] if ok else [ERROR_NAME])
            for item, (value, ok) in zip(request.items, scores)])

    def close(self) -> None:
        self._forwards.shutdown(wait=False, cancel_futures=True)

    def _forward(self, batch: list[tuple[str, str]]) -> list[float]:
        with self.metrics.clock.busy():
            return self.model.score(batch)

    def _collect(self, batch: list[tuple[str, str]], future) -> list[tuple[float, bool]]:
        """(score, ok) per item of a queued batch; 0 and not ok for every item the model failed on."""
        try:
            values = list(future.result(timeout=self.role.timeout_seconds * len(batch)))
            if len(values) != len(batch):
                raise ValueError(f"{len(values)} scores for {len(batch)} sequences")
        except FutureTimeout:
            future.cancel()  # not started yet: it never will
            log.warning("reward model: a batch of %d sequences took over %.1f s; scored 0", len(batch),
                        self.role.timeout_seconds * len(batch))
            values = [math.nan] * len(batch)
        except Exception as error:  # noqa: BLE001 - a failed forward is a 0 and a counted error, never a dead run
            log.warning("reward model: forward of %d sequences failed (%s: %s); scored 0", len(batch),
                        type(error).__name__, str(error)[:200])
            values = [math.nan] * len(batch)
        scores = [(float(v), True) if _finite(v) else (0.0, False) for v in values]
        with self._count_lock:
            self.failed += sum(not ok for _, ok in scores)
        return scores


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def serve_reward_model(job: RLJob, model: Scores, port: int, host: str = "0.0.0.0",
                       metrics: WorkerMetrics | None = None, *, token: str) -> tuple[grpc.Server, RewardModelService]:
    """Serve the reward model as the Scorer service (with health and reflection) on host:port."""
    service = RewardModelService(job, model, metrics)
    server, _ = wire.serve(port, [lambda s: scorer_pb2_grpc.add_ScorerServicer_to_server(service, s)], [SERVICE],
                           host, token=token)
    log.info("reward model for job %s serving on %s:%d", service.job_id, host, port)
    return server, service
