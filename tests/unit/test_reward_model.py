"""The reward-model executor without processes: its spec section, its plan, its Kubernetes objects, and how the
controller adds its score to the rule scorers' reward."""

from __future__ import annotations

import re

import grpc
import pytest

from conftest import make_full_job, make_job, sampled
from fleet_fakes import RpcFailure
from rlfleet.operator.objects import build_service
from rlfleet.operator.render import build_all
from rlfleet.operator.workload import build_statefulset
from rlfleet.v1 import scorer_pb2
from rlfleet.workers.controller.record import step_record
from rlfleet.workers.controller.rollouts import Batch, Group, Rollout
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.reward_model.stage import RewardModelScoring, reward_model_deadline
from rlfleet.workers.scorer.stage import RuleScoring
from rlfleet.workers.plan import (
    GRPC_PORT,
    ROLES,
    cluster_endpoints,
    job_roles,
    local_endpoints,
    local_ports,
    plan_workers,
    role_spec,
)
from rlfleet.workers.reward_model.config import ERROR_NAME
from rlfleet.workers.spec import SpecError, parse_job

MODEL = {"path": "/models/reward"}
# Longest job name the CRD allows (operator/crd.py MAX_NAME).
LONGEST_JOB = "j" * 42
# A StatefulSet labels its pods controller-revision-hash=<statefulset>-<hash>, the hash up to 10 digits; a label
# value is at most 63 characters.
REVISION_HASH = "9" * 10


def reward_job(**model):
    return make_job(roles={"rewardModel": MODEL | model})


# ---------------------------------------------------------------- spec


def test_the_section_is_rewardmodel_with_working_defaults():
    job = reward_job()
    section = job.to_dict()["spec"]["roles"]["rewardModel"]
    assert {k: section[k] for k in ("path", "weight", "batchSize", "timeoutSeconds", "maxLength", "template",
                                    "dtype", "replicas")} == {
        "path": "/models/reward", "weight": 1.0, "batchSize": 32, "timeoutSeconds": 1.0, "maxLength": 2048,
        "template": "plain", "dtype": None, "replicas": 1}
    assert role_spec(job, "reward") is job.spec.roles.reward_model
    assert parse_job(job.to_dict()) == job


def test_a_job_runs_a_reward_model_only_when_it_names_one():
    assert "reward" not in job_roles(make_job())
    assert make_job().spec.roles.reward_model is None
    assert job_roles(reward_job()) == ["scorer", "reward", "generator", "trainer"]


def test_two_gpus_are_refused_with_the_fix():
    with pytest.raises(SpecError) as refused:
        reward_job(resources={"gpu": 2})
    assert "spec.roles.rewardModel.resources" in str(refused.value)
    assert "add replicas instead" in str(refused.value)


def test_storage_volumes_can_be_mounted_for_every_role():
    job = make_job(roles={"rewardModel": MODEL}, storage={"volumes": [
        {"name": "rm", "mountPath": "/models", "claim": "models", "roles": ["reward"]}]})
    mounted = {role: [m["mountPath"] for m in build_statefulset(job, role)["spec"]["template"]["spec"]
                      ["containers"][0]["volumeMounts"]] for role in job_roles(job)}
    assert "/models" in mounted["reward"]
    assert all("/models" not in paths for role, paths in mounted.items() if role != "reward")


# ---------------------------------------------------------------- planner


def test_planner_starts_its_replicas_before_the_generators_and_gives_the_controller_their_addresses():
    job = reward_job(replicas=2)
    ports = local_ports(job)
    endpoints = local_endpoints(job, ports)
    workers = plan_workers(job, endpoints, "/run/config.json", "/run", "/run/token", lambda r, k: ports[(r, k)])
    assert [(w.role, w.rank) for w in workers] == [("scorer", 0), ("reward", 0), ("reward", 1), ("generator", 0),
                                                   ("trainer", 0)]
    rewards = [w for w in workers if w.role == "reward"]
    assert [w.name for w in rewards] == ["t-reward-0", "t-reward-1"]
    assert all(w.command == ["rlfleet", "worker", "reward"] for w in rewards)
    assert endpoints.of("reward") == [f"127.0.0.1:{ports[('reward', r)]['grpc']}" for r in range(2)]
    assert [w.env["RLFLEET_GRPC_PORT"] for w in rewards] == [str(ports[("reward", r)]["grpc"]) for r in range(2)]
    assert all(w.resources == job.spec.roles.reward_model.resources for w in rewards)
    assert local_endpoints(make_job(), local_ports(make_job())).of("reward") == []


def test_cluster_endpoints_name_the_reward_pods():
    job = parse_job({"metadata": {"name": "rl", "namespace": "ml"},
                     "spec": {"roles": {"rewardModel": MODEL | {"replicas": 2}}}})
    assert cluster_endpoints(job).of("reward") == [f"rl-reward-{r}.rl-reward.ml.svc:{GRPC_PORT}" for r in range(2)]


