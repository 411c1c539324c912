"""The critic executor as the controller uses it: values of every finished completion (producer threads), GAE
advantages from them, and the batch's returns sent back to learn from while the policy trains."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from rlfleet.v1 import critic_pb2, critic_pb2_grpc
from rlfleet.workers import message_budget, wire
from rlfleet.workers.controller.calls import call_replica
from rlfleet.workers.controller.rollouts import Group, Rollout
from rlfleet.workers.controller.stages import Stage
from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)
# A critic that went away gets this long to come back before the run fails, as a reference replica does.
CRITIC_RETRY_SECONDS = 120.0
TRAIN_METRICS = ("value_loss", "value_clip_fraction", "explained_variance", "value_mean")


class CriticLink(Stage):
    def __init__(self, ctx: WorkerContext):
        self.job_id = ctx.job.metadata.name
        self.deadline = ctx.job.spec.generation.timeout_seconds
        address = ctx.endpoints.of("critic")[0]
        self.stub = critic_pb2_grpc.CriticStub(wire.channel(address, ctx.token, ctx.leader_epoch))
        self._learning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic-train")
        self._pending: Future | None = None
        self.version = 0
        """The critic's version if it learned each batch sent to it once: its checkpoint's, plus one a batch."""
        self.saved = 0
        """The step of the critic's last checkpoint: what a restarted critic is restored to."""
        self.kept: dict[int, list[critic_pb2.ValueTarget]] = {}
        """The targets of each step sent since that checkpoint, learned again after a restore."""

    def start(self, step: int) -> None:
        """At step 0 too: a critic that outlived its trainer must not keep what it learned since."""
        self.restore(step)
        self.saved, self.kept = step, {}

    def annotate(self, index: int, groups: list[Group]) -> None:
        """Set each finished rollout's values, V before each of its completion tokens (also its old values)."""
        valued = [r for g in groups for r in g.rollouts if r.completion_ids]
        if not valued:
            return
        sequences = [_sequence(r) for r in valued]
        replies = message_budget.per_token_calls(sequences, lambda part: self._call(
            "Values", lambda stub: stub.Values, critic_pb2.ValuesRequest(job_id=self.job_id, sequences=part)),
            "Values on the critic")
        for part, reply in replies:
            for rollout, found in zip(valued[part.start:part.stop], reply.sequences):
                rollout.values = list(found.values)

    def learn(self, rollouts: list[Rollout], step: int) -> None:
        """Send the trained rollouts' returns (their GAE advantages set them) to the critic; it learns while the policy
        trains (after_train() collects)."""
        targets = [critic_pb2.ValueTarget(sequence=_sequence(r), returns=r.returns, old_values=r.values)
                   for r in rollouts if r.completion_ids]
        self._pending = self._learning.submit(self._train, targets, step) if targets else None
        self.version += bool(targets)
        if targets:
            self.kept[step] = targets

    def _train(self, targets: list[critic_pb2.ValueTarget], step: int) -> critic_pb2.TrainResponse:
        """One Train call: the step's targets streamed in messages that fit gRPC's message limit."""
        sizes = [message_budget.Size(message_budget.FIELD_BYTES + t.ByteSize(), 0) for t in targets]
        return message_budget.call_streamed(sizes, lambda parts: self._call("Train", lambda stub: stub.Train, [
            critic_pb2.TrainRequest(job_id=self.job_id, step=step, targets=targets[p.start:p.stop],
                                    step_targets=len(targets)) for p in parts]),
            "Train on the critic", message_budget.COMPLETION_FIELD)

    def after_train(self) -> dict[str, float]:
        """The last batch's critic metrics (empty if it sent none)."""
        if self._pending is None:
            return {}
        reply, self._pending = self._pending.result(), None
        if reply.critic_version != self.version:
            reply = self._recover(reply.critic_version)
        return {name: float(getattr(reply, name)) for name in TRAIN_METRICS} | {
            "critic_seconds": reply.train_seconds, "critic_version": float(reply.critic_version)}

    def save(self, step: int) -> None:
        """The critic's checkpoint of `step`, before the trainer's: a critic restarted since the last Train (from an
        older checkpoint) saved other weights under this step, so it is recovered and saves again; the trainer's
        checkpoint promises the critic's weights of this policy."""
        reply = self._call("Save", lambda stub: stub.Save, critic_pb2.CheckpointRequest(job_id=self.job_id, step=step))
        if reply.critic_version != self.version:
            self._recover(reply.critic_version)
            self.save(step)
            return
        self.saved, self.kept = step, {s: targets for s, targets in self.kept.items() if s >= step}

    def _recover(self, version: int) -> critic_pb2.TrainResponse | None:
        """A critic out of step with the batches sent (restarted from an older checkpoint, or a batch learned twice)
        is restored to its last checkpoint and learns the batches sent since again, in order; the last one's reply.
        Values it gave meanwhile came from an older critic, as a value may while the critic learns."""
        expected = self.version
        log.warning("the critic is at version %d, not %d (one per batch sent): restoring it to step %d and training "
                    "again steps %s", version, expected, self.saved, sorted(self.kept) or "none")
        self.restore(self.saved)
        reply = None
        for step, targets in sorted(self.kept.items()):
            reply = self._train(targets, step)
            self.version = reply.critic_version
        if self.version != expected:
            # Its checkpoint is not the one saved at that step: values from here on would not be this policy's critic.
            raise RuntimeError(f"the critic is at version {self.version}, not {expected} (one per batch sent), after a "
                               f"restore to step {self.saved}: the run must resume from its last checkpoint")
        log.info("the critic is restored and learned again steps %s", sorted(self.kept) or "none")
        return reply

    def restore(self, step: int) -> None:
        reply = self._call("Restore", lambda stub: stub.Restore,
                           critic_pb2.CheckpointRequest(job_id=self.job_id, step=step))
        self.version = reply.critic_version
        log.info("critic restored to step %d (version %d)", reply.step, reply.critic_version)

    def close(self) -> None:
        self._learning.shutdown(wait=False, cancel_futures=True)

    def _call(self, name: str, method: Callable[[Any], Callable[..., Any]], request: Any) -> Any:
        """Retried on a TRANSIENT code, which every Critic call is safe for: Values is read-only; Train is idempotent
        by step (the server answers a repeat of the step it learned last with that step's reply: a call retried
        after its deadline while the server still learned is not learned twice); Save rewrites the same step's
        checkpoint and Restore loads the same one again."""
        return call_replica([self.stub], method, request, what=f"{name} on the critic", deadline=self.deadline,
                            grace=CRITIC_RETRY_SECONDS)


def _sequence(rollout: Rollout) -> critic_pb2.ValueSequence:
    return critic_pb2.ValueSequence(sample_id=rollout.sample_id, prompt_ids=rollout.prompt_ids,
                                    completion_ids=rollout.completion_ids)
