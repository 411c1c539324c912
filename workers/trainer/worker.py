"""Trainer ranks: the model sharded FSDP2-style over torch.distributed, AdamW, and the collective methods.

Rank 0 (the controller) decides; every rank executes the same method at the same time, because
training, checkpoint gathering and the shard-to-shard weight push are collective.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlfleet.workers.auth import sync_key
from rlfleet.workers.metrics.clock import ExecutorClock
from rlfleet.workers.metrics.exporter import IDLE_REASONS, default_reason
from rlfleet.workers.models.forward import align_forward
from rlfleet.workers.models.precision import weights_dtype
from rlfleet.workers.plan import WorkerContext, has_gpu, ranks_per_pod, receiving_roles
from rlfleet.workers.sync.buckets import DTYPES
from rlfleet.workers.sync.shards import RolePublishers, ShardPublisher, SyncSettings, global_shapes, local_shards
from rlfleet.workers.trainer import lora
from rlfleet.workers.trainer.checkpoint import (CHECKPOINTS_DIR, best_state, latest_checkpoint, read_checkpoint,
                                               save_best, save_checkpoint)
from rlfleet.workers.trainer.config import Training
from rlfleet.workers.trainer.memory import check_memory, free_bytes, memory_limit, token_budget
from rlfleet.workers.trainer.epochs import train_epochs
from rlfleet.workers.trainer.pipeline import Pipeline, build_pipeline, register_stage_forward, split
from rlfleet.workers.trainer.policy import Passes
from rlfleet.workers.trainer.stage_state import gathered_state, restore_state
from rlfleet.workers.trainer.schedule import lr_factor
from rlfleet.workers.trainer.shared_prompts import ATTENTION, checkpoint_layers, register_for_fsdp
from rlfleet.workers.world import (collective, follow_rank0, init_world, local_shard, rank_device, release_followers,
                                   shard)

log = logging.getLogger(__name__)


def prepare(lm: nn.Module, training: Training, compute_dtype: torch.dtype, world_size: int,
            pipeline: Pipeline | None = None) -> nn.Module:
    """Make the loaded float32 `lm` the trainer's model: LoRA, activation checkpointing and compiled layers as
    `training` asks, then sharded over the world (a process group must exist), or with a `pipeline` cut to this
    rank's stage and sharded over the stage's ranks. Returns the peft wrapper of `lm` with LoRA, else `lm`.

    FSDP2 at every world size, one rank too (its shard is then the whole model): its mixed precision is what
    computes in `compute_dtype` from float32 master weights, without autocast's casts in every forward.
    """
    model = lora.attach(lm, training.lora) if training.lora else lm
    layers = split(lm, pipeline) if pipeline else list(lm.model.layers)
    if training.activation_checkpointing:
        checkpoint_layers(layers)
    if training.compile:
        for layer in layers:
            layer.compile()  # in place: parameter names stay (the sync plan and checkpoints use them)
    ranks = pipeline.data_parallel if pipeline else world_size
    shard(lm, layers, compute_dtype, keep_gathered=ranks == 1, mesh=pipeline.mesh if pipeline else None)
    if pipeline:
        register_stage_forward(lm, pipeline, compute_dtype)
    else:
        register_for_fsdp(lm)
    return model


def micro_batch_budget(lm: nn.Module, compute_dtype: torch.dtype, training: Training, device: torch.device) -> int:
    """Tokens per micro-batch from the device's free memory, once the model is loaded (and sharded): gradients
    and AdamW's two moments, float32, are still to come."""
    trainable = sum(local_shard(p).numel() for p in lm.parameters() if p.requires_grad)
    return token_budget(lm.config, compute_dtype.itemsize, training.activation_checkpointing, free_bytes(device),
                        3 * 4 * trainable)


