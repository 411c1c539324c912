"""The controller: the LlamaRL loop, run in trainer rank 0 or as an executor of its own (spec.roles.controller).

It leads the run first (leadership.py): it waits for any other controller of the run to end or lose its lease, and
every call it makes to an executor carries its leader epoch, so executors refuse the late calls of a deposed one.
A controller of its own outlives the trainer: when the trainer restarts, the leader restores it and goes on
(recovery.py), its producers generating all the while.

Producers (one thread per generator replica) fill the rollout buffer while the trainer trains; each
producer's version gate keeps every trained rollout within `maxStaleness` versions of the policy
being updated. New weights go shard to shard to every generator while the next step trains.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rlfleet.workers import wire
from rlfleet.workers.controller import leadership
from rlfleet.workers.controller.dispatch import WHOLE_BATCHES_ENV, Dispatch, PromptFeed, prompt_budget
from rlfleet.workers.controller.ledger import PROMPTS_FILE, PromptLedger, restored_groups
from rlfleet.workers.controller.receivers import WeightReceivers, generator_stub
from rlfleet.workers.controller.members import GeneratorMembers
from rlfleet.workers.controller.recovery import TrainerRecovery
from rlfleet.workers.controller.producer import ProducerParts, RolloutProducer
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.record import (METRICS_FILE, GeneratorTimes, append_metrics, keep_lines_until,
                                              step_record)
from rlfleet.workers.controller.rollouts import (Batch, Rollout, RolloutBuffer, set_advantages, set_gae_advantages,
                                                 split_stale, training_samples)
from rlfleet.workers.controller.stages import Stage, StageRun, job_stages
from rlfleet.workers.controller.status import Progress, serve_controller
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.data.tasks import render_prompt, task_for
from rlfleet.workers.engines import max_model_len
from rlfleet.workers.evaluation.in_loop import HeldOutEvaluator, InLoopEvaluation
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import ControllerMetrics
from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.rl.config import Advantage, Gae
from rlfleet.workers.scorer.stage import RuleScoring, remote_grader
from rlfleet.workers.spec import uncorrected_quantization
from rlfleet.workers.tracking import close_trackers, log_record, open_trackers

if TYPE_CHECKING:  # the controller's own pod starts without the trainer's libraries
    from rlfleet.workers.trainer.worker import Trainer

log = logging.getLogger(__name__)
# Generators load an engine (vLLM: seconds to a minute) before they answer.
READY_TIMEOUT = 600.0
# How often the trainer, waiting for rollouts, looks for generators that came back.
REJOIN_POLL_SECONDS = 1.0


def run_controller(ctx: WorkerContext, trainer_of: Callable[[WorkerContext], Trainer], model_dir: Path,
                   worker: WorkerMetrics | None = None) -> None:
    """Lead the run, then drive it to its end with the trainer `trainer_of(the leader's context)` gives: the trainer
    itself in trainer rank 0, a link to its gRPC service in a controller of its own (controller/main.py)."""
    # Before anything writes the run directory or calls an executor: only the leader does either.
    leader = leadership.acquire(ctx.run_dir)
    try:
        with leadership.released_on_sigterm(leader):
            led = dataclasses.replace(ctx, leader_epoch=leader.epoch)
            _lead(led, trainer_of(led), model_dir, worker)
    finally:
        leader.release()


def _lead(ctx: WorkerContext, trainer: Trainer, model_dir: Path, worker: WorkerMetrics | None) -> None:
    job, alg = ctx.job, ctx.job.spec.algorithm
    run_dir = Path(ctx.run_dir)
    uncorrected = uncorrected_quantization(job.spec)
    if uncorrected:
        log.warning("%s", uncorrected)
    state = trainer.resume()
    if state["step"] >= alg.steps:  # a standby that leads once the leader has finished
        log.info("the run is finished (step %d of %d): nothing to lead", state["step"], alg.steps)
        return
    # From here on, a trainer that restarts is restored; only one of its own can restart under its leader.
    recovery = TrainerRecovery(trainer, state["step"], keeps=bool(job.spec.roles.controller))
    if state["step"] == 0 and job.spec.roles.controller:
        # A successor resumes the trainer, which outlives this leader, from the run's latest checkpoint: there must
        # be one before the first step changes the weights.
        recovery.checkpoint(0, state)
    superseded = keep_lines_until(run_dir / METRICS_FILE, state["step"])
    keep_lines_until(run_dir / PROMPTS_FILE, state["step"])
    ledger = PromptLedger(run_dir)
    generators = _connect(ctx)
    tokenizer = _tokenizer(model_dir)
    policy = PolicyVersion(state["step"])
    replicas = ReplicaStates(len(generators), policy.value, gaps=_gaps(generators))
    receivers = WeightReceivers(ctx, trainer, replicas, policy)
    recovery.returned.append(receivers.join_all)
    recovery.guard(receivers.join_all, again=False)
    new_tokens = job.spec.generation.max_new_tokens
    budget = prompt_budget(max_model_len(model_dir, new_tokens), new_tokens)
    dispatch = Dispatch(_feed(ctx, tokenizer, budget, state, ledger), replicas, alg.max_staleness,
                        split=WHOLE_BATCHES_ENV not in os.environ)
    stages = job_stages(ctx, StageRun(trainer, policy,
                                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                      prompt_budget=budget),
                        ledger, lambda text: completion_ids(tokenizer, text))
    for stage in stages:
        recovery.guard(lambda: stage.start(state["step"]))
        recovery.returned.append(stage.trainer_returned)
    buffer = RolloutBuffer()
    parts = ProducerParts(job=job, dispatch=dispatch, receivers=receivers, buffer=buffer, ledger=ledger, stages=stages)
    for index in replicas.members():
        RolloutProducer(parts, generators[index], index).start()
    members = GeneratorMembers(ctx.endpoints_file, ctx.endpoints)
    progress = Progress(step=state["step"], total_steps=alg.steps, policy_version=policy.value)
    server, status = serve_controller(job.metadata.name, progress, ctx.grpc_port, ctx.listen_host, token=ctx.token)
    generator_times = GeneratorTimes(generators, job.metadata.name, replicas.is_up)
    meters = _meters(ctx, worker, buffer)
    evaluation = _evaluation(ctx, trainer, tokenizer, generators, replicas, meters, stages, recovery)
    trackers = open_trackers(job.spec.tracking, run_dir, job.to_dict(), state["step"])
    executor = trainer.clock  # busy while training and packing (the Trainer marks it), idle otherwise
    executor.started()
    if evaluation and state["step"] == 0:
        evaluation.before_training(policy.value)
    elif evaluation:
        evaluation.carry(superseded, state["step"])
    try:
        for step in range(state["step"], alg.steps):
            # ---- wait for the rollouts of this step (trainer idle) ----
            waited = time.perf_counter()
            with executor.idle("waiting_for_rollouts"):
                batch = _take(buffer, step,
                              lambda: recovery.guard(lambda: _tend(members, receivers, parts, generators, ctx)))
            idle = time.perf_counter() - waited
            fresh, stale = split_stale(batch.rollouts, step, alg.max_staleness)
            shaped = _shape(stages, fresh)
            _advantages(fresh, alg.advantage, alg.gae)
            for stage in stages:  # a critic learns from the batch while the policy trains on it
                stage.learn(fresh, step)
            # ---- train, then push the new policy to the generators ----
            trained = len(fresh) >= trainer.world_size
            metrics = shaped | (recovery.train(training_samples(fresh), step) if trained else {})
            for stage in stages:
                metrics |= stage.after_train()
            ledger.settle(step, batch.rollouts, fresh, trained)
            with executor.idle("waiting_for_weights"):  # the previous push must land first
                receivers.wait()
            version = policy.trained(step)
            metrics |= recovery.guard(receivers.publish, again=False) or {}  # the previous push's timings
            metrics |= dispatch.throughput.fields()
            for stage in stages:
                recovery.guard(lambda: stage.after_step(version), again=False)
            record = step_record(step, batch, fresh, stale, metrics, idle, generator_times)
            if evaluation:  # held-out accuracy, from a generator, while the next step trains
                record |= evaluation.after_step(version)
            append_metrics(run_dir, record)
            log_record(trackers, record)
            meters.observe_step(record, step, fresh)
            status.set(step=version, policy_version=version, reward_mean=record["reward_mean"])
            status.count(samples_trained=len(fresh), samples_dropped_stale=len(stale),
                         tokens_generated=record["tokens_generated"])
            if version % job.spec.checkpoint.every_steps == 0 or version == alg.steps:
                for stage in stages:  # first: a trainer checkpoint of a step is the promise that theirs exist
                    stage.save(version)
                _checkpoint(recovery, version, batch, ledger)
        receivers.wait()
        for stage in stages:
            stage.finish()
        ledger.close(alg.steps - 1)
        status.set(phase="Succeeded")
    except BaseException:
        status.set(phase="Failed")
        raise
    finally:
        close_trackers(trackers)
        receivers.stop()
        for stage in stages:
            stage.close()
        server.stop(grace=1.0)


def completion_ids(tokenizer: Any, text: str) -> list[int]:
    """A text as a finished completion, the way generators end one: its tokens, then the end-of-text token."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


