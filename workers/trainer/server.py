"""The Trainer gRPC service on trainer rank 0: what a controller running elsewhere calls on the trainer
(trainer/link.py is its client, with a Trainer's interface; a controller in rank 0 calls the Trainer itself).

One lock serialises the collective calls: the other ranks run rank 0's calls in the order it broadcasts them
(world.collective), so two must never interleave. Train is idempotent by step (workers/learned.py). Nothing on the
wire names a file: checkpoints live under the trainer's own run directory.

The trainer's clock is kept as in the controller's own process: busy while training and packing, checkpointing while
saving (the Trainer marks both), and between calls idle for the reason the controller's last Idle gave.
Every method is fenced (wire.Fence), Describe too: only a leading controller calls it, as it starts. Arrived, Describe
and Idle take no lock: rank 0 alone answers them, and Arrived comes between steps while pushes may still run.
A trainer that has not been restored since it started holds its base weights: every call that reads or changes the
policy's weights or joins a sync group is refused with ABORTED (the link's TrainerRestarted) until a Restore, so that
its leader restores it (controller/recovery.py) instead of training, saving or pushing the wrong weights.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from typing import Any, Sequence

import grpc

from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.workers import learned, wire
from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.trainer.policy import Sample, check_sample
from rlfleet.workers.trainer.worker import Trainer

log = logging.getLogger(__name__)
SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


class TrainerService(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, ctx: WorkerContext, trainer: Trainer):
        self.job_id = ctx.job.metadata.name
        self.trainer = trainer
        self.vocab_size = trainer.lm.config.vocab_size
        self.lock = threading.Lock()
        self.learned = learned.Learned(-1)
        self.placed = False
        """Whether the weights are a step's the controller knows: it restored them since this trainer started."""
        self.snapshot: tuple[int, Any] | None = None
        """The snapshot kept for SaveBest, by its number."""
        self._numbers = itertools.count(1)
        self._idle = contextlib.ExitStack()
        """The idle reason the controller's last Idle set, in force until the next."""
        self._idle_lock = threading.Lock()

    def Train(self, request_iterator, context):
        first, samples = learned.whole_step(list(request_iterator), "samples", "step_samples", context)
        self._check_job(first.job_id, context)
        if first.step < 0:
            wire.invalid(context, f"step must be >= 0, got {first.step}")
        request = trainer_pb2.TrainerTrainRequest(job_id=first.job_id, step=first.step, samples=samples)
        problem = samples_problem(samples, self.trainer.world_size, self.vocab_size)
        if problem:
            wire.invalid(context, problem)
        digest = learned.digest(request)
        with self.lock:
            if request.step <= self.learned.step:  # under the lock: a retry waits for the call it repeats
                return self.learned.repeat(request.step, digest, context, "the trainer")
            self._check_restored("Train", context)
            metrics = self.trainer.train([_sample(s) for s in samples], request.step)
            reply = trainer_pb2.TrainerTrainResponse(job_id=self.job_id, step=request.step + 1,
                                                     metrics={k: float(v) for k, v in metrics.items()})
            self.learned = learned.Learned(request.step, reply, digest)
        return reply

    def Connect(self, request, context):
        self._check_role(request.job_id, request.role, context)
        with self.lock:
            self._check_restored("Connect", context)
            error = self.trainer.connect(request.role, request.replica, request.host, request.port, request.epoch)
        return trainer_pb2.ConnectResponse(job_id=self.job_id, error=error or "")

    def Arrived(self, request, context):
        """Outside the lock: the controller asks between steps, while pushes may still run in the background."""
        self._check_role(request.job_id, request.role, context)
        found = self.trainer.arrived(request.role, request.replica, request.host, request.port, request.epoch)
        return trainer_pb2.ArrivedResponse(job_id=self.job_id, arrived=found)

    def Publish(self, request, context):
        self._check_role(request.job_id, request.role, context)
        with self.lock:
            self._check_restored("Publish", context)
            seconds = self.trainer.publish(request.role, list(request.replicas))
        return trainer_pb2.PublishResponse(job_id=self.job_id, pack_seconds=seconds)

    def Checkpoint(self, request, context):
        self._check_job(request.job_id, context)
        if request.step < 0:
            wire.invalid(context, f"step must be >= 0, got {request.step}")
        state = _state(request.state_json, context)
        with self.lock:
            self._check_restored("Checkpoint", context)
            self.trainer.checkpoint(request.step, state)
        return trainer_pb2.TrainerCheckpointResponse(job_id=self.job_id, step=request.step)

    def Restore(self, request, context):
        self._check_job(request.job_id, context)
        with self.lock:
            state = self.trainer.resume()
            # A checkpoint of step S holds steps 0..S-1: S is the next to learn, whatever was learned since.
            self.learned = learned.Learned(state["step"] - 1)
            self.placed = True
        return trainer_pb2.RestoreResponse(job_id=self.job_id, step=state["step"], state_json=json.dumps(state))

    def Snapshot(self, request, context):
        self._check_job(request.job_id, context)
        with self.lock:
            self._check_restored("Snapshot", context)
            self.snapshot = None  # one snapshot at a time in rank 0's memory, not two
            self.snapshot = (next(self._numbers), self.trainer.snapshot())
            number = self.snapshot[0]
        return trainer_pb2.SnapshotResponse(job_id=self.job_id, snapshot=number)

    def SaveBest(self, request, context):
        self._check_job(request.job_id, context)
        state = _state(request.state_json, context)
        with self.lock:
            self._check_restored("SaveBest", context)
            kept = self.snapshot[0] if self.snapshot else None
            if request.snapshot != kept:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"snapshot {request.snapshot} is not the one the trainer keeps ({kept or 'none'}): a "
                              f"new Snapshot replaced it, or the trainer restarted since")
            self.trainer.save_best(self.snapshot[1], state)
        return trainer_pb2.SaveBestResponse(job_id=self.job_id)

    def Describe(self, request, context):
        self._check_job(request.job_id, context)
        shapes = [trainer_pb2.PushShape(name=name, dims=shape) for name, shape in self.trainer.push_shapes.items()]
        return trainer_pb2.DescribeResponse(job_id=self.job_id, world_size=self.trainer.world_size, push_shapes=shapes,
                                            best_json=json.dumps(self.trainer.best()))

    def Idle(self, request, context):
        self._check_job(request.job_id, context)
        clock = self.trainer.clock
        if request.reason and request.reason not in clock.reasons:
            wire.invalid(context, f"reason {request.reason[:80]!r} is no idle reason of the trainer (known: "
                                  f"{', '.join(clock.reasons)})")
        with self._idle_lock:
            self._idle.close()
            if request.reason:
                self._idle.enter_context(clock.idle(request.reason))
            clock.started()  # the controller's loop began
        return trainer_pb2.IdleResponse(job_id=self.job_id)

    def _check_restored(self, method: str, context: grpc.ServicerContext) -> None:
        if not self.placed:
            context.abort(grpc.StatusCode.ABORTED,
                          f"{method}: the trainer has not been restored since it started (it holds its base weights, "
                          f"and no sync group): Restore first")

    def _check_role(self, job_id: str, role: str, context: grpc.ServicerContext) -> None:
        self._check_job(job_id, context)
        if role not in self.trainer.publishers:
            wire.invalid(context, f"role {role[:80]!r} receives no weights from this trainer (it pushes to: "
                                  f"{', '.join(self.trainer.publishers) or 'none'})")

    def _check_job(self, job_id: str, context: grpc.ServicerContext) -> None:
        if job_id != self.job_id:
            wire.invalid(context, f"job_id {job_id[:80]!r} is not this trainer's job ({self.job_id!r})")


