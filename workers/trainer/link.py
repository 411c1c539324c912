"""The trainer as a controller on another process or machine calls it: a client of the Trainer service
(trainer/server.py) with the interface the controller's code uses on a Trainer (world_size, push_shapes, clock,
train, connect, publish, checkpoint, resume, snapshot, save_best), so that code runs unchanged on either."""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Callable, Iterator, Sequence

import grpc

from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.workers import message_budget, wire
from rlfleet.workers.controller.calls import call_replica
from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.world import DIST_TIMEOUT

# A trainer that went away gets this long to come back before the run fails, as a critic does.
TRAINER_RETRY_SECONDS = 120.0
# A collective call lasts at most as long as the trainer ranks wait for each other in one.
COLLECTIVE_SECONDS = DIST_TIMEOUT.total_seconds()
# Describe and Idle only read or set a field.
QUICK_SECONDS = 30.0


class TrainerRestarted(RuntimeError):
    """The trainer restarted since its controller restored it (it refuses with ABORTED what needs its policy), or went
    away during a call that is never retried: its leader restores it and goes on (controller/recovery.py)."""


class RemoteClock:
    """The trainer's clock as the controller marks it: the controller's loop started, and what it waits for."""

    def __init__(self, send: Callable[[str], None]):
        self._send = send

    def started(self) -> None:
        self._send("")

    @contextlib.contextmanager
    def idle(self, reason: str) -> Iterator[None]:
        """Idle for `reason` until the block ends (then the default reason). A block that raised sends nothing more:
        its error is what the caller must see."""
        self._send(reason)
        yield
        self._send("")


