"""Pure builders of a job's ConfigMap, token Secret, headless Services, NetworkPolicy and its controllers' access.

Every builder is `job -> dict` (plus the operator's config where the deployment decides): no server, no
ownership (the handlers add ownerReferences), so `rlfleet render` prints exactly what the operator creates.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from rlfleet.operator import names
from rlfleet.operator.config import OperatorConfig
from rlfleet.workers.executors import BY_ROLE
from rlfleet.workers.models.precision import resolve_dtype
from rlfleet.workers.plan import DIST_PORT, ENDPOINTS_FILE, GRPC_PORT, HTTP_PORT, METRICS_PORT, cluster_endpoints
from rlfleet.workers.spec import RLJob

JOB_FILE = "job.json"
ENDPOINTS_KEY = ENDPOINTS_FILE
TOKEN_KEY = "token"
# Read only by the operator: changing them must not restart any worker.
OPERATOR_ONLY_FIELDS = ("suspend", "failurePolicy")


def job_document(job: RLJob) -> dict[str, Any]:
    """The resolved job the workers read: every default filled in, server metadata left out, and `model.dtype:
    auto` decided by the job's GPUs alone, once for all pods (the operator cannot see their nodes' CPUs)."""
    document = resolve_dtype(job, fast_cpu_bfloat16=False).to_dict()
    document["metadata"] = {"name": job.metadata.name, "namespace": job.metadata.namespace}
    return document


def config_hash(job: RLJob) -> str:
    """Hash of what the workers run; a change rolls the pods (they resume from the checkpoint).

    Generator replicas (the role's and each pool's) are left out: scaling generators must not restart trainers or
    scorers.
    """
    document = job_document(job)
    for field in OPERATOR_ONLY_FIELDS:
        document["spec"].pop(field, None)
    generator = document["spec"]["roles"]["generator"]
    for section in [generator, *generator.get("pools", [])]:
        section.pop("replicas", None)
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]


def build_configmap(job: RLJob) -> dict[str, Any]:
    # Endpoints live here, not in pod templates: they list every generator, and a template that changed
    # with the generator count would restart every role when only generators scale. Mounted as a file too,
    # which the kubelet keeps current: the controller follows it to use generators added or removed live.
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(job, names.configmap_name(job)),
        "data": {
            JOB_FILE: json.dumps(job_document(job), indent=2, sort_keys=True),
            ENDPOINTS_KEY: cluster_endpoints(job).to_json(),
        },
    }


def build_token_secret(job: RLJob, token: str) -> dict[str, Any]:
    """The job's gRPC token (`rlfleet.workers.auth`). Immutable: created once and never rotated, since the
    running workers read it at start; deleting the job deletes it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": names.metadata(job, names.token_secret_name(job)),
        "type": "Opaque",
        "immutable": True,
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def secret_token(secret: dict[str, Any]) -> str | None:
    """The token held by a live token Secret, or None when it holds none."""
    encoded = (secret.get("data") or {}).get(TOKEN_KEY)
    return base64.b64decode(encoded).decode() if encoded else None


def service_ports(role: str) -> list[dict[str, Any]]:
    ports = [_port("grpc", GRPC_PORT), _port("metrics", METRICS_PORT)]
    if BY_ROLE[role].ranked:  # pod 0 hosts its ranks' rendezvous
        ports.append(_port("dist", DIST_PORT))
    if BY_ROLE[role].serves_http:  # the generators' OpenAI-compatible endpoint, which agents' episodes call
        ports.append(_port("http", HTTP_PORT))
    return ports


def build_service(job: RLJob, role: str, pool: str = "") -> dict[str, Any]:
    """Headless: gives every pod the stable DNS name the planner uses (<job>-<role>-<rank>.<job>-<role>; a named
    generator pool's <job>-generator-<pool>-<ordinal>.<job>-generator-<pool>)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(job, names.role_name(job, role, pool), role, pool),
        "spec": {
            "clusterIP": "None",
            # Peers must resolve each other while starting (weight-sync stores, rendezvous), before readiness.
            "publishNotReadyAddresses": True,
            "selector": names.selector(job, role, pool),
            "ports": service_ports(role),
        },
    }


def build_network_policy(job: RLJob, config: OperatorConfig | None = None) -> dict[str, Any]:
    """Only the job's own pods reach its workers, on any port (NCCL picks ephemeral ports); from outside,
    anyone may scrape metrics and the operator may read the controller's status."""
    config = config or OperatorConfig()
    operator_pods = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.operator_namespace}},
        "podSelector": {"matchLabels": {names.OPERATOR_LABEL: "true"}},
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(job, job.metadata.name),
        "spec": {
            "podSelector": {"matchLabels": names.selector(job)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": names.selector(job)}}]},
                {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
                {"from": [operator_pods], "ports": [{"protocol": "TCP", "port": GRPC_PORT}]},
            ],
        },
    }


def build_egress_policy(job: RLJob) -> dict[str, Any] | None:
    """The environment pods (tools, the user's environments, the python sandbox) reach only the job's own pods and
    the cluster's DNS, unless spec.roles.environment.egress opens the rest; None for a job without them or with
    egress open."""
    environment = job.spec.roles.environment
    if environment is None or environment.egress:
        return None
    dns = [{"protocol": protocol, "port": 53} for protocol in ("UDP", "TCP")]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(job, f"{job.metadata.name}-env-egress"),
        "spec": {
            "podSelector": {"matchLabels": names.selector(job, "env")},
            "policyTypes": ["Egress"],
            "egress": [
                {"to": [{"podSelector": {"matchLabels": names.selector(job)}}]},
                {"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
                 "ports": dns},
            ],
        },
    }


def build_controller_access(job: RLJob) -> list[dict[str, Any]]:
    """For a job whose controller is an executor of its own (spec.roles.controller): a ServiceAccount for its pods,
    the only pods of a job that call the Kubernetes API, the job's Lease that they elect their leader by
    (controller/lease.py), made here so that it is the job's and goes with it, and a Role bound to the account that
    lets them read and update that one Lease only. None otherwise."""
    if job.spec.roles.controller is None:
        return []
    name, leases = names.controller_name(job), {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}
    return [
        # Pods opt in to the token (the controllers' template does); any other pod given this account gets none.
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": names.metadata(job, name),
         "automountServiceAccountToken": False},
        # No holder: the first controller to update it leads (created once; apply.CREATE_ONLY).
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": names.metadata(job, name), "spec": {}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": names.metadata(job, name),
         "rules": [leases | {"resourceNames": [name], "verbs": ["get", "update"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": names.metadata(job, name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.metadata.namespace}]},
    ]


def _port(name: str, port: int) -> dict[str, Any]:
    return {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
