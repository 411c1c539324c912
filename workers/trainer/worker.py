"""Trainer ranks: the model, AdamW, DDP over torch.distributed, and the batch hand-out from rank 0."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.trainer.policy import train_step

log = logging.getLogger(__name__)
# Long enough for rank 0 to wait out a slow generation batch between two steps.
DIST_TIMEOUT = timedelta(minutes=30)


class Trainer:
    def __init__(self, ctx: WorkerContext, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.ctx = ctx
        self.spec = ctx.job.spec
        self.rank = ctx.rank
        self.world_size = self.spec.roles.trainer.replicas
        self.device = torch.device("cuda", 0) if self.spec.roles.trainer.resources.gpu else torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=DIST_TIMEOUT)
        torch.manual_seed(self.spec.algorithm.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.wrapped = self._wrap(self.model)
        alg = self.spec.algorithm
        # fused: one kernel for all parameters instead of a Python loop over them (CPU and CUDA).
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=alg.learning_rate,
                                           weight_decay=alg.weight_decay, fused=True)

    def step(self, rollouts: list[Any]) -> dict[str, float]:
        """Rank 0: hand the batch to every rank, then train on this rank's share."""
        box = [rollouts]
        dist.broadcast_object_list(box, src=0)
        return self._train(box[0])

    def follow(self) -> None:
        """Ranks > 0: train on whatever rank 0 hands out until it says stop."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            self._train(box[0])

    def stop(self) -> None:
        if self.rank == 0 and self.world_size > 1:
            dist.broadcast_object_list([None], src=0)
        dist.destroy_process_group()

    def _train(self, rollouts: list[Any]) -> dict[str, float]:
        start = time.perf_counter()
        alg = self.spec.algorithm
        normalizer = sum(len(r.completion_ids) for r in rollouts)
        metrics = train_step(
            self.wrapped, self.optimizer, rollouts[self.rank :: self.world_size],
            rho=alg.loss.rho, temperature=self.spec.generation.temperature, grad_clip=alg.grad_clip,
            pad_id=self.pad_id, normalizer=normalizer, world_size=self.world_size,
        )
        metrics["train_seconds"] = time.perf_counter() - start
        return metrics

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[0] if self.device.type == "cuda" else None)

