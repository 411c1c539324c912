"""The Critic gRPC service on critic rank 0: values of completion tokens, training on GAE returns, checkpoints,
each run on every critic rank (the model's ranks work together).

One lock serialises the model: a Values call never reads weights an update is changing, so the values of a batch
are those of one critic version (and the ranks' collectives never interleave).

Train is idempotent by step (workers/learned.py).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterable

import grpc

from rlfleet.v1 import critic_pb2, critic_pb2_grpc
from rlfleet.workers import learned, wire
from rlfleet.workers.critic.model import Target, ValueTrainer, saved_steps
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import CriticMetrics
from rlfleet.workers.spec import RLJob

SERVICE = critic_pb2.DESCRIPTOR.services_by_name["Critic"].full_name


class CriticService(critic_pb2_grpc.CriticServicer):
    def __init__(self, job: RLJob, critic: ValueTrainer, max_len: int, checkpoints: Path,
                 metrics: WorkerMetrics | None = None):
        self.job_id = job.metadata.name
        self.keep = job.spec.checkpoint.keep
        self.critic = critic
        self.max_len = max_len
        self.checkpoints = checkpoints
        self.lock = threading.Lock()
        self.metrics = CriticMetrics(metrics or WorkerMetrics("critic", job=self.job_id))
        self.metrics.version.set_function(lambda: self.critic.version)
        self.learned = learned.Learned((critic.loaded or 0) - 1)  # a checkpoint of step S holds steps 0..S-1

    def Values(self, request, context):
        self._check(request.job_id, list(request.sequences), context)
        pairs = [(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]  # picklable: sent to ranks
        with self.metrics.requests.track_inprogress(), self.lock, self.metrics.clock.busy():
            found = self.critic.values(pairs)
        self.metrics.valued.inc(sum(len(s.completion_ids) for s in request.sequences))
        return critic_pb2.ValuesResponse(job_id=self.job_id, critic_version=self.critic.version, sequences=[
            critic_pb2.TokenValues(sample_id=s.sample_id, values=v) for s, v in zip(request.sequences, found)])

    def Train(self, request_iterator, context):
        request = self._whole_step(request_iterator, context)
        self._check(request.job_id, [t.sequence for t in request.targets], context)
        for index, target in enumerate(request.targets):
            count = len(target.sequence.completion_ids)
            if len(target.returns) != count or len(target.old_values) != count:
                wire.invalid(context, f"targets[{index}]: {len(target.returns)} returns and {len(target.old_values)} "
                                      f"old_values for {count} completion tokens (need one each)")
        targets = [Target(list(t.sequence.prompt_ids), list(t.sequence.completion_ids), list(t.returns),
                          list(t.old_values)) for t in request.targets]
        digest = learned.digest(request)
        with self.metrics.requests.track_inprogress(), self.lock:
            if request.step <= self.learned.step:  # under the lock: a retry waits for the call it repeats
                return self.learned.repeat(request.step, digest, context, "the critic",
                                           f" (critic version {self.critic.version})")
            with self.metrics.clock.busy():
                found = self.critic.train(targets, request.step)
            reply = critic_pb2.TrainResponse(job_id=self.job_id, critic_version=self.critic.version, **found)
            self.learned = learned.Learned(request.step, reply, digest)
        self.metrics.trained.inc(sum(len(t.completion_ids) for t in targets))
        return reply

    def _whole_step(self, requests: Iterable[critic_pb2.TrainRequest],
                    context: grpc.ServicerContext) -> critic_pb2.TrainRequest:
        """A Train call's streamed messages as one request: every target of the step."""
        first, targets = learned.whole_step(list(requests), "targets", "step_targets", context)
        return critic_pb2.TrainRequest(job_id=first.job_id, step=first.step, targets=targets)

    def Save(self, request, context):
        self._check_job(request.job_id, context)
        with self.lock, self.metrics.clock.idle("checkpointing"):
            self.critic.save(self.checkpoints, request.step, self.keep)
        return critic_pb2.CheckpointResponse(job_id=self.job_id, critic_version=self.critic.version,
                                             step=request.step)

    def Restore(self, request, context):
        self._check_job(request.job_id, context)
        if request.step < 0:
            wire.invalid(context, f"step must be >= 0, got {request.step}")
        with self.lock:
            step = self.critic.load(self.checkpoints, request.step)
            if step is None:
                # A trainer checkpoint of a step promises the critic's: going on from other weights would pair
                # the policy with a critic of another step.
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"no critic checkpoint of step {request.step} under {self.checkpoints} (it has "
                              f"{saved_steps(self.checkpoints) or 'none'}): resume from a step the critic saved too")
            self.learned = learned.Learned(step - 1)
        return critic_pb2.CheckpointResponse(job_id=self.job_id, critic_version=self.critic.version, step=step)

    def _check(self, job_id: str, sequences: list, context: grpc.ServicerContext) -> None:
        self._check_job(job_id, context)
        problem = wire.sequences_problem(sequences, self.max_len, self.critic.vocab_size)
        if problem:
            wire.invalid(context, problem)

    def _check_job(self, job_id: str, context: grpc.ServicerContext) -> None:
        if job_id != self.job_id:
            wire.invalid(context, f"job_id {job_id[:80]!r} is not this critic's job ({self.job_id!r})")


def serve_critic(job: RLJob, critic: ValueTrainer, port: int, max_len: int, checkpoints: Path,
                 host: str = "0.0.0.0", metrics: WorkerMetrics | None = None, *,
                 token: str) -> tuple[grpc.Server, CriticService]:
    service = CriticService(job, critic, max_len, checkpoints, metrics)
    server, _ = wire.serve(port, [lambda s: critic_pb2_grpc.add_CriticServicer_to_server(service, s)], [SERVICE],
                           host, token=token)
    return server, service
