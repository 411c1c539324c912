"""The operator's side of Kueue's Workload contract, as pure functions."""

from __future__ import annotations

from conftest import make_job
from rlfleet.operator.kueue import admission, build_workload, queue_of, status_patch
from rlfleet.operator.render import build_all

NOW = "2026-11-25T00:00:00Z"


def workload(admitted: bool = False, evicted: bool = False, reserved: bool = True) -> dict:
    states = {"QuotaReserved": "True" if reserved else "False", "Admitted": "True" if admitted else "False"}
    if evicted:
        states["Evicted"] = "True"
    status = {"conditions": [{"type": k, "status": v, "reason": k, "message": "", "lastTransitionTime": NOW}
                             for k, v in states.items()]}
    if reserved:
        status["admission"] = {"clusterQueue": "gpus"}
    return {"status": status}


def test_admitted_pending_and_evicted_are_read_from_the_conditions():
    assert admission(None) == "pending" and admission({}) == "pending"
    assert admission(workload(admitted=True)) == "admitted"
    assert admission(workload(admitted=True, evicted=True)) == "evicted"
    # Kueue resets Evicted to False when it reserves quota again.
    again = workload(admitted=True)
    again["status"]["conditions"].append({"type": "Evicted", "status": "False", "reason": "QuotaReserved"})
    assert admission(again) == "admitted"


def test_the_operator_releases_an_evicted_jobs_quota_once_and_finishes_an_ended_job():
    released = status_patch(workload(admitted=True, evicted=True), None, NOW)
    assert released["status"]["admission"] is None
    states = {c["type"]: c["status"] for c in released["status"]["conditions"]}
    assert states["QuotaReserved"] == "False" and states["Admitted"] == "False"
    assert status_patch(workload(evicted=True, reserved=False), None, NOW) is None
    assert status_patch(workload(admitted=True), None, NOW) is None
    finished = status_patch(workload(admitted=True), "Succeeded", NOW)
    assert {"type": "Finished", "status": "True"}.items() <= finished["status"]["conditions"][-1].items()
    done = workload(admitted=True)
    done["status"]["conditions"] = finished["status"]["conditions"]
    assert status_patch(done, "Succeeded", NOW) is None


def test_the_workload_asks_for_every_pod_of_the_job():
    job = make_job(roles={"generator": {"replicas": 3}, "trainer": {"replicas": 2}})
    sets = [o for o in build_all(job) if o["kind"] == "StatefulSet"]
    built = build_workload(job, "team-a", sets)
    assert built["spec"]["queueName"] == "team-a"
    assert {s["name"]: s["count"] for s in built["spec"]["podSets"]} == {"generator": 3, "trainer": 2, "scorer": 1}
    assert queue_of({"kueue.x-k8s.io/queue-name": "team-a"}) == "team-a" and queue_of(None) is None
