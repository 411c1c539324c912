"""Status and lifecycle decisions, from what the cluster shows: pure, no server."""

from __future__ import annotations

from conftest import make_job
from rlfleet.operator.assess import (NOT_OWNED, Observed, Progress, assess, changed_fields, initial_status,
                                     is_terminal, not_owned_status, refused_status)
from rlfleet.operator.status import set_condition

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def sets(ready: int = 0, replicas: int = 1) -> dict:
    return {role: {"spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}
            for role in ("trainer", "generator", "scorer")}


def pod(name: str, role: str, **status) -> dict:
    return {"metadata": {"name": name, "labels": {"rlfleet.io/job": "t", "rlfleet.io/role": role}}, "status": status}


def ready(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_all_pods_ready_is_running_with_progress():
    progress = Progress("Running", step=7, total_steps=100, policy_version=7, reward_mean=0.25)
    result = assess(make_job(), {}, Observed(sets(ready=1), [], progress), NOW, 3)
    assert result.status["phase"] == "Running"
    assert result.status["ready"] == "3/3"
    assert (result.status["step"], result.status["policyVersion"], result.status["rewardMean"]) == (7, 7, 0.25)
    assert ready(result.status)["status"] == "True"
    assert ready(result.status)["observedGeneration"] == 3
    assert not (result.scale_to_zero or result.restart_trainers)


def test_without_a_controller_the_phase_comes_from_the_statefulsets():
    result = assess(make_job(), {}, Observed(sets(ready=0), []), NOW, None)
    assert result.status["phase"] == "Pending"
    assert "step" not in result.status
    assert ready(result.status)["reason"] == "PodsNotReady"


def test_image_pull_and_unschedulable_pods_are_named_in_the_condition():
    pods = [
        pod("t-generator-0", "generator", containerStatuses=[
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}]),
        pod("t-trainer-0", "trainer", conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]),
    ]
    condition = ready(assess(make_job(), {}, Observed(sets(), pods), NOW, None).status)
    assert condition["reason"] == "ImagePullBackOff"
    assert "t-generator-0: ImagePullBackOff: no such image" in condition["message"]
    assert "t-trainer-0 unschedulable: 0/4 nodes are available" in condition["message"]


def test_suspended_job_reports_suspended():
    result = assess(make_job(suspend=True), {"phase": "Running"}, Observed(sets(replicas=0), []), NOW, None)
    assert result.status["phase"] == "Suspended"
    assert result.status["ready"] == "0/0"


def test_controller_success_finishes_the_job_and_frees_the_pods():
    progress = Progress("Succeeded", step=100, total_steps=100, policy_version=100, reward_mean=0.9)
    result = assess(make_job(), {"phase": "Running"}, Observed(sets(ready=1), [], progress), NOW, None)
    assert result.status["phase"] == "Succeeded"
    assert result.scale_to_zero
    assert result.events[0][:2] == ("Normal", "Succeeded")


def test_trainer_rank0_exit_zero_also_means_finished():
    done = pod("t-trainer-0", "trainer", containerStatuses=[{"lastState": {"terminated": {"exitCode": 0}}}])
    result = assess(make_job(), {"phase": "Running"}, Observed(sets(ready=1), [done]), NOW, None)
    assert result.status["phase"] == "Succeeded"


def test_with_controllers_of_its_own_a_controller_that_exited_zero_means_finished():
    """The trainer serves its controllers and never exits; the leader exits 0 once every step is trained, as does a
    standby that leads the finished run after it."""
    job = make_job(roles={"controller": {"replicas": 2}})
    done = pod("t-control-1", "control", containerStatuses=[{"lastState": {"terminated": {"exitCode": 0}}}])
    lost = pod("t-control-0", "control", containerStatuses=[{"lastState": {"terminated": {"exitCode": 1}}}])
    assert assess(job, {"phase": "Running"}, Observed(sets(ready=1), [lost]), NOW, None).status["phase"] != "Succeeded"
    assert assess(job, {"phase": "Running"}, Observed(sets(ready=1), [lost, done]), NOW, None).status[
        "phase"] == "Succeeded"


def test_a_finished_job_shows_its_last_step_though_the_controller_answered_last_before_it():
    """On a real cluster trainer rank 0 exited between two Status calls and `kubectl get rlj` showed a
    Succeeded job at step 145 of 150 for good (a terminal job's progress is never read again)."""
    job = make_job()
    done = pod("t-trainer-0", "trainer", containerStatuses=[{"state": {"terminated": {"exitCode": 0}}}])
    previous = {"phase": "Running", "step": job.spec.algorithm.steps - 5, "totalSteps": job.spec.algorithm.steps}
    result = assess(job, previous, Observed(sets(ready=0), [done]), NOW, None)
    assert result.status["phase"] == "Succeeded"
    assert result.status["step"] == result.status["totalSteps"] == job.spec.algorithm.steps
    assert changed_fields(previous, result.status)["step"] == job.spec.algorithm.steps


