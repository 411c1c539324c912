"""Names and labels of everything the operator creates for a job; one place so selectors always agree."""

from __future__ import annotations

from typing import Any

from rlfleet.operator import GROUP
from rlfleet.workers.plan import set_name
from rlfleet.workers.spec import RLJob

JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
# A named generator pool's pods: each pool's StatefulSet and Service select only their own.
POOL_LABEL = f"{GROUP}/pool"
OPERATOR_LABEL = f"{GROUP}/operator"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
TEMPLATE_HASH_ANNOTATION = f"{GROUP}/template-hash"
MANAGED_BY = "rlfleet-operator"


def configmap_name(job: RLJob) -> str:
    return f"{job.metadata.name}-config"


def token_secret_name(job: RLJob) -> str:
    """The Secret holding the job's gRPC token (workers mount it, the operator reads it)."""
    return f"{job.metadata.name}-token"


def controller_name(job: RLJob) -> str:
    """The Lease a job's controllers elect their leader by (spec.roles.controller), and the ServiceAccount, Role and
    RoleBinding that let them."""
    return f"{job.metadata.name}-controller"


def role_name(job: RLJob, role: str, pool: str = "") -> str:
    """Name of the role's StatefulSet and of its headless Service (pods are <this>-<rank>); a named generator
    pool's are <job>-generator-<pool>."""
    return set_name(job, role, pool)


def selector(job: RLJob, role: str | None = None, pool: str = "") -> dict[str, str]:
    labels = {JOB_LABEL: job.metadata.name}
    if role is not None:
        labels[ROLE_LABEL] = role
    if pool:
        labels[POOL_LABEL] = pool
    return labels


def labels(job: RLJob, role: str | None = None, pool: str = "") -> dict[str, str]:
    common = {
        "app.kubernetes.io/name": "rlfleet",
        "app.kubernetes.io/instance": job.metadata.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    if role is not None:
        common["app.kubernetes.io/component"] = role
    return common | selector(job, role, pool)


def metadata(job: RLJob, name: str, role: str | None = None, pool: str = "") -> dict[str, Any]:
    return {"name": name, "namespace": job.metadata.namespace, "labels": labels(job, role, pool)}
