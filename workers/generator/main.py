"""Generator worker: load the engine, serve gRPC (and the OpenAI-compatible endpoint over HTTP) until stopped."""

from __future__ import annotations

import logging

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from transformers import AutoTokenizer

    from rlfleet.workers.engines import create_engine
    from rlfleet.workers.generator.openai_api import OpenAIEndpoint, Sessions, serve_openai
    from rlfleet.workers.generator.server import serve_generator, throttle
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize

    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    model_dir = materialize(ctx.job.spec.model, default_cache_dir())
    engine = create_engine(ctx.job, model_dir)
    server, service = serve_generator(ctx.job.metadata.name, engine, ctx.grpc_port, ctx.listen_host,
                                      tp_size=ctx.job.spec.roles.generator.tensor_parallel_size, metrics=metrics,
                                      token=ctx.token, throttle=throttle(ctx.rank))
    evicted = metrics.counter("rlfleet_openai_sessions_evicted_total",
                              "OpenAI-endpoint sessions dropped for room before their record was deleted")
    endpoint = OpenAIEndpoint(service, AutoTokenizer.from_pretrained(model_dir), ctx.job.spec.generation,
                              model=ctx.job.metadata.name, sessions=Sessions(on_evict=evicted.inc))
    serve_openai(endpoint, ctx.http_port, ctx.listen_host, token=ctx.token)
    metrics.clock.started()
    log.info("generator %d serving %s on port %d (OpenAI-compatible endpoint on %d)", ctx.rank, model_dir,
             ctx.grpc_port, ctx.http_port)
    server.wait_for_termination()