def crashed(name: str = "t-trainer-0", code: int = 137, reason: str = "OOMKilled") -> dict:
    return pod(name, "trainer", containerStatuses=[
        {"restartCount": 1, "lastState": {"terminated": {"exitCode": code, "reason": reason}}}])


def test_failed_trainer_restarts_from_the_checkpoint_within_budget():
    job = make_job(failurePolicy={"maxRestarts": 2})
    result = assess(job, {"phase": "Running", "restarts": 1}, Observed(sets(ready=1), [crashed()]), NOW, None)
    assert result.restart_trainers and not result.scale_to_zero
    assert result.status["restarts"] == 2
    assert "t-trainer-0 exited with code 137 (OOMKilled)" in ready(result.status)["message"]
    assert result.events[0][0] == "Warning"


def test_failed_trainer_beyond_budget_fails_the_job():
    job = make_job(failurePolicy={"maxRestarts": 2})
    result = assess(job, {"phase": "Pending", "restarts": 2}, Observed(sets(ready=1), [crashed()]), NOW, None)
    assert result.status["phase"] == "Failed"
    assert ready(result.status)["reason"] == "RestartLimitExceeded"
    assert result.scale_to_zero and not result.restart_trainers
    assert is_terminal(result.status)


def test_pods_being_deleted_and_other_roles_do_not_count_as_trainer_failures():
    deleting = crashed()
    deleting["metadata"]["deletionTimestamp"] = NOW
    generator = crashed("t-generator-0")
    generator["metadata"]["labels"]["rlfleet.io/role"] = "generator"
    result = assess(make_job(), {"phase": "Running"}, Observed(sets(ready=1), [deleting, generator]), NOW, None)
    assert not result.restart_trainers and result.status["phase"] == "Running"


def test_terminal_phases_stay_and_keep_pods_at_zero():
    failed = assess(make_job(), {}, Observed(sets(), [crashed()]), NOW, None).status  # maxRestarts 3: restart
    assert failed["phase"] == "Pending"
    done = {"phase": "Succeeded", "conditions": []}
    result = assess(make_job(), done, Observed(sets(ready=1), []), LATER, None)
    assert result.status["phase"] == "Succeeded" and result.scale_to_zero
    assert assess(make_job(), done, Observed(sets(replicas=0), []), LATER, None).scale_to_zero is False
    assert initial_status(make_job(), done, LATER, None) == {}


def test_invalid_spec_is_failed_but_not_terminal_and_recovers():
    refused = refused_status(["spec.algorithm.maxStaleness: bad"], {}, NOW, 2)
    assert refused["phase"] == "Failed" and not is_terminal(refused)
    assert "spec.algorithm.maxStaleness" in ready(refused)["message"]
    assert initial_status(make_job(), refused, LATER, 3)["phase"] == "Pending"
    assert initial_status(make_job(suspend=True), refused, LATER, 3)["phase"] == "Suspended"


def test_transition_time_moves_only_when_the_status_changes():
    first = set_condition([], "Ready", "False", "PodsNotReady", "0/3", NOW)
    same = set_condition(first, "Ready", "False", "Unschedulable", "other words", LATER)
    flipped = set_condition(same, "Ready", "True", "AllPodsReady", "3/3", LATER)
    assert same[0]["lastTransitionTime"] == NOW
    assert flipped[0]["lastTransitionTime"] == LATER


def test_only_changed_fields_are_written():
    current = {"phase": "Running", "ready": "3/3", "restarts": 0}
    assert changed_fields(current, {"phase": "Running", "ready": "2/3", "step": None}) == {"ready": "2/3"}


def test_the_timer_keeps_a_not_owned_refusal_and_a_reconcile_that_writes_clears_it():
    refused = not_owned_status("NetworkPolicy t exists and is controlled by no owner", {}, NOW, 1)
    assert refused["phase"] == "Failed" and ready(refused)["reason"] == NOT_OWNED
    result = assess(make_job(), refused, Observed({role: None for role in ("trainer", "generator", "scorer")}, []),
                    LATER, 1)
    assert changed_fields(refused, result.status).keys().isdisjoint({"phase", "conditions"})
    assert not (result.scale_to_zero or result.scale_up or result.restart_trainers)
    assert initial_status(make_job(), refused, LATER, 1)["phase"] == "Pending"
