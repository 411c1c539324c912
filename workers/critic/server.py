"""The Critic gRPC service on critic rank 0: values of completion tokens, training on GAE returns, checkpoints,
each run on every critic rank (the model's ranks work together).

One lock serialises the model: a Values call never reads weights an update is changing, so the values of a batch
are those of one critic version (and the ranks' collectives never interleave).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import grpc

from rlfleet.v1 import critic_pb2, critic_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.critic.model import Target, ValueTrainer
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import CriticMetrics
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
SERVICE = critic_pb2.DESCRIPTOR.services_by_name["Critic"].full_name


class CriticService(critic_pb2_grpc.CriticServicer):
    def __init__(self, job: RLJob, critic: ValueTrainer, max_len: int, checkpoints: Path,
                 metrics: WorkerMetrics | None = None):
        self.job_id = job.metadata.name
        self.keep = job.spec.checkpoint.keep
        self.critic = critic
        self.commands = critic.commands()
        self.max_len = max_len
        self.checkpoints = checkpoints
        self.lock = threading.Lock()
        self.last_train: tuple[int, critic_pb2.TrainResponse] | None = None
        """The step last learned and its reply: a Train retried after its deadline gets the reply again instead of
        learning the batch twice (the controller counts one version a batch)."""
        self.metrics = CriticMetrics(metrics or WorkerMetrics("critic", job=self.job_id))
        self.metrics.version.set_function(lambda: self.critic.version)

    def Values(self, request, context):
        self._check(request.job_id, list(request.sequences), context)
        pairs = [(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]  # picklable: sent to ranks
        with self.metrics.requests.track_inprogress(), self.lock, self.metrics.clock.busy():
            found = self.commands.command("values", pairs)
        self.metrics.valued.inc(sum(len(s.completion_ids) for s in request.sequences))
        return critic_pb2.ValuesResponse(job_id=self.job_id, critic_version=self.critic.version, sequences=[
            critic_pb2.TokenValues(sample_id=s.sample_id, values=v) for s, v in zip(request.sequences, found)])

    def Train(self, request, context):
        self._check(request.job_id, [t.sequence for t in request.targets], context)
        for index, target in enumerate(request.targets):
            count = len(target.sequence.completion_ids)
            if len(target.returns) != count or len(target.old_values) != count:
                wire.invalid(context, f"targets[{index}]: {len(target.returns)} returns and {len(target.old_values)} "
                                      f"old_values for {count} completion tokens (need one each)")
        targets = [Target(list(t.sequence.prompt_ids), list(t.sequence.completion_ids), list(t.returns),
                          list(t.old_values)) for t in request.targets]
        with self.metrics.requests.track_inprogress(), self.lock, self.metrics.clock.busy():
            if self.last_train and self.last_train[0] == request.step:
                log.warning("Train of step %d again (retried after its deadline): answered, not learned twice",
                            request.step)
                return self.last_train[1]
            found = self.commands.command("train", targets, request.step)
            reply = critic_pb2.TrainResponse(job_id=self.job_id, critic_version=self.critic.version, **found)
            self.last_train = (request.step, reply)
        self.metrics.trained.inc(sum(len(t.completion_ids) for t in targets))
        return reply

    def Save(self, request, context):
        self._check_job(request.job_id, context)
        with self.lock, self.metrics.clock.idle("checkpointing"):
            self.commands.command("save", self.checkpoints, request.step, self.keep)
        return critic_pb2.CheckpointResponse(job_id=self.job_id, critic_version=self.critic.version,
                                             step=request.step)

    def Restore(self, request, context):
        self._check_job(request.job_id, context)
        with self.lock:
            step = self.commands.command("load", self.checkpoints, request.step)
            self.last_train = None  # a resumed run learns its steps after the checkpoint again
        if step != request.step:
            log.warning("no critic checkpoint of step %d under %s: the critic goes on from what it has (version %d)",
                        request.step, self.checkpoints, self.critic.version)
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
