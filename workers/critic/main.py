"""Critic worker: the value model on its own device, serving values and learning from GAE returns until stopped."""

from __future__ import annotations

import logging
from pathlib import Path

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "critic-checkpoints"


def main(ctx: WorkerContext) -> None:
    import torch

    from rlfleet.workers.critic.model import ValueTrainer
    from rlfleet.workers.critic.server import serve_critic
    from rlfleet.workers.engines import max_model_len
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.sync.buckets import DTYPES

    spec = ctx.job.spec
    role = spec.roles.critic
    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port)
    model_dir = materialize(spec.model, default_cache_dir())
    gpu = role.resources.gpu > 0
    # float32 weights and AdamW state; the forward runs in model.dtype on a GPU, as the trainer's does.
    critic = ValueTrainer(model_dir, role, spec.algorithm.epochs, spec.algorithm.mini_batches, spec.algorithm.seed,
                          torch.device("cuda" if gpu else "cpu"), DTYPES[spec.model.dtype] if gpu else torch.float32)
    checkpoints = Path(ctx.run_dir) / CHECKPOINT_DIR
    # A critic restarted mid-run goes on from its newest checkpoint; a resumed run asks for its step (Restore).
    if step := critic.load(checkpoints):
        log.info("critic resumed from its checkpoint of step %d", step)
    server, _ = serve_critic(ctx.job, critic, ctx.grpc_port, max_model_len(model_dir, spec.generation.max_new_tokens),
                             checkpoints, metrics=metrics, token=ctx.token)
    metrics.clock.started()
    log.info("critic serving %s on port %d", model_dir, ctx.grpc_port)
    server.wait_for_termination()
