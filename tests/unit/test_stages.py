"""Stages (controller/stages.py): an executor kind with a stage in the table runs on every batch, in the job's order,
with no change to the controller; and the one call helper every stage's remote calls go through (controller/calls.py)
retries elsewhere only what a restarting replica answers."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from conftest import make_job
from fleet_fakes import FakeGenerator, FakeScorer, RpcFailure, make_parts, start_producers, train
from rlfleet.workers import executors, plan, wire
from rlfleet.workers.controller import calls, stages
from rlfleet.workers.controller.guidance import Guidance
from rlfleet.workers.controller.rollouts import Group
from rlfleet.workers.controller.stages import Stage, StageRun, job_stages
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.plan import Endpoints
from rlfleet.workers.scorer.stage import RuleScoring


class Replica:
    """A stub whose Echo fails with each of `fails` in turn, then answers with its name."""

    def __init__(self, name: str, fails: list[grpc.StatusCode] = ()):
        self.name, self.fails, self.timeouts = name, list(fails), []

    def Echo(self, request, timeout):
        self.timeouts.append(timeout)
        if self.fails:
            raise RpcFailure(self.fails.pop(0), "no")
        return f"{self.name}:{request}"


def test_a_transient_failure_is_retried_on_the_next_replica_which_the_caller_hears_of():
    down, up, failed = Replica("a", [grpc.StatusCode.UNAVAILABLE]), Replica("b"), []
    reply = calls.call_replica([down, up], lambda stub: stub.Echo, "x", what="Echo", deadline=3.0, grace=60.0,
                               failed=lambda replica, reason: failed.append((replica, reason)))
    assert reply == "b:x" and down.timeouts == [3.0] and up.timeouts == [3.0]
    assert failed == [(0, "Echo failed: UNAVAILABLE")]


def test_the_first_replica_is_the_callers_and_only_those_up_are_asked():
    replicas = [Replica("a"), Replica("b"), Replica("c")]
    assert calls.call_replica(replicas, lambda stub: stub.Echo, "x", what="Echo", deadline=1.0, grace=1.0,
                              start=1, up=lambda: [0, 2]) == "c:x"


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL])
def test_any_other_code_raises_at_once_without_asking_another(code):
    first, second = Replica("a", [code]), Replica("b")
    with pytest.raises(grpc.RpcError) as raised:
        calls.call_replica([first, second], lambda stub: stub.Echo, "x", what="Echo", deadline=1.0, grace=60.0)
    assert raised.value.code() == code and second.timeouts == []


def test_a_refused_credential_stops_the_run():
    first, second = Replica("a", [grpc.StatusCode.UNAUTHENTICATED]), Replica("b")
    with pytest.raises(wire.Misconfigured, match="Echo on replica 0: UNAUTHENTICATED"):
        calls.call_replica([first, second], lambda stub: stub.Echo, "x", what="Echo", deadline=1.0, grace=60.0)
    assert second.timeouts == []


def test_past_the_grace_period_the_last_failure_is_raised():
    always = Replica("a", [grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(grpc.RpcError) as raised:
        calls.call_replica([always], lambda stub: stub.Echo, "x", what="Echo", deadline=1.0, grace=0.0)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


class LengthPenalty(Stage):
    """A made-up annotating executor's stage: a reward on each completion token (Rollout.token_rewards)."""

    seen: list[int] = []

    @classmethod
    def built(cls, ctx, run):
        return cls()

    def annotate(self, index: int, groups: list[Group]) -> None:
        LengthPenalty.seen.append(index)
        for rollout in (r for g in groups for r in g.rollouts):
            rollout.token_rewards["lengthpen"] = [-0.01] * len(rollout.completion_ids)


@pytest.fixture
def length_penalty_kind(monkeypatch):
    """The table with one more kind, whose stage is LengthPenalty (its spec section: the scorers', always there)."""
    monkeypatch.setattr(LengthPenalty, "seen", [])
    kind = executors.ExecutorKind("lengthpen", "scorer", "rlfleet.workers.scorer.main", executors.SERVING, "len",
                                  stage=f"{__name__}:LengthPenalty")
    kinds = executors.KINDS[:-1] + (kind, executors.KINDS[-1])
    by_role = {k.role: k for k in kinds}
    monkeypatch.setattr(plan, "BY_ROLE", by_role)
    monkeypatch.setattr(plan, "ROLES", tuple(by_role))
    monkeypatch.setattr(stages, "BY_ROLE", by_role)
    # The scorer kind's stage as the table builds it, its replicas a fake.
    monkeypatch.setattr(RuleScoring, "built", classmethod(lambda cls, ctx, run: cls(ctx.job, [FakeScorer()],
                                                                                     run.decode)))


def test_a_kind_added_to_the_table_runs_its_stage_on_every_batch_after_the_scorers(tmp_path, length_penalty_kind):
    job = make_job(algorithm={"steps": 3, "groupSize": 2, "guidance": "none"})  # guidance's place: the next test
    generators = [FakeGenerator()]
    parts, fleet = make_parts(job, tmp_path, generators)
    parts.stages = job_stages(SimpleNamespace(job=job), StageRun(None, PolicyVersion(0), lambda ids: "x"),
                              parts.ledger, list)
    assert [type(s) for s in parts.stages] == [RuleScoring, LengthPenalty]
    start_producers(parts, generators)
    batches = train(parts, fleet, range(3))
    assert sorted(LengthPenalty.seen) == [0, 1, 2]
    for _, batch in batches:
        for rollout in batch.rollouts:
            length = len(rollout.completion_ids)
            assert rollout.token_rewards == {"lengthpen": [-0.01] * length} and rollout.reward in (0.0, 1.0)
        # The token rewards joined the advantages (train() sets group-mean ones): each group's are centred on them.
        for group in (batch.rollouts[i:i + 2] for i in range(0, len(batch.rollouts), 2)):
            totals = [r.reward - 0.01 * len(r.completion_ids) for r in group]
            assert [r.advantage for r in group] == pytest.approx([t - sum(totals) / 2 for t in totals])


def test_guidance_comes_after_the_stages_that_score_and_rescores_through_them(tmp_path, length_penalty_kind):
    job = make_job(algorithm={"guidance": "answer"}, roles={"rewardModel": {"path": "/models/reward"}})
    parts, _ = make_parts(job, tmp_path, [])
    built = job_stages(SimpleNamespace(job=job, endpoints=Endpoints(""), token="t"),
                       StageRun(None, PolicyVersion(0), lambda ids: "x"), parts.ledger, list)
    names = [type(s).__name__ for s in built]
    assert names == ["RuleScoring", "RewardModelScoring", "Guidance", "LengthPenalty"]
    [guidance] = [s for s in built if isinstance(s, Guidance)]
    assert guidance.scoring == built[:2]


def test_every_stage_the_table_names_is_a_stage():
    for kind in executors.KINDS:
        if kind.stage:
            assert issubclass(stages.stage_class(kind.stage), Stage), kind.role
