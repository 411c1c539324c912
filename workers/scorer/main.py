"""Scorer worker: serve the job's rule-based scorers until stopped."""

from __future__ import annotations

import logging

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.scorer.server import ScorerService, serve_scorer

    service = ScorerService(ctx.job, WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host))
    server = serve_scorer(ctx.job, ctx.grpc_port, ctx.listen_host, service=service, token=ctx.token)
    service.metrics.clock.started()
    log.info("scorer %d serving on port %d", ctx.rank, ctx.grpc_port)
    server.wait_for_termination()
