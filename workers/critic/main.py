"""Critic worker: one rank of the value model's world, on its own device. Rank 0 serves values and learns from GAE
returns until stopped; the other ranks run its collective calls."""

from __future__ import annotations

import logging
from pathlib import Path

from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "critic-checkpoints"


def main(ctx: WorkerContext) -> None:
    import os

    from rlfleet.workers.auth import sync_key
    from rlfleet.workers.critic.model import ValueTrainer
    from rlfleet.workers.critic.server import serve_critic
    from rlfleet.workers.engines import max_model_len
    from rlfleet.workers.metrics.exporter import WorkerMetrics
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.models.precision import weights_dtype
    from rlfleet.workers.plan import ranks_per_pod
    from rlfleet.workers.sync.buckets import DTYPES
    from rlfleet.workers.trainer.memory import check_memory, memory_limit
    from rlfleet.workers.world import follow_rank0, init_world, rank_device

    spec = ctx.job.spec
    role = spec.roles.critic
    metrics = WorkerMetrics.for_worker(ctx).serve(ctx.metrics_port, ctx.listen_host)
    model_dir = materialize(spec.model, default_cache_dir())
    device = rank_device(role.resources.gpu, os.environ)
    check_memory("critic", ranks_per_pod(ctx.job, "critic"), model_dir, memory_limit())
    if role.world_size > 1:
        init_world(device, ctx.rank, role.world_size, sync_key(ctx.token))
    # float32 weights and AdamW state; the forward runs in model.dtype on a GPU, as the trainer's does.
    critic = ValueTrainer(model_dir, role, spec.algorithm.epochs, spec.algorithm.mini_batches, spec.algorithm.seed,
                          device, DTYPES[weights_dtype(ctx.job) if device.type == "cuda" else "float32"], ctx.rank,
                          role.world_size)
    checkpoints = Path(ctx.run_dir) / CHECKPOINT_DIR
    if ctx.rank > 0:
        clock = metrics.clock
        clock.started()
        # Timed as rank 0's service times them.
        follow_rank0(critic, {ValueTrainer.values: clock.busy, ValueTrainer.train: clock.busy,
                              ValueTrainer.save: lambda: clock.idle("checkpointing")})
        return
    # A critic restarted mid-run goes on from its newest checkpoint (rank 0's load runs on every rank); the
    # controller, as it starts, asks for its step (Restore: 0 is the base critic).
    if step := critic.load(checkpoints):
        log.info("critic resumed from its checkpoint of step %d", step)
    server, _ = serve_critic(ctx.job, critic, ctx.grpc_port, max_model_len(model_dir, spec.generation.max_new_tokens),
                             checkpoints, ctx.listen_host, metrics=metrics, token=ctx.token)
    metrics.clock.started()
    log.info("critic serving %s on port %d", model_dir, ctx.grpc_port)
    server.wait_for_termination()