class Trainer:
    def __init__(self, ctx: WorkerContext, model_dir: Path, clock: ExecutorClock | None = None):
        from transformers import AutoModelForCausalLM

        self.ctx = ctx
        self.spec = ctx.job.spec
        self.rank = ctx.rank
        self.clock = clock or ExecutorClock(IDLE_REASONS["trainer"], default_reason("trainer", ctx.rank))
        self.world_size = self.spec.roles.trainer.world_size
        self.model_dir = model_dir
        self.checkpoints = Path(ctx.run_dir) / CHECKPOINTS_DIR
        """Where rank 0 writes checkpoints and reads them back."""
        self.device = rank_device(self.spec.roles.trainer.resources.gpu, os.environ)
        # Master weights and AdamW state stay float32; model.dtype is what the forward computes in
        # (FSDP's gathered copies, world.shard) and what travels to the generators, which run in it.
        dtype = weights_dtype(ctx.job)
        log.info("forward in %s (model.dtype: %s)", dtype, self.spec.model.dtype)
        self.compute_dtype = DTYPES[dtype]
        check_memory("trainer", ranks_per_pod(ctx.job, "trainer"), model_dir, memory_limit())
        init_world(self.device, self.rank, self.world_size, sync_key(ctx.token))
        torch.manual_seed(self.spec.algorithm.seed)
        training = self.spec.training
        self.lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                       attn_implementation=ATTENTION).to(self.device)
        self.lm.train()
        align_forward(self.lm, has_gpu(ctx.job, "generator"))  # as the generators compute it
        self.pad_id = self.lm.config.pad_token_id or 0
        shapes = global_shapes(self.lm)  # of every stage: a pipeline's rank keeps only its own
        stages = self.spec.roles.trainer.pipeline_parallel
        self.pipeline = build_pipeline(stages, self.world_size, self.rank, self.device, self.lm) if stages > 1 else None
        """This rank's stage, with a pipeline-parallel trainer."""
        # `model` is what checkpoints save: the peft wrapper of `lm` with LoRA, else `lm` itself.
        self.model = prepare(self.lm, training, self.compute_dtype, self.world_size, self.pipeline)
        self.push_shapes = lora.push_shapes(self.lm) if training.lora else shapes
        """What every weight push sends: the adapters with LoRA, else every parameter."""
        self.passes = Passes(training.micro_batch_tokens or self._token_budget(), training.logprob_chunk_tokens)
        alg = self.spec.algorithm
        # fused: one kernel for all parameters instead of a Python loop over them (CPU and CUDA).
        self.optimizer = torch.optim.AdamW([p for p in self.lm.parameters() if p.requires_grad], lr=alg.learning_rate,
                                           weight_decay=alg.weight_decay, fused=True)
        key = sync_key(ctx.token)
        self.publishers = {role: RolePublishers(ctx.job, role, key, self._publisher)
                           for role in receiving_roles(ctx.job)}
        """One per role the weights go to, with a sync plan per kind of its replicas (a generator pool's tensor
        parallelism, a reference's one)."""
        self._state_options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                               ignore_frozen_params=training.lora is not None)

    def _publisher(self, settings: SyncSettings) -> ShardPublisher:
        return ShardPublisher(self.rank, settings, self.push_shapes, self.lm.config.vocab_size, self.device,
                              snapshot=self.spec.weight_sync.snapshot)

    def _token_budget(self) -> int:
        """`micro_batch_budget`, the smallest over the ranks, so that they all agree."""
        budget = torch.tensor(micro_batch_budget(self.lm, self.compute_dtype, self.spec.training, self.device),
                              device=self.device)
        if self.world_size > 1:
            dist.all_reduce(budget, op=dist.ReduceOp.MIN)
        log.info("micro-batches of up to %d tokens (spec.training.microBatchTokens unset)", int(budget))
        return int(budget)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's collective calls until it says stop."""
        self.clock.started()
        follow_rank0(self)

    def stop(self) -> None:
        release_followers(self.rank, self.world_size)
        for publishers in self.publishers.values():
            publishers.close()
        dist.destroy_process_group()
        self.clock.close()

    @collective
    def train(self, rollouts: list[Any], step: int) -> dict[str, float]:
        start = time.perf_counter()
        alg = self.spec.algorithm
        learning_rate = alg.learning_rate * lr_factor(self.spec.training.lr_schedule, step, alg.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        waited: list[float] = []  # for the sends of the last push still reading these weights, if any
        pipe = self.pipeline
        rank, ranks = (pipe.index, pipe.data_parallel) if pipe else (self.rank, self.world_size)
        with self.clock.busy():
            metrics = train_epochs(
                self.lm, self.optimizer, rollouts, step=step, seed=alg.seed, epochs=alg.epochs,
                mini_batches=alg.mini_batches, rank=rank, world_size=ranks, passes=self.passes, pipeline=pipe,
                before_update=lambda: waited.append(self._release_shards()),
                loss=alg.loss, temperature=self.spec.generation.temperature, top_p=self.spec.generation.top_p,
                grad_clip=alg.grad_clip, pad_id=self.pad_id,
                kl=alg.kl if self.spec.roles.reference else None,
            )
        metrics["train_seconds"] = time.perf_counter() - start
        metrics["sync_wait_seconds"] = sum(waited)
        metrics["learning_rate"] = learning_rate
        return metrics

    @collective
    def connect(self, role: str, replica: int, host: str, port: int, epoch: int) -> str | None:
        return self.publishers[role].connect(replica, host, port, epoch)

    def arrived(self, role: str, replica: int, host: str, port: int, epoch: int) -> bool:
        """Rank 0, which hosts the sync stores: whether `role` replica's ranks wait in its group's `epoch`."""
        return self.publishers[role].arrived(replica, host, port, epoch)

    @collective
    def publish(self, role: str, replicas: list[int]) -> float:
        """Pack this rank's shards (now) and send them to `role`'s replicas (in the background); returns the pack
        seconds."""
        lora_spec = self.spec.training.lora
        with self.clock.busy():
            shards = lora.push_shards(self.lm, lora.scale_of(lora_spec)) if lora_spec else local_shards(self.lm)
            return self.publishers[role].publish(shards, replicas)

    def _release_shards(self) -> float:
        """Before the optimizer step: wait for the pushes still reading the live shards; the seconds waited."""
        return sum(publisher.release_shards() for publisher in self.publishers.values())

    @collective
    def checkpoint(self, step: int, state: dict[str, Any]) -> None:
        """Save the weights, the optimizer state and the controller's `state` as the checkpoint of `step`."""
        # Every rank gathers (collective); only rank 0 writes.
        with self.clock.idle("checkpointing"):
            weights, optimizer = self._gathered(self.optimizer)
            if self.rank == 0:
                save_checkpoint(self.checkpoints, step, self.model, weights, optimizer, state,
                                keep=self.spec.checkpoint.keep, tokenizer_dir=self.model_dir)

    @collective
    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the trained weights (the adapters with LoRA) on rank 0's CPU, for the best checkpoint."""
        weights, _ = self._gathered(None)
        # One CPU rank's gathered weights can be its shards themselves, which the next step changes.
        return {name: tensor.clone() for name, tensor in weights.items()} if self.rank == 0 else {}

    def _gathered(self, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """On rank 0 the full weights and (with `optimizer`) optimizer state, on CPU; elsewhere what torch leaves."""
        if self.pipeline:
            return gathered_state(self.model, optimizer, self.pipeline)
        weights = get_model_state_dict(self.model, options=self._state_options)
        state = get_optimizer_state_dict(self.model, optimizer, options=self._state_options) if optimizer is not None else {}
        return weights, state

    def save_best(self, snapshot: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        """Rank 0: write a snapshot as checkpoints/best."""
        save_best(self.checkpoints, self.model, snapshot, state, tokenizer_dir=self.model_dir)

    def best(self) -> dict[str, Any]:
        """The best checkpoint's state; {} without one."""
        return best_state(self.checkpoints)

    def resume(self) -> dict[str, Any]:
        """Rank 0: load the latest checkpoint into every rank and return its controller state; without one, leave
        the weights and return a fresh run's state."""
        found = latest_checkpoint(self.checkpoints)
        if found is None:
            return {"step": 0, "data_position": 0, "in_flight": []}
        state = self.restore(str(found))
        log.info("resuming from %s: step %d, data position %d, %d prompts in flight restored", found, state["step"],
                 state["data_position"], len(state.get("in_flight", [])))
        return state

    @collective
    def restore(self, path: str | None) -> dict[str, Any]:
        """Load a checkpoint read by rank 0 into every rank's shards; returns its controller state."""
        weights, optimizer, state = read_checkpoint(path) if self.rank == 0 else ({}, {}, {})
        if self.spec.training.lora:
            weights = lora.state_names(weights)
        if self.pipeline:
            restore_state(self.model, self.optimizer, self.pipeline, weights, optimizer)
            return state
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(self.model, weights, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=options)
        return state
