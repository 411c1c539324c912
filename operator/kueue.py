"""Gang admission through Kueue: a job labelled with a Kueue queue gets a Workload (one pod set per role, the
pods as the operator builds them), and its StatefulSets stay at zero replicas until Kueue admits the Workload,
so a half-placed job never holds GPUs. Kueue evicting it (preemption) scales it back to zero and releases the
quota, as Kueue's own job integrations do; it resumes from its checkpoint once admitted again.

Kueue must know the RLJob as a framework managed outside it: `integrations.externalFrameworks:
["RLJob.v1alpha1.rlfleet.io"]` in its Configuration (docs/kubernetes.md, "Kueue").
"""

from __future__ import annotations

from typing import Any, Literal

from rlfleet.operator.names import POOL_LABEL, ROLE_LABEL
from rlfleet.operator.status import set_condition
from rlfleet.workers.generator.pools import named_pool
from rlfleet.workers.plan import role_spec
from rlfleet.workers.spec import RLJob

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
API_VERSION = "kueue.x-k8s.io/v1beta1"
KIND = "Workload"
Admission = Literal["admitted", "pending", "evicted"]


def queue_of(labels: dict[str, str] | None) -> str | None:
    return (labels or {}).get(QUEUE_LABEL) or None


def workload_name(job: RLJob) -> str:
    return f"rljob-{job.metadata.name}"


def build_workload(job: RLJob, queue: str, statefulsets: list[dict[str, Any]]) -> dict[str, Any]:
    """Pod sets of the job's pods at their spec replicas: what Kueue reserves quota for, all or nothing."""
    pod_sets = [{"name": _pod_set(s), "count": _count(job, s),
                 "template": {"metadata": {"labels": s["spec"]["template"]["metadata"]["labels"]},
                              "spec": s["spec"]["template"]["spec"]}}
                for s in statefulsets]
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": workload_name(job), "namespace": job.metadata.namespace,
                         "labels": {"rlfleet.io/job": job.metadata.name}},
            "spec": {"queueName": queue, "podSets": pod_sets}}


def _pod_set(statefulset: dict[str, Any]) -> str:
    """A role's pod set, a named generator pool's <role>-<pool> (its own GPUs, its own quota)."""
    labels = statefulset["metadata"]["labels"]
    pool = labels.get(POOL_LABEL)
    return f"{labels[ROLE_LABEL]}-{pool}" if pool else labels[ROLE_LABEL]


def _count(job: RLJob, statefulset: dict[str, Any]) -> int:
    """The pods of its spec: the StatefulSet itself may be held at zero until admission."""
    labels = statefulset["metadata"]["labels"]
    if labels.get(POOL_LABEL):
        return named_pool(job.spec, labels[POOL_LABEL]).count
    return role_spec(job, labels[ROLE_LABEL]).replicas


def active_patch(job: RLJob) -> dict[str, Any]:
    """Suspended, the Workload is inactive: Kueue evicts it and gives its quota to others meanwhile."""
    return {"spec": {"active": not job.spec.suspend}}


def admission(workload: dict[str, Any] | None) -> Admission:
    """admitted: Kueue reserved the quota and every admission check passed; evicted: it took them back."""
    conditions = {c.get("type"): c.get("status") for c in ((workload or {}).get("status") or {}).get("conditions") or []}
    if conditions.get("Evicted") == "True":
        return "evicted"
    return "admitted" if conditions.get("Admitted") == "True" else "pending"


def release(workload: dict[str, Any], now: str, reason: str) -> dict[str, Any]:
    """The status patch that hands an evicted (or suspended) job's quota back to Kueue, which queues it again."""
    conditions = (workload.get("status") or {}).get("conditions") or []
    conditions = set_condition(conditions, "QuotaReserved", "False", "Pending", reason, now)
    conditions = set_condition(conditions, "Admitted", "False", "NoReservation", reason, now)
    return {"status": {"admission": None, "conditions": conditions}}


def status_patch(workload: dict[str, Any], terminal_phase: str | None, now: str) -> dict[str, Any] | None:
    """What the operator tells Kueue once a tick has acted: the job ended (its quota back for good), or it was
    evicted and is scaled to zero (its quota back, and Kueue queues it again); None when there is nothing to say."""
    status = workload.get("status") or {}
    conditions = status.get("conditions") or []
    if terminal_phase:
        if any(c.get("type") == "Finished" and c.get("status") == "True" for c in conditions):
            return None
        finished = set_condition(conditions, "Finished", "True", terminal_phase, f"the RLJob {terminal_phase.lower()}",
                                 now)
        return {"status": {"conditions": finished}}
    if admission(workload) == "evicted" and status.get("admission"):
        return release(workload, now, "evicted: the job's pods were stopped; it resumes from its checkpoint")
    return None
