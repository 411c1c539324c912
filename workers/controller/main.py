"""Controller worker (spec.roles.controller): it waits to lead the run (leadership.py), then drives it to its end,
calling the trainer's gRPC service. While another leads, it stands by; when the leader is lost it takes over,
resuming the trainer from the run's last checkpoint in place: no trainer or generator restarts."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from rlfleet.workers import wire
    from rlfleet.workers.controller.loop import READY_TIMEOUT, run_controller
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize

    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    model_dir = materialize(ctx.job.spec.model, default_cache_dir())  # its tokenizer and config
    address = ctx.endpoints.of("trainer")[0]
    wire.wait_ready(address, READY_TIMEOUT)
    metrics.clock.started()  # standing by until it leads
    with contextlib.ExitStack() as leading:
        run_controller(ctx, lambda led: _leading(led, address, metrics, leading), model_dir, metrics)


def _leading(ctx: WorkerContext, address: str, metrics: Any, leading: contextlib.ExitStack) -> Any:
    """The trainer's link, once this controller leads: busy from here to its end."""
    from rlfleet.workers.trainer.link import TrainerLink

    leading.enter_context(metrics.clock.busy())
    log.info("controller %d leads as epoch %d; the trainer is at %s", ctx.rank, ctx.leader_epoch, address)
    return TrainerLink(ctx, address)
