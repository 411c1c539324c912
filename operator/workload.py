"""Pure builder of a role's StatefulSet: the planner's command and environment, wrapped in a hardened pod."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlfleet.operator import names
from rlfleet.operator.compat import GRPC_PROBES, PVC_RETENTION, Server
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.objects import ENDPOINTS_KEY, JOB_FILE, TOKEN_KEY, config_hash, service_ports
from rlfleet.operator.scaled import REPLICAS_ANNOTATION
from rlfleet.workers.controller.lease import LEASE_ENV
from rlfleet.workers.cores import computes_on_cpu
from rlfleet.workers.executors import BY_ROLE
from rlfleet.workers.generator.pools import Pool, as_pool, generator_pools
from rlfleet.workers.plan import (ENDPOINTS_FILE, GRPC_PORT, METRICS_PORT, POOL_ENV, ROLES, cluster_endpoints,
                                  job_roles, plan_workers, ranks_per_pod, role_spec, worker_env)
from rlfleet.workers.roles import GPU_RESOURCE
from rlfleet.workers.spec import RLJob
from rlfleet.workers.storage.config import Volume
from rlfleet.workers.storage.fetch import uris_for

CONFIG_DIR = "/etc/rlfleet"
RUN_DIR = "/var/lib/rlfleet/run"
# The controllers' shared folder on spec.storage.checkpointClaim (the other pods' folders are named as the pods).
CONTROL_FOLDER = "control"
CACHE_DIR = "/var/cache/rlfleet"
TMP_DIR = "/tmp"
# The job's gRPC token, from its Secret: outside the run volume, so it never lands in checkpoints or copies.
TOKEN_DIR = "/var/run/secrets/rlfleet"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
# Owned by root, readable by the pod's group (fsGroup) only.
TOKEN_MODE = 0o440
USER_ID = 1000
# Roles whose gRPC server (with grpc.health.v1) starts with the process: all but the trainers. Trainer ranks > 0
# serve no gRPC and rank 0 serves only once the generators are up, so a probe would mark healthy trainers dead.
PROBED_ROLES = tuple(role for role in ROLES if role != "trainer")
# Probed on their metrics port instead: a standby serves its metrics from the start but gRPC only once it leads; never
# ready, it would hold the job Pending (Running needs every pod ready), and its startup probe would restart it.
METRICS_PROBED_ROLES = ("control",)
# Loading a large model into vLLM can take minutes; liveness starts only after this window.
STARTUP_SECONDS = 900
# A probe is one health call: a started worker is seen within 2 s and ready within 5 s more (a pod's restart is on
# the critical path of every recovery). Six missed readiness probes (30 s) mark a busy worker unready.
STARTUP_PROBE_SECONDS = 2
READY_PROBE_SECONDS = 5
LIVENESS_PROBE_SECONDS = 20
# The fetch init container streams files to disk; boto3 and the Hub client buffer little.
FETCH_MEMORY = "1Gi"


def role_sets(job: RLJob, role: str) -> list[Pool | None]:
    """The StatefulSets of a role, by the generator pool each runs (None: the role's one, for any other role)."""
    return list(generator_pools(job.spec)) if role == "generator" else [None]


def set_replicas(job: RLJob, role: str, pool: Pool | None) -> int:
    """The pods a StatefulSet of the role has when the job runs: its pool's, else the role's."""
    if job.spec.suspend:
        return 0
    return pool.count if pool is not None else role_spec(job, role).replicas


def build_statefulset(job: RLJob, role: str, config: OperatorConfig | None = None,
                      replicas: int | None = None, server: Server | None = None,
                      pool: Pool | None = None) -> dict[str, Any]:
    """One StatefulSet per role, a generator's per pool; pod <job>-<role>-<rank> learns its rank from its host name
    (a named pool's pod <job>-generator-<pool>-<ordinal> counts from its pool's first replica)."""
    config = config or OperatorConfig()
    server = server or Server()
    if replicas is None:
        replicas = set_replicas(job, role, pool)
    pool_name = pool.name if pool is not None else ""
    spec: dict[str, Any] = {
        "serviceName": names.role_name(job, role, pool_name),
        "replicas": replicas,
        # Ranks start together: a rank waits for its peers at rendezvous, not for the previous pod's readiness.
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": names.selector(job, role, pool_name)},
        "template": pod_template(job, role, config, server, pool),
    }
    if role == "trainer":
        # A rolling update would restart ranks one by one and break their collectives (each break would
        # count as a failure): the operator restarts all ranks at once when the template changes.
        spec["updateStrategy"] = {"type": "OnDelete"}
    if BY_ROLE[role].keeps_state and not job.spec.storage.checkpoint_claim:
        spec["volumeClaimTemplates"] = [_run_volume_claim(config)]
        if server.has(PVC_RETENTION):
            # Suspend scales to zero and must keep the checkpoints; deleting the job deletes them too.
            spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        # The count written with it: one that differs was scaled by someone else (scaled.py).
        "metadata": names.metadata(job, names.role_name(job, role, pool_name), role, pool_name)
        | {"annotations": {REPLICAS_ANNOTATION: str(replicas)}},
        "spec": spec,
    }


