"""Environment worker: serve the job's environment, one instance per open episode, until stopped."""

from __future__ import annotations

import logging

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from transformers import AutoTokenizer

    from rlfleet.workers.environment.loading import load_environment
    from rlfleet.workers.environment.server import EnvironmentService, serve_environment
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize

    model_dir = materialize(ctx.job.spec.model, default_cache_dir())
    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    spec = ctx.job.spec.roles.environment
    service = EnvironmentService(ctx.job, None if spec.type == "agent" else load_environment(spec),
                                 AutoTokenizer.from_pretrained(model_dir), metrics, ctx.token)
    server = serve_environment(ctx.job, service, ctx.grpc_port, ctx.listen_host, token=ctx.token)
    metrics.clock.started()
    log.info("environment %d (%s) serving on port %d", ctx.rank, ctx.job.spec.roles.environment.type, ctx.grpc_port)
    server.wait_for_termination()
