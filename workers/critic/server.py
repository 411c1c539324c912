"""The Critic gRPC service on critic rank 0: values of completion tokens, training on GAE returns, checkpoints,
each run on every critic rank (the model's ranks work together).

One lock serialises the model: a Values call never reads weights an update is changing, so the values of a batch
are those of one critic version (and the ranks' collectives never interleave).

Train is idempotent by step: a client retries a call whose deadline passed while the server was still learning,
and a batch must be learned once. The service keeps the last step it learned and its reply; a repeat gets that
reply, an older step is refused. The key is the step: one Train call carries a whole step's batch, and a call of the
same step with other contents is refused, not answered (a step sent in several calls would need its key to name
the part).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc

from rlfleet.v1 import critic_pb2, critic_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.critic.model import Target, ValueTrainer, saved_steps
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import CriticMetrics
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
SERVICE = critic_pb2.DESCRIPTOR.services_by_name["Critic"].full_name


@dataclass(frozen=True)
class Learned:
    """The last step the critic learned (-1: none), its Train reply and the request's digest (None when it came from
    a checkpoint)."""

    step: int
    reply: critic_pb2.TrainResponse | None = None
    digest: bytes | None = None


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
        self.learned = Learned((critic.loaded or 0) - 1)  # a checkpoint of step S holds steps 0..S-1

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
        digest = hashlib.blake2b(request.SerializeToString(deterministic=True), digest_size=16).digest()
        with self.metrics.requests.track_inprogress(), self.lock:
            if request.step <= self.learned.step:  # under the lock: a retry waits for the call it repeats
                return self._repeated(request.step, digest, context)
            with self.metrics.clock.busy():
                found = self.critic.train(targets, request.step)
            reply = critic_pb2.TrainResponse(job_id=self.job_id, critic_version=self.critic.version, **found)
            self.learned = Learned(request.step, reply, digest)
        self.metrics.trained.inc(sum(len(t.completion_ids) for t in targets))
        return reply

    def _repeated(self, step: int, digest: bytes, context: grpc.ServicerContext) -> critic_pb2.TrainResponse:
        """The reply to a Train of a step learned already: the first call's if this one repeats it, or a refusal."""
        if step == self.learned.step and self.learned.reply is not None:
            if digest == self.learned.digest:
                log.warning("Train of step %d again (a retry): answered with what it learned, not learned twice", step)
                return self.learned.reply
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"step {step}: the critic learned another batch under this step; a step's batch comes in "
                          f"one Train call")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"step {step}: the critic has learned up to step {self.learned.step} (critic version "
                      f"{self.critic.version}); a batch is learned once, in step order (Restore a checkpoint to go "
                      f"back)")

    def _whole_step(self, requests: Iterable[critic_pb2.TrainRequest],
                    context: grpc.ServicerContext) -> critic_pb2.TrainRequest:
        """A Train call's streamed messages as one request: every target of the step."""
        parts = list(requests)
        if not parts:
            wire.invalid(context, "Train needs at least one TrainRequest message")
        steps = {(part.job_id, part.step) for part in parts}
        if len(steps) > 1:
            wire.invalid(context, f"one Train call is one step of one job; its messages name {sorted(steps)[:4]}")
        targets = [t for part in parts for t in part.targets]
        expected = parts[0].step_targets or len(parts[0].targets)
        if len(targets) != expected:
            wire.invalid(context, f"Train of step {parts[0].step} brought {len(targets)} of its {expected} targets")
        return critic_pb2.TrainRequest(job_id=parts[0].job_id, step=parts[0].step, targets=targets)

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
            self.learned = Learned(step - 1)
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
