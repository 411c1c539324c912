"""Generator worker: load the engine, serve gRPC until stopped."""

from __future__ import annotations

import logging

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from rlfleet.workers.engines import create_engine
    from rlfleet.workers.generator.server import serve_generator
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize

    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    model_dir = materialize(ctx.job.spec.model, default_cache_dir())
    engine = create_engine(ctx.job, model_dir)
    server, _ = serve_generator(ctx.job.metadata.name, engine, ctx.grpc_port, ctx.listen_host,
                                tp_size=ctx.job.spec.roles.generator.tensor_parallel_size, metrics=metrics,
                                token=ctx.token)
    metrics.clock.started()
    log.info("generator %d serving %s on port %d", ctx.rank, model_dir, ctx.grpc_port)
    server.wait_for_termination()