def samples_problem(samples: Sequence[trainer_pb2.TrainSample], world_size: int, vocab_size: int) -> str | None:
    """What is wrong with a Train call's samples, for INVALID_ARGUMENT (checked before the ranks start on them, so that
    none fails alone); None if nothing."""
    if not world_size <= len(samples) <= wire.MAX_SEQUENCES:
        return f"samples: need {world_size}..{wire.MAX_SEQUENCES} (one per trainer rank at least), got {len(samples)}"
    for index, sample in enumerate(samples):
        ids = [*sample.prompt_ids, *sample.completion_ids]
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            return f"samples[{index}]: prompt_ids and completion_ids must be in [0, {vocab_size})"
        try:
            check_sample(index, _sample(sample))
        except ValueError as error:
            return str(error)
    return None


def _sample(sample: trainer_pb2.TrainSample) -> Sample:
    return Sample(prompt_ids=list(sample.prompt_ids), completion_ids=list(sample.completion_ids),
                  gen_logprobs=list(sample.gen_logprobs), sampled=list(sample.sampled), trained=list(sample.trained),
                  ref_logprobs=list(sample.ref_logprobs), advantage=sample.advantage,
                  token_advantages=list(sample.token_advantages))


def _state(text: str, context: grpc.ServicerContext) -> dict[str, Any]:
    """A request's state_json as the dict a checkpoint keeps."""
    try:
        state = json.loads(text)
    except ValueError as error:
        wire.invalid(context, f"state_json: not JSON ({error})")
    if not isinstance(state, dict):
        wire.invalid(context, f"state_json: needs a JSON object, got {type(state).__name__}")
    return state


def start_trainer_service(ctx: WorkerContext, trainer: Trainer) -> tuple[grpc.Server, TrainerService]:
    """The service on ctx.grpc_port, with the job's token and the fence, started."""
    service = TrainerService(ctx, trainer)
    server, _ = wire.serve(ctx.grpc_port, [lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(service, s)],
                           [SERVICE], ctx.listen_host, token=ctx.token)
    return server, service


def serve_trainer(ctx: WorkerContext, trainer: Trainer) -> None:
    """Rank 0: serve the trainer until the process is stopped."""
    server, _ = start_trainer_service(ctx, trainer)
    log.info("trainer serving on port %d", ctx.grpc_port)
    server.wait_for_termination()