def _shape(stages: list[Stage], fresh: list[Rollout]) -> dict[str, float]:
    """Each stage's changes to the fresh rollouts before their advantages (a KL penalty on the reward), and metrics."""
    metrics: dict[str, float] = {}
    for stage in stages:
        metrics |= stage.shape(fresh)
    return metrics


def _advantages(fresh: list[Rollout], advantage: Advantage, gae: Gae) -> None:
    """The batch's advantages; GAE's from the values a stage set (the critic's)."""
    if advantage == "gae":
        set_gae_advantages(fresh, gae)
    else:
        set_advantages(fresh, advantage)


def _meters(ctx: WorkerContext, worker: WorkerMetrics | None, buffer: RolloutBuffer) -> ControllerMetrics:
    worker = worker or WorkerMetrics("trainer", 0, ctx.job.metadata.name, ctx.job.metadata.namespace)
    return ControllerMetrics(worker, {"rollout_batches": buffer.depth})


def _evaluation(ctx: WorkerContext, trainer: Trainer, tokenizer: Any, generators: list[Any], replicas: ReplicaStates,
                meters: ControllerMetrics, stages: list[Stage], recovery: TrainerRecovery) -> InLoopEvaluation | None:
    if not ctx.job.spec.evaluation.every_steps:
        return None
    scoring = next(stage for stage in stages if isinstance(stage, RuleScoring))  # every job has a scorer executor
    evaluator = HeldOutEvaluator(ctx.job, tokenizer, generators,
                                 lambda replica: replicas.version(replica) if replicas.is_up(replica) else None,
                                 remote_grader(ctx.job, scoring.stubs),
                                 episodes=next((stage for stage in stages if stage.drives_turns), None))
    evaluation = InLoopEvaluation(evaluator, trainer, meters, recovery.guard)
    recovery.returned.append(evaluation.trainer_returned)
    return evaluation


