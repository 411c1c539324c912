"""Reference worker: load the policy's architecture, serve log pi_ref (and weight pushes) until stopped."""

from __future__ import annotations

import logging

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from rlfleet.workers.engines import max_model_len
    from rlfleet.workers.engines.torch_engine import TorchEngine
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.models.precision import weights_dtype
    from rlfleet.workers.reference.server import serve_reference

    spec = ctx.job.spec
    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    model_dir = materialize(spec.model, default_cache_dir())
    # Forward only, in the dtype the generators run: plain torch on its own devices (CUDA when it has GPUs).
    engine = TorchEngine(model_dir, dtype=weights_dtype(ctx.job),
                         max_model_len=max_model_len(model_dir, spec.generation.max_new_tokens),
                         device="cuda" if spec.roles.reference.resources.gpu else "cpu")
    server, _ = serve_reference(ctx.job, engine, ctx.grpc_port, ctx.listen_host, metrics=metrics, token=ctx.token)
    metrics.clock.started()
    log.info("reference %d serving %s on port %d", ctx.rank, model_dir, ctx.grpc_port)
    server.wait_for_termination()