@pytest.mark.parametrize("role", ROLES)
def test_every_role_id_fits_the_kubernetes_names_of_the_longest_job(role):
    """A role id longer than 9 characters (e.g. `reward-model`) would break pods of a 42-character job: the
    StatefulSet controller could not label them."""
    job = make_full_job()
    job = parse_job(job.to_dict() | {"metadata": {"name": LONGEST_JOB}})
    sts = build_statefulset(job, role)["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", role), "names are <job>-<role>: a DNS label"
    assert len(f"{sts}-{REVISION_HASH}") <= 63
    assert len(f"{sts}-1023") <= 63 and build_service(job, role)["metadata"]["name"] == sts


# ---------------------------------------------------------------- operator


def test_operator_builds_its_statefulset_and_headless_service_probed_like_a_scorer():
    job = make_full_job(roles={"rewardModel": MODEL | {"replicas": 3, "resources": {"gpu": 1},
                                                       "nodeSelector": {"pool": "rm"}}})
    objects = {(o["kind"], o["metadata"]["name"]) for o in build_all(job)}
    assert {("StatefulSet", "t-reward"), ("Service", "t-reward")} <= objects
    sts = build_statefulset(job, "reward")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert sts["spec"]["replicas"] == 3 and sts["metadata"]["labels"]["rlfleet.io/role"] == "reward"
    assert container["command"] == ["rlfleet", "worker", "reward"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"pool": "rm"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": GRPC_PORT}
    assert build_statefulset(make_full_job(suspend=True), "reward")["spec"]["replicas"] == 0


# ---------------------------------------------------------------- controller


class FixedScores:
    """A Scorer stub: the same reward for every item, with these errors; or a failure while `fails` lasts."""

    def __init__(self, reward: float, errors=(), fails: list[grpc.StatusCode] | None = None):
        self.reward, self.errors, self.fails, self.calls = reward, list(errors), list(fails or []), []

    def Score(self, request, timeout=None):
        self.calls.append(timeout)
        if self.fails:
            raise RpcFailure(self.fails.pop(0), "down")
        return scorer_pb2.ScoreResponse(scores=[scorer_pb2.Score(sample_id=i.sample_id, reward=self.reward,
                                                                 errors=self.errors) for i in request.items])


def scored(job, scorers, reward_models):
    """The rollouts as the job's scoring stages leave them: the rule scorers', then the reward model's if it has one."""
    stages = [RuleScoring(job, scorers, lambda ids: "x")]
    stages += [RewardModelScoring(job, reward_models, lambda ids: "x")] if job.spec.roles.reward_model else []
    rollouts = [Rollout(sample_id=f"0-0-{g}", prompt=0, prompt_ids=[1, 2], answer="4", turns=sampled([5]),
                        finished=True)
                for g in range(2)]
    for stage in stages:
        stage.annotate(0, [Group(0, Example(id="0", prompt="2+2=", answer="4"), rollouts)])
    return rollouts


def test_reward_is_the_rule_scorers_plus_weight_times_the_models_score():
    job = reward_job(weight=0.5)
    rollouts = scored(job, [FixedScores(1.0, ["math_answer"])], [FixedScores(3.0, [ERROR_NAME])])
    assert [r.reward for r in rollouts] == [2.5, 2.5]
    assert [r.reward_model_score for r in rollouts] == [3.0, 3.0]
    assert all(r.scorer_errors == ["math_answer", ERROR_NAME] for r in rollouts)


def test_without_a_reward_model_the_reward_is_the_rule_scorers():
    rollouts = scored(make_job(), [FixedScores(1.0)], [FixedScores(3.0)])
    assert [r.reward for r in rollouts] == [1.0, 1.0]
    assert all(r.reward_model_score is None for r in rollouts)


def test_a_reward_model_replica_that_is_down_hands_the_call_to_another():
    down, up = FixedScores(2.0, fails=[grpc.StatusCode.UNAVAILABLE] * 5), FixedScores(2.0)
    job = reward_job(timeoutSeconds=0.5)
    rollouts = scored(job, [FixedScores(0.0)], [down, up])
    assert [r.reward for r in rollouts] == [2.0, 2.0]
    assert len(down.calls) == 1 and up.calls == [reward_model_deadline(job, 2)]
    assert reward_model_deadline(job, 2) > 2 * 0.5


def test_a_refused_reward_model_call_fails_the_batch():
    with pytest.raises(grpc.RpcError):
        scored(reward_job(), [FixedScores(0.0)], [FixedScores(1.0, fails=[grpc.StatusCode.INVALID_ARGUMENT])])


def test_the_step_record_carries_the_models_own_mean():
    from rlfleet.workers.controller.record import GeneratorTimes

    rollouts = scored(reward_job(weight=2.0), [FixedScores(1.0)], [FixedScores(0.25)])
    record = step_record(0, Batch(0, rollouts, 1), rollouts, [], {}, 0.0, GeneratorTimes([], "t"))
    assert record["reward_mean"] == 1.5 and record["reward_model_mean"] == 0.25
    plain = scored(make_job(), [FixedScores(1.0)], [])
    assert "reward_model_mean" not in step_record(0, Batch(0, plain, 1), plain, [], {}, 0.0, GeneratorTimes([], "t"))
