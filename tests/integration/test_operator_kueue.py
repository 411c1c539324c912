"""Gang admission through Kueue, with the kopf operator against KMock: Kueue does not run here, so the test
admits and evicts the job's Workload the way Kueue's scheduler does (status.admission and conditions)."""

from __future__ import annotations

import pytest

from rlfleet.operator.kueue import QUEUE_LABEL
from kmock_cluster import JOBS, Api, Operator, eventually, prepare, rljob

pytestmark = pytest.mark.integration

STS = "apps/v1/statefulsets"
WORKLOADS = "kueue.x-k8s.io/v1beta1/workloads"
WORKLOAD = "/apis/kueue.x-k8s.io/v1beta1/namespaces/default/workloads/rljob-queued"
ROLES = ("generator", "scorer", "trainer")
SPEC = {"roles": {"generator": {"replicas": 2, "engine": "torch"}}}
NOW = "2026-11-25T00:00:00Z"


@pytest.fixture
def api(kmock, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(prepare(kmock, tmp_path)))
    return Api(kmock)


def replicas(api: Api) -> dict[str, int]:
    return {role: (api.get(STS, f"queued-{role}") or {}).get("spec", {}).get("replicas") for role in ROLES}


def ready_reason(api: Api) -> str:
    status = (api.get("rlfleet.io/v1alpha1/rljobs", "queued") or {}).get("status") or {}
    return next((c["reason"] for c in status.get("conditions", []) if c["type"] == "Ready"), "")


def conditions(**states: str) -> list[dict]:
    return [{"type": kind, "status": state, "reason": kind, "message": "", "lastTransitionTime": NOW}
            for kind, state in states.items()]


async def test_a_queued_job_runs_only_while_kueue_admits_it(api):
    job = rljob("queued", SPEC)
    job["metadata"]["labels"] = {QUEUE_LABEL: "gpu-queue"}
    async with Operator():
        await api.create(JOBS, job)
        workload = await eventually(lambda: api.get(WORKLOADS, "rljob-queued"), what="the Workload")
        assert workload["spec"]["queueName"] == "gpu-queue"
        assert {s["name"]: s["count"] for s in workload["spec"]["podSets"]} == {"generator": 2, "scorer": 1,
                                                                                "trainer": 1}
        trainer = next(s for s in workload["spec"]["podSets"] if s["name"] == "trainer")
        assert trainer["template"]["spec"]["containers"][0]["command"][:3] == ["rlfleet", "worker", "trainer"]
        assert workload["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
        # Queued: every object but no pod, and the status says why.
        await eventually(lambda: api.get("networking.k8s.io/v1/networkpolicies", "queued"), what="the objects")
        assert replicas(api) == {"generator": 0, "scorer": 0, "trainer": 0}
        await eventually(lambda: ready_reason(api) == "Queued", what="the Queued reason")

        # Kueue admits the Workload: all pods at once.
        await api.merge(f"{WORKLOAD}/status", {"status": {"admission": {"clusterQueue": "gpus"},
                                                          "conditions": conditions(QuotaReserved="True",
                                                                                   Admitted="True")}})
        await eventually(lambda: replicas(api) == {"generator": 2, "scorer": 1, "trainer": 1}, what="scaled up")

        # Kueue evicts it (preemption): every pod goes, and the quota is handed back so it queues again.
        await api.merge(f"{WORKLOAD}/status", {"status": {"conditions": conditions(
            QuotaReserved="True", Admitted="True", Evicted="True")}})
        await eventually(lambda: replicas(api) == {"generator": 0, "scorer": 0, "trainer": 0}, what="scaled down")
        released = await eventually(lambda: (w := api.get(WORKLOADS, "rljob-queued"))["status"].get("admission")
                                    is None and w, what="the quota released")
        states = {c["type"]: c["status"] for c in released["status"]["conditions"]}
        assert states["QuotaReserved"] == "False" and states["Admitted"] == "False"
        await eventually(lambda: ready_reason(api) == "Queued", what="queued again")

        # Suspended, the Workload is inactive: Kueue does not admit it again meanwhile.
        await api.merge(f"{JOBS}/queued", {"spec": {"suspend": True}})
        await eventually(lambda: api.get(WORKLOADS, "rljob-queued")["spec"].get("active") is False,
                         what="an inactive Workload")