def _profile(localhost: str | None) -> dict[str, str]:
    """A seccomp or AppArmor profile: the node's own (an environment's sandbox needs namespaces), else the runtime's
    default; the restricted Pod Security profile admits both."""
    return {"type": "Localhost", "localhostProfile": localhost} if localhost else {"type": "RuntimeDefault"}


def pod_template(job: RLJob, role: str, config: OperatorConfig, server: Server,
                 pool: Pool | None = None) -> dict[str, Any]:
    """The pods of a role (a generator pool's: its resources, placement and tensor parallelism)."""
    hashed, pool_name = config_hash(job), pool.name if pool is not None else ""
    if pool is not None:
        job = as_pool(job, pool)
    own = role_spec(job, role)
    pod: dict[str, Any] = {
        # Workers but the controllers never call the Kubernetes API; the token would only be something to steal.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "runAsGroup": USER_ID,
            "fsGroup": USER_ID,
            "seccompProfile": _profile(getattr(own, "seccomp_profile", None)),
        },
        "containers": [container(job, role, config, server, pool_name)],
        "volumes": _volumes(job, role, config),
    }
    if role == "control":
        # The one pod of a job that calls the Kubernetes API: its leader election's Lease, as its own account.
        pod |= {"serviceAccountName": names.controller_name(job), "automountServiceAccountToken": True}
    if getattr(own, "app_armor_profile", None):
        pod["securityContext"]["appArmorProfile"] = _profile(own.app_armor_profile)
    if own.node_selector:
        pod["nodeSelector"] = dict(own.node_selector)
    if own.tolerations:
        pod["tolerations"] = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in own.tolerations]
    if own.affinity:
        pod["affinity"] = dict(own.affinity)
    if own.host_network:
        # On the host's network the pod still resolves its peers' Service names.
        pod |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
        pod.setdefault("affinity", {}).setdefault("podAntiAffinity", _one_per_node(job, role, pool_name))
    if uris_for(job, role):
        pod["initContainers"] = [fetch_container(job, role, config)]
    template = {
        "metadata": {
            "labels": names.labels(job, role, pool_name),
            "annotations": {names.CONFIG_HASH_ANNOTATION: hashed},
        },
        "spec": pod,
    }
    # Of the template as built, not as stored: the API server rewrites quantities ("0.5" -> "500m").
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]
    template["metadata"]["annotations"][names.TEMPLATE_HASH_ANNOTATION] = digest
    return template


def _one_per_node(job: RLJob, role: str, pool: str) -> dict[str, Any]:
    """Pods on their node's network listen on the node's ports: two of a role on one node would collide."""
    same_role = {"labelSelector": {"matchLabels": names.selector(job, role, pool)},
                 "topologyKey": "kubernetes.io/hostname"}
    return {"requiredDuringSchedulingIgnoredDuringExecution": [same_role]}