def _take(buffer: RolloutBuffer, step: int, tend: Callable[[], None]) -> Batch:
    """Batch `step`; before it and while it is not there, tend the generators."""
    tend()
    while (batch := buffer.take(step, timeout=REJOIN_POLL_SECONDS)) is None:
        tend()
    return batch


def _tend(members: GeneratorMembers, receivers: WeightReceivers, parts: ProducerParts, generators: list[Any],
          ctx: WorkerContext) -> None:
    """Follow the generators added to or removed from the job; let those that came back (or were added) rejoin,
    and each stage (the reference replicas that came back). An added generator's stub joins `generators`, which the
    generator times and the evaluator read too."""
    endpoints = members.changed()
    if endpoints is not None:
        for replica in receivers.resize(endpoints):
            generators += [None] * (replica + 1 - len(generators))
            generators[replica] = generator_stub(endpoints.of("generator")[replica], ctx)
            RolloutProducer(parts, generators[replica], replica).start()
    receivers.rejoin_returned()
    for stage in parts.stages:
        stage.tend()


def _checkpoint(recovery: TrainerRecovery, step: int, batch: Batch, ledger: PromptLedger) -> None:
    # Prompts handed out but not trained yet (being generated, or waiting in the buffer) are saved with
    # their tokens: a resumed run finishes them instead of sampling them again.
    state = {"step": step, "data_position": batch.data_position,
             "in_flight": ledger.in_flight()}
    recovery.checkpoint(step, state)


def _connect(ctx: WorkerContext) -> list[Any]:
    """Stubs of the generators by index (None in the gaps between pools' blocks), once every executor is ready (the
    stages make their own)."""
    found = ctx.endpoints
    for address in [address for addresses in found.servers.values() for address in addresses if address]:
        wire.wait_ready(address, READY_TIMEOUT)
    return [generator_stub(address, ctx) if address else None for address in found.of("generator")]


def _gaps(generators: list[Any]) -> set[int]:
    return {index for index, stub in enumerate(generators) if stub is None}


def _feed(ctx: WorkerContext, tokenizer: Any, budget: int, state: dict[str, Any], ledger: PromptLedger) -> PromptFeed:
    """The prompt stream from the checkpoint's data position, its saved groups first in line."""
    spec = ctx.job.spec
    restored = restored_groups(state.get("in_flight", []))
    for group in restored:
        ledger.opened(group)
    task = task_for(spec.data)
    return PromptFeed(task.train(state["data_position"]), state["step"], spec.algorithm.steps,
                      spec.algorithm.prompts_per_step, state["data_position"],
                      encode=lambda example: render_prompt(example, tokenizer, spec.data.template),
                      max_prompt_tokens=budget,
                      ledger=ledger, restored=restored, pass_size=task.train_size)


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
