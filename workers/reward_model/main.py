"""Reward-model worker: load the learned reward model, serve its scores until stopped."""

from __future__ import annotations

import logging

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)


def main(ctx: WorkerContext) -> None:
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.reward_model.model import RewardModel
    from rlfleet.workers.reward_model.server import serve_reward_model

    role = ctx.job.spec.roles.reward_model
    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    model = RewardModel.for_role(role)
    server, _ = serve_reward_model(ctx.job, model, ctx.grpc_port, ctx.listen_host, metrics=metrics, token=ctx.token)
    metrics.clock.started()
    log.info("reward model %d serving %s on port %d", ctx.rank, role.path, ctx.grpc_port)
    server.wait_for_termination()
