"""The controller: the LlamaRL loop, run in trainer rank 0.

Producers (one thread per generator) fill the rollout buffer while the trainer trains; the version
gate keeps every trained rollout within `maxStaleness` versions of the policy being updated.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from rlfleet.v1 import generator_pb2, generator_pb2_grpc, scorer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.controller.producer import ProducerParts, PromptFeed, RolloutProducer, VersionGate
from rlfleet.workers.controller.rollouts import Batch, RolloutBuffer, split_stale
from rlfleet.workers.controller.status import Progress, serve_controller
from rlfleet.workers.data.tasks import render_prompt, task_for
from rlfleet.workers.plan import WorkerContext, has_gpu
from rlfleet.workers.sync.group import resolve_backend
from rlfleet.workers.sync.publisher import WeightPublisher
from rlfleet.workers.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rlfleet.workers.trainer.worker import Trainer

log = logging.getLogger(__name__)
# Generators load an engine (vLLM: seconds to a minute) before they answer.
READY_TIMEOUT = 600.0


def run_controller(ctx: WorkerContext, trainer: Trainer, model_dir: Path) -> None:
    job, alg = ctx.job, ctx.job.spec.algorithm
    run_dir = Path(ctx.run_dir)
    state = _restore(run_dir, trainer)
    generators, scorers = _connect(ctx)
    publisher = _publisher(ctx, trainer, generators)
    gate = VersionGate(state["policy_version"])
    if state["policy_version"] > 0:
        publisher.publish(trainer.model, state["policy_version"])
        publisher.wait()
    publisher.on_published = gate.advance

    buffer = RolloutBuffer()
    parts = _producer_parts(ctx, model_dir, state, gate, buffer, scorers)
    producers = [RolloutProducer(parts, stub, index) for index, stub in enumerate(generators)]
    for producer in producers:
        producer.start()
    progress = Progress(step=state["step"], total_steps=alg.steps, policy_version=state["policy_version"])
    server, status = serve_controller(job.metadata.name, progress, ctx.grpc_port)
    clock = Clock(generators, job.metadata.name)
    try:
        for step in range(state["step"], alg.steps):
            # ---- wait for the rollouts of this step (trainer idle) ----
            waited = time.perf_counter()
            batch = buffer.take(step)
            idle = time.perf_counter() - waited
            fresh, stale = split_stale(batch.rollouts, step, alg.max_staleness)
            # ---- train, then push the new policy to the generators ----
            metrics = trainer.step(fresh) if len(fresh) >= trainer.world_size else {}
            publisher.publish(trainer.model, step + 1)
            metrics |= publisher.last_timings
            record = _record(step, batch, fresh, stale, metrics, idle, clock)
            _append_metrics(run_dir, record)
            status.update(step=step + 1, policy_version=step + 1, reward_mean=record["reward_mean"],
                          samples_trained=progress.samples_trained + len(fresh),
                          samples_dropped_stale=progress.samples_dropped_stale + len(stale),
                          tokens_generated=progress.tokens_generated + record["tokens_generated"])
            if (step + 1) % job.spec.checkpoint.every_steps == 0 or step + 1 == alg.steps:
                _checkpoint(run_dir, trainer, step + 1, batch, ctx, model_dir)
        publisher.wait()
        status.update(phase="Succeeded")
    except BaseException:
        status.update(phase="Failed")
        raise
    finally:
        gate.stop()
        publisher.close()
        server.stop(grace=1.0)


class Clock:
    """Per-step deltas of the generators' busy and idle seconds (from their Status calls)."""

    def __init__(self, generators: list[Any], job_id: str):
        self.generators = generators
        self.job_id = job_id
        self.last = (0.0, 0.0)
        self.last_time = time.perf_counter()
        self.last = self._read()

    def lap(self) -> tuple[float, float, float]:
        """(step seconds, generator busy, generator idle) since the previous lap."""
        now, (busy, idle) = time.perf_counter(), self._read()
        lap = (now - self.last_time, busy - self.last[0], idle - self.last[1])
        self.last_time, self.last = now, (busy, idle)
        return lap

    def _read(self) -> tuple[float, float]:
        replies = [g.Status(generator_pb2.GeneratorStatusRequest(job_id=self.job_id)) for g in self.generators]
        return sum(r.busy_seconds for r in replies), sum(r.idle_seconds for r in replies)


