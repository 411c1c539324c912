"""Trainer worker: rank 0 also runs the controller, or serves the Trainer service to a controller of its own
(spec.roles.controller); other ranks follow rank 0."""

from __future__ import annotations

from rlfleet.workers.plan import WorkerContext


def main(ctx: WorkerContext) -> None:
    from rlfleet.workers.controller.loop import run_controller
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.trainer.server import serve_trainer
    from rlfleet.workers.trainer.worker import Trainer

    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    model_dir = materialize(ctx.job.spec.model, default_cache_dir())
    trainer = Trainer(ctx, model_dir, metrics.clock)
    try:
        if ctx.rank > 0:
            trainer.follow()
        elif ctx.job.spec.roles.controller:
            serve_trainer(ctx, trainer)
        else:
            run_controller(ctx, lambda _: trainer, model_dir, metrics)
    finally:
        trainer.stop()
