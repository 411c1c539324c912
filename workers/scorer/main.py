"""Scorer worker: serve the job's rule-based scorers until stopped."""

from __future__ import annotations

import logging

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from rlfleet.workers.scorer.server import serve_scorer

    server = serve_scorer(ctx.job, ctx.grpc_port)
    log.info("scorer %d serving on port %d", ctx.rank, ctx.grpc_port)
    server.wait_for_termination()