class TrainerLink:
    def __init__(self, ctx: WorkerContext, address: str):
        self.job_id = ctx.job.metadata.name
        self.address = address
        self._channel = wire.channel(address, ctx.token, ctx.leader_epoch)
        self.stub = trainer_pb2_grpc.TrainerStub(self._channel)
        self.clock = RemoteClock(self._idle)

    @functools.cached_property
    def _described(self) -> trainer_pb2.DescribeResponse:
        return self._describe()

    def best(self) -> dict[str, Any]:
        """The best checkpoint's state, as the trainer holds it now; {} without one."""
        return json.loads(self._describe().best_json)

    def _describe(self) -> trainer_pb2.DescribeResponse:
        return self._call("Describe", lambda stub: stub.Describe, trainer_pb2.DescribeRequest(job_id=self.job_id),
                          QUICK_SECONDS)

    @property
    def world_size(self) -> int:
        return self._described.world_size

    @property
    def push_shapes(self) -> dict[str, tuple[int, ...]]:
        """What every weight push sends, by name: its full shape."""
        return {shape.name: tuple(shape.dims) for shape in self._described.push_shapes}

    def train(self, samples: Sequence[Any], step: int) -> dict[str, float]:
        """One step on `samples` (policy.Sample's fields), streamed in messages that fit gRPC's message limit."""
        sent = [_sample(sample) for sample in samples]
        sizes = [message_budget.Size(message_budget.FIELD_BYTES + sample.ByteSize(), 0) for sample in sent]
        reply = message_budget.call_streamed(sizes, lambda parts: self._call("Train", lambda stub: stub.Train, [
            trainer_pb2.TrainerTrainRequest(job_id=self.job_id, step=step, samples=sent[p.start:p.stop],
                                            step_samples=len(sent)) for p in parts], COLLECTIVE_SECONDS),
            "Train on the trainer", message_budget.COMPLETION_FIELD)
        return dict(reply.metrics)

    def connect(self, role: str, replica: int, host: str, port: int, epoch: int) -> str | None:
        reply = self._once("Connect", self.stub.Connect, trainer_pb2.ConnectRequest(
            job_id=self.job_id, role=role, replica=replica, host=host, port=port, epoch=epoch))
        return reply.error or None

    def arrived(self, role: str, replica: int, host: str, port: int, epoch: int) -> bool:
        reply = self._call("Arrived", lambda stub: stub.Arrived, trainer_pb2.ArrivedRequest(
            job_id=self.job_id, role=role, replica=replica, host=host, port=port, epoch=epoch), QUICK_SECONDS)
        return reply.arrived

    def publish(self, role: str, replicas: list[int]) -> float:
        """The trainer packs its shards and sends them to `role`'s replicas (in the background); the pack seconds."""
        reply = self._once("Publish", self.stub.Publish,
                           trainer_pb2.PublishRequest(job_id=self.job_id, role=role, replicas=replicas))
        return reply.pack_seconds

    def checkpoint(self, step: int, state: dict[str, Any]) -> None:
        self._call("Checkpoint", lambda stub: stub.Checkpoint, trainer_pb2.TrainerCheckpointRequest(
            job_id=self.job_id, step=step, state_json=json.dumps(state)), COLLECTIVE_SECONDS)

    def resume(self) -> dict[str, Any]:
        """The trainer's latest checkpoint loaded, and its controller state (a fresh run's without one)."""
        reply = self._call("Restore", lambda stub: stub.Restore, trainer_pb2.RestoreRequest(job_id=self.job_id),
                           COLLECTIVE_SECONDS)
        return json.loads(reply.state_json)

    def snapshot(self) -> int:
        """The trainer copies its weights and keeps them (rank 0's CPU); returns what names them for save_best."""
        return self._call("Snapshot", lambda stub: stub.Snapshot, trainer_pb2.SnapshotRequest(job_id=self.job_id),
                          COLLECTIVE_SECONDS).snapshot

    def save_best(self, snapshot: int, state: dict[str, Any]) -> None:
        self._call("SaveBest", lambda stub: stub.SaveBest, trainer_pb2.SaveBestRequest(
            job_id=self.job_id, snapshot=snapshot, state_json=json.dumps(state)), COLLECTIVE_SECONDS)

    def close(self) -> None:
        self._channel.close()

    def _idle(self, reason: str) -> None:
        self._call("Idle", lambda stub: stub.Idle, trainer_pb2.IdleRequest(job_id=self.job_id, reason=reason),
                   QUICK_SECONDS)

    def _call(self, name: str, method: Callable[[Any], Callable[..., Any]], request: Any, deadline: float) -> Any:
        """Retried on a TRANSIENT code, which these calls are safe for: Describe and Arrived only read; Idle sets the
        same reason again; Train is idempotent by step (a repeat of the step learned last gets that step's reply, not
        learned twice); Checkpoint rewrites the same step's checkpoint with the same state, Restore loads the same
        latest one again and SaveBest writes the same best one, the controller training nothing in between; a repeated
        Snapshot copies the same weights (under a new number, the one returned). Connect and Publish are not: see
        `_once`."""
        try:
            return call_replica([self.stub], method, request, what=f"{name} on the trainer", deadline=deadline,
                                grace=TRAINER_RETRY_SECONDS)
        except grpc.RpcError as error:
            _raise_if_restarted(error, name, grpc.StatusCode.ABORTED)
            raise

    def _once(self, name: str, method: Callable[..., Any], request: Any) -> Any:
        """Not retried. A repeated Connect joins a sync group of an epoch the replica may already have joined with
        the first (the trainers would wait there for it until the deadline; WeightReceivers rejoins with a new
        epoch); a repeated Publish sends the weights again to replicas that took the first push and expect no
        second one. A trainer that went away is one that restarts: its leader restores it and rejoins every group."""
        try:
            return method(request, timeout=COLLECTIVE_SECONDS)
        except grpc.RpcError as error:
            wire.raise_if_misconfigured(error, f"{name} on the trainer")
            _raise_if_restarted(error, name, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
            raise


def _raise_if_restarted(error: grpc.RpcError, name: str, *codes: grpc.StatusCode) -> None:
    if error.code() in codes:
        raise TrainerRestarted(f"{name} on the trainer: {error.code().name}: {error.details()}") from error


def _sample(sample: Any) -> trainer_pb2.TrainSample:
    return trainer_pb2.TrainSample(
        prompt_ids=sample.prompt_ids, completion_ids=sample.completion_ids, gen_logprobs=sample.gen_logprobs,
        sampled=sample.sampled, trained=sample.trained, ref_logprobs=sample.ref_logprobs, advantage=sample.advantage,
        token_advantages=sample.token_advantages)
