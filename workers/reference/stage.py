"""The reference executor as the controller uses it: its weights pushed from the trainer over DDMA, and log pi_ref
of every completion before it trains.

A frozen reference (updateEverySteps 0) is the policy the run started from: the trainer pushes its weights once,
when a fresh run starts; a replica that restarts reloads the same model from the job's storage, so it rejoins
with nothing pushed (a trained policy must never reach it). A moving reference gets the trainer's weights every K
steps, and a replica that comes back rejoins with the trainer's weights as they are then, under their own version,
and the others get the same: every replica answers for one policy. Only replicas that hold weights are asked.
"""

from __future__ import annotations

from typing import Any

from rlfleet.v1 import reference_pb2, reference_pb2_grpc
from rlfleet.workers import message_budget, wire
from rlfleet.workers.controller.calls import call_replica
from rlfleet.workers.controller.receivers import WeightReceivers
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.rollouts import Group, Rollout, set_kl_penalties
from rlfleet.workers.controller.stages import Stage, StageRun
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.plan import WorkerContext

# A reference replica that went away (or, moving, has not rejoined yet) gets this long to come back before the
# run fails, as a scorer does.
REFERENCE_RETRY_SECONDS = 120.0


class ReferencePolicy(Stage):
    def __init__(self, ctx: WorkerContext, trainer: Any, policy: PolicyVersion):
        spec = ctx.job.spec
        self.kl = spec.algorithm.kl
        addresses = ctx.endpoints.of("reference")
        self.job_id = ctx.job.metadata.name
        self.every = spec.roles.reference.update_every_steps
        self.deadline = spec.generation.timeout_seconds
        self.policy = policy
        self.states = ReplicaStates(len(addresses), policy.value)
        self.receivers = WeightReceivers(ctx, trainer, self.states, policy, role="reference")
        self.stubs = [reference_pb2_grpc.ReferenceStub(wire.channel(a, ctx.token, ctx.leader_epoch))
                      for a in addresses]

    @classmethod
    def built(cls, ctx: WorkerContext, run: StageRun) -> ReferencePolicy:
        return cls(ctx, run.trainer, run.policy)

    def start(self, step: int) -> None:
        """Join every replica's sync group; push the trainer's weights on a fresh run, or to a moving reference."""
        # A frozen reference of a resumed run keeps the model it loaded: the policy the run started from.
        self.receivers.join_all(push=step == 0 or bool(self.every))

    def after_step(self, version: int) -> None:
        """A moving reference gets the policy of `version` every updateEverySteps steps (the sends overlap)."""
        if self.every and version % self.every == 0:
            self.receivers.publish()

    def tend(self) -> None:
        """Moving: replicas that came back rejoin with the trainer's weights (ahead of the last K-th step's), and
        the others are pushed the same, so no two replicas score with different policies for long."""
        if not (self.every and self.receivers.rejoin_returned()):
            return
        live = self.policy.value  # a moving reference is pushed only every K-th version
        behind = [replica for replica in self.states.up() if self.states.version(replica) != live]
        if behind:
            self.receivers.publish(behind)

    def trainer_returned(self) -> None:
        """A moving reference rejoins with the trainer's weights as they are now; a frozen one is never pushed again."""
        if self.every:
            self.receivers.join_all()

    def shape(self, fresh: list[Rollout]) -> dict[str, float]:
        """With algorithm.kl.use reward, the KL penalty comes off each reward before the advantages."""
        return set_kl_penalties(fresh, self.kl) if self.kl.use == "reward" else {}

    def finish(self) -> None:
        self.receivers.wait()

    def close(self) -> None:
        self.receivers.stop()

    def annotate(self, index: int, groups: list[Group]) -> None:
        """Set each rollout's ref_logprobs (any replica), in as many calls as fit."""
        rollouts = [r for g in groups for r in g.rollouts]
        sequences = [reference_pb2.TokenSequence(sample_id=r.sample_id, prompt_ids=r.prompt_ids,
                                                 completion_ids=r.completion_ids) for r in rollouts if r.completion_ids]
        replies = message_budget.per_token_calls(sequences, lambda part: self._anywhere(
            index, reference_pb2.LogProbsRequest(job_id=self.job_id, sequences=part)), "LogProbs on the reference")
        found = {s.sample_id: list(s.logprobs) for _, reply in replies for s in reply.sequences}
        for rollout in rollouts:
            rollout.ref_logprobs = found.get(rollout.sample_id, [])

    def _anywhere(self, index: int, request: Any) -> Any:
        """LogProbs on some replica that holds weights, retried on another while one fails: read-only, so safe to
        repeat. A replica that fails is marked down (a moving reference's rejoins)."""
        return call_replica(self.stubs, lambda stub: stub.LogProbs, request, what="LogProbs on the reference",
                            deadline=self.deadline, grace=REFERENCE_RETRY_SECONDS, start=index,
                            up=self.states.up if self.every else None, failed=self.receivers.mark_down)