def template_hash(statefulset: dict[str, Any]) -> str | None:
    """The template's hash annotation: it changes exactly when the operator builds a different pod."""
    template = (statefulset.get("spec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(names.TEMPLATE_HASH_ANNOTATION)


def container(job: RLJob, role: str, config: OperatorConfig, server: Server, pool: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": role,
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": planned_command(job, role),
        "env": container_env(job, role, pool),
        "ports": [{"name": p["name"], "containerPort": p["port"], "protocol": "TCP"} for p in service_ports(role)],
        "resources": _resources(job, role),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
            _run_mount(job, role),
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": TMP_DIR},
            {"name": "shm", "mountPath": "/dev/shm"},
            *_storage_mounts(job, role),
        ],
    }
    if role in PROBED_ROLES:
        spec |= _probes(server, role)
    return spec


def fetch_container(job: RLJob, role: str, config: OperatorConfig) -> dict[str, Any]:
    """Fetches the role's model.uri / data.uri into the cache volume before the worker starts: once per pod, or
    once for all pods when the cache is a shared claim (the worker then finds it there)."""
    worker = container(job, role, config, Server())
    spec = {key: worker[key] for key in ("image", "imagePullPolicy", "securityContext")} | {
        "name": "fetch",
        "command": ["rlfleet", "fetch", f"{CONFIG_DIR}/{JOB_FILE}", "--role", role],
        "env": [{"name": "RLFLEET_CACHE", "value": CACHE_DIR}, {"name": "HOME", "value": TMP_DIR}],
        "resources": {"requests": {"cpu": "1", "memory": FETCH_MEMORY}, "limits": {"memory": FETCH_MEMORY}},
        "volumeMounts": [m for m in worker["volumeMounts"] if m["name"] in ("config", "cache", "tmp")],
    }
    if job.spec.storage.credentials_secret:
        spec["envFrom"] = [{"secretRef": {"name": job.spec.storage.credentials_secret}}]
    return spec


def planned_command(job: RLJob, role: str) -> list[str]:
    """The command `rlfleet run` starts for this role, taken from the planner so both runtimes agree."""
    workers = plan_workers(job, cluster_endpoints(job), f"{CONFIG_DIR}/{JOB_FILE}", RUN_DIR, TOKEN_FILE,
                           ports=lambda _role, _rank: {"grpc": GRPC_PORT, "metrics": METRICS_PORT})
    return next(w.command for w in workers if w.role == role)


def container_env(job: RLJob, role: str, pool: str = "") -> list[dict[str, Any]]:
    planned = worker_env(job, role, cluster_endpoints(job), f"{CONFIG_DIR}/{JOB_FILE}", RUN_DIR, TOKEN_FILE)
    planned.pop("RLFLEET_ENDPOINTS")
    if pool:
        planned[POOL_ENV] = pool
    env = planned | {
        "RLFLEET_LOG_JSON": "1",
        "RLFLEET_CACHE": CACHE_DIR,
        # The root filesystem is read-only: every library that caches under $HOME writes to the tmp volume.
        "HOME": TMP_DIR,
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    listed = [{"name": key, "value": value} for key, value in sorted(env.items())]
    endpoints = {"configMapKeyRef": {"name": names.configmap_name(job), "key": ENDPOINTS_KEY}}
    listed.append({"name": "RLFLEET_ENDPOINTS", "valueFrom": endpoints})
    if role == "control":
        listed.append({"name": LEASE_ENV, "value": names.controller_name(job)})
    if role == "control" or (BY_ROLE[role].keeps_state and job.spec.storage.checkpoint_claim):
        # The run folder's name on a shared claim; a controller's identity in its Lease.
        listed.append({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    if _threads_from_request(job, role) and "OMP_NUM_THREADS" not in env:
        # torch starts a thread per core of the node, not of the pod: on a shared node, teams that outnumber the
        # cores stall each other (BENCHMARKS.md, Time to accuracy). Kubernetes rounds the request up to whole cores.
        listed.append({"name": "OMP_NUM_THREADS",
                       "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}})
    return listed


def _threads_from_request(job: RLJob, role: str) -> bool:
    """A CPU pod of one process that runs a model: its torch threads are its CPU request."""
    return computes_on_cpu(job, role) and ranks_per_pod(job, role) == 1


def _resources(job: RLJob, role: str) -> dict[str, Any]:
    wanted = role_spec(job, role).resources
    requests = {"cpu": wanted.cpu, "memory": wanted.memory_or_default}
    # No CPU limit: throttling a trainer step stalls every peer waiting on its collectives.
    limits = {"memory": wanted.memory_or_default}
    if wanted.gpu:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(wanted.gpu)
    for name, quantity in wanted.extra.items():
        requests[name] = limits[name] = quantity
    return {"requests": requests, "limits": limits}


def _probes(server: Server, role: str) -> dict[str, Any]:
    # Workers mark gRPC health SERVING as their server starts, so a TCP probe on that port is the same signal.
    check = {"grpc": {"port": GRPC_PORT}} if server.has(GRPC_PROBES) else {"tcpSocket": {"port": GRPC_PORT}}
    if role in METRICS_PROBED_ROLES:
        check = {"httpGet": {"path": "/metrics", "port": METRICS_PORT}}
    return {
        "startupProbe": check | {"periodSeconds": STARTUP_PROBE_SECONDS,
                                 "failureThreshold": STARTUP_SECONDS // STARTUP_PROBE_SECONDS},
        "readinessProbe": check | {"periodSeconds": READY_PROBE_SECONDS, "failureThreshold": 6},
        "livenessProbe": check | {"periodSeconds": LIVENESS_PROBE_SECONDS, "timeoutSeconds": 5,
                                  "failureThreshold": 6},
    }


def _volumes(job: RLJob, role: str, config: OperatorConfig) -> list[dict[str, Any]]:
    volumes = [
        {"name": "config", "configMap": {"name": names.configmap_name(job),
                                         "items": [{"key": JOB_FILE, "path": JOB_FILE},
                                                   {"key": ENDPOINTS_KEY, "path": ENDPOINTS_FILE}]}},
        {"name": "token", "secret": {"secretName": names.token_secret_name(job), "defaultMode": TOKEN_MODE,
                                     "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]}},
        _cache_volume(job),
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
    ]
    if not BY_ROLE[role].keeps_state:
        # Only trainer rank 0 and the critic write lasting state (checkpoints); the others' run dirs are scratch.
        volumes.insert(1, {"name": "run", "emptyDir": {}})
    elif job.spec.storage.checkpoint_claim:
        volumes.insert(1, {"name": "run", "persistentVolumeClaim": {"claimName": job.spec.storage.checkpoint_claim}})
    return volumes + [_storage_volume(volume) for volume in job.spec.storage.volumes if role in volume.roles]


def _cache_volume(job: RLJob) -> dict[str, Any]:
    if job.spec.storage.cache_claim:
        return {"name": "cache", "persistentVolumeClaim": {"claimName": job.spec.storage.cache_claim}}
    return {"name": "cache", "emptyDir": {}}


def _run_mount(job: RLJob, role: str) -> dict[str, Any]:
    mount = {"name": "run", "mountPath": RUN_DIR}
    if role == "control":
        mount["subPath"] = CONTROL_FOLDER  # one folder for them all: a standby goes on with the leader's files
    elif BY_ROLE[role].keeps_state and job.spec.storage.checkpoint_claim:
        # One folder per pod on the shared claim, named as the pod (the kubelet expands the variable).
        mount["subPathExpr"] = "$(POD_NAME)"
    return mount


def _storage_volume(volume: Volume) -> dict[str, Any]:
    if volume.claim:
        source = {"persistentVolumeClaim": {"claimName": volume.claim, "readOnly": volume.read_only}}
    elif volume.host_path:
        source = {"hostPath": {"path": volume.host_path, "type": "Directory"}}
    else:
        source = {"nfs": {"server": volume.nfs.server, "path": volume.nfs.path, "readOnly": volume.read_only}}
    return {"name": f"data-{volume.name}"} | source


def _storage_mounts(job: RLJob, role: str) -> list[dict[str, Any]]:
    return [{"name": f"data-{volume.name}", "mountPath": volume.mount_path, "readOnly": volume.read_only}
            for volume in job.spec.storage.volumes if role in volume.roles]


def storage_problems(job: RLJob) -> list[str]:
    """What the job's pods would not see: its paths (unmounted_paths), and a run directory that its controllers of
    their own share (the standby goes on with the leader's metrics.jsonl, prompts.jsonl and epoch: one folder on
    spec.storage.checkpointClaim, which every controller pod mounts)."""
    problems = unmounted_paths(job)
    if job.spec.roles.controller and not job.spec.storage.checkpoint_claim:
        problems.append("spec.roles.controller: its pods share one run directory, where the leader keeps the run's "
                        "records and a standby goes on with them: set spec.storage.checkpointClaim to a "
                        "ReadWriteMany claim, or remove spec.roles.controller (the controller then runs in trainer "
                        "rank 0)")
    return problems


def unmounted_paths(job: RLJob) -> list[str]:
    """model.path and data.path where a pod that reads it mounts no volume of spec.storage.volumes holding it (a
    local path such as /tmp/x, a relative one): each a problem naming the field, the role and its mounts. Files in
    the image are not known here: a path must lie on a volume, or be a URI."""
    model, data = job.spec.model, job.spec.data
    wanted = []
    if model.type == "hf" and model.path:
        wanted += [("spec.model.path", model.path, role) for role in job_roles(job) if BY_ROLE[role].reads_model]
    if data.type == "jsonl" and data.path:
        wanted.append(("spec.data.path", data.path, "trainer"))
    problems = []
    for field, path, role in wanted:
        if not job.spec.storage.holds(path, role):
            mounts = [volume.mount_path for volume in job.spec.storage.volumes if role in volume.roles]
            problems.append(f"{field}: {path!r} lies on no volume the {role} pods mount (their spec.storage.volumes: "
                            f"{', '.join(mounts) or 'none'}): put it on a volume mounted for the {role}, or name it "
                            f"by {field.replace('.path', '.uri')}")
    return problems


def _run_volume_claim(config: OperatorConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": config.trainer_storage}},
    }
    if config.storage_class:
        spec["storageClassName"] = config.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "run"}, "spec": spec}