def _record(step: int, batch: Batch, fresh: list, stale: list, metrics: dict[str, float], idle: float,
            clock: Clock) -> dict[str, Any]:
    step_seconds, gen_busy, gen_idle = clock.lap()
    rewards = [r.reward for r in batch.rollouts]
    return {
        "step": step + 1,
        "policy_version": step + 1,
        "reward_mean": sum(rewards) / len(rewards),
        "max_staleness": max((step - r.version for r in fresh), default=0),
        "step_seconds": step_seconds,
        "generator_busy_seconds": gen_busy,
        "generator_idle_seconds": gen_idle,
        "trainer_busy_seconds": max(0.0, step_seconds - idle),
        "trainer_idle_seconds": idle,
        "tokens_generated": sum(len(r.completion_ids) for r in batch.rollouts),
        "samples_trained": len(fresh),
        "samples_dropped_stale": len(stale),
        "scorer_errors": sum(len(r.scorer_errors) for r in batch.rollouts),
        "finished_fraction": sum(r.finished for r in batch.rollouts) / len(batch.rollouts),
        **metrics,
    }


def _append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    log.info("step %d reward %.3f staleness %d", record["step"], record["reward_mean"], record["max_staleness"])


def _restore(run_dir: Path, trainer: Trainer) -> dict[str, Any]:
    found = latest_checkpoint(run_dir / "checkpoints")
    if found is None:
        return {"step": 0, "policy_version": 0, "data_position": 0}
    log.info("resuming from %s", found)
    return load_checkpoint(found, trainer.model, trainer.optimizer)


def _checkpoint(run_dir: Path, trainer: Trainer, step: int, batch: Batch, ctx: WorkerContext, model_dir: Path) -> None:
    # Batches after this one were generated but not trained: on resume they are sampled again.
    state = {"step": step, "policy_version": step, "data_position": batch.data_position}
    save_checkpoint(run_dir / "checkpoints", step, trainer.model, trainer.optimizer, state,
                    keep=ctx.job.spec.checkpoint.keep, tokenizer_dir=model_dir)


def _connect(ctx: WorkerContext) -> tuple[list[Any], list[Any]]:
    for address in ctx.endpoints.scorers + ctx.endpoints.generators:
        wire.wait_ready(address, READY_TIMEOUT)
    generators = [generator_pb2_grpc.GeneratorStub(wire.channel(a)) for a in ctx.endpoints.generators]
    scorers = [scorer_pb2_grpc.ScorerStub(wire.channel(a)) for a in ctx.endpoints.scorers]
    return generators, scorers


def _publisher(ctx: WorkerContext, trainer: Trainer, generators: list[Any]) -> WeightPublisher:
    spec = ctx.job.spec
    return WeightPublisher(
        trainer.model, ctx.job.metadata.name, generators, ctx.endpoints.sync,
        backend=resolve_backend(spec.weight_sync.backend, has_gpu(ctx.job, "generator")),
        timeout=spec.weight_sync.timeout_seconds, bucket_bytes=spec.weight_sync.bucket_mb << 20,
        dtype=spec.model.dtype,
    )


def _producer_parts(ctx: WorkerContext, model_dir: Path, state: dict[str, Any], gate: VersionGate,
                    buffer: RolloutBuffer, scorers: list[Any]) -> ProducerParts:
    from transformers import AutoTokenizer

    spec = ctx.job.spec
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = task_for(spec.data)
    feed = PromptFeed(task.train(state["data_position"]), state["step"], spec.algorithm.steps,
                      spec.algorithm.prompts_per_step, state["data_position"])
    return ProducerParts(
        job=ctx.job, feed=feed, gate=gate, buffer=buffer,
        encode=lambda example: render_prompt(example, tokenizer, spec.data.template),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        scorers=scorers,
    )
