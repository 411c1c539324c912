"""Pure builders: every object validates against Kubernetes 1.30 and 1.35 and carries what workers need."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from conftest import make_full_job, make_job
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator import names
from rlfleet.operator.objects import (
    build_egress_policy,
    build_configmap,
    build_network_policy,
    build_service,
    build_token_secret,
    config_hash,
    secret_token,
)
from rlfleet.operator.render import build_all
from rlfleet.operator.workload import build_statefulset, container_env, planned_command
from rlfleet.workers.plan import GRPC_PORT, METRICS_PORT, ROLES, cluster_endpoints, pod_host, worker_env
from rlfleet.workers.spec import load_job, parse_job

KUBERNETES = ("1.30.0", "1.35.0")
EXAMPLES = sorted(Path(__file__).resolve().parents[2].glob("manifests/examples/*.yaml"))
GPU_JOB = {
    "roles": {
        "trainer": {"replicas": 2, "resources": {"gpu": 8, "cpu": "32", "memory": "512Gi"},
                    "nodeSelector": {"nvidia.com/gpu.product": "H100"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "generator": {"replicas": 4, "resources": {"gpu": 1}},
    },
}


def jobs():
    yield "default", make_job()
    yield "gpu", make_job(**GPU_JOB)
    yield "suspended", make_job(suspend=True)
    yield "every-executor-on-gpus", make_full_job(roles={**GPU_JOB["roles"], "reference": {"resources": {"gpu": 1}},
                                                         "rewardModel": {"path": "/m", "resources": {"gpu": 1}}})
    yield "storage-and-nccl", make_job(
        roles={"trainer": {"hostNetwork": True, "env": {"NCCL_DEBUG": "INFO"}, "resources": {"extra": {"rdma/hca": "1"}}}},
        model={"type": "hf", "uri": "s3://models-bucket/llama"}, data={"type": "jsonl", "uri": "s3://data-bucket/d.jsonl"},
        storage={"volumes": [{"name": "scratch", "nfs": {"server": "nfs", "path": "/x"}, "mountPath": "/scratch"}],
                 "cacheClaim": "cache", "checkpointClaim": "checkpoints", "credentialsSecret": "keys"})
    for path in EXAMPLES:
        yield path.stem, load_job(str(path))


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("name,job", list(jobs()), ids=[n for n, _ in jobs()])
def test_every_object_validates_strictly(name, job, version):
    config = OperatorConfig(storage_class="fast-ssd")
    for obj in build_all(job, config):
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_an_unknown_field():
    sts = build_statefulset(make_job(), "trainer")
    sts["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, "1.35.0", strict=True)


def test_statefulset_runs_the_planned_command_with_gpus_and_placement():
    job = make_job(**GPU_JOB)
    sts = build_statefulset(job, "trainer")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["replicas"] == 2
    assert container["command"] == ["rlfleet", "worker", "trainer"] == planned_command(job, "trainer")
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nvidia.com/gpu" not in build_statefulset(job, "scorer")["spec"]["template"]["spec"]["containers"][0][
        "resources"]["requests"]


def test_pods_are_hardened_and_write_only_to_their_volumes():
    sts = build_statefulset(make_job(), "generator", OperatorConfig(shm_size="8Gi"))
    pod = sts["spec"]["template"]["spec"]
    security = pod["containers"][0]["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    assert security == {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/dev/shm"]["name"] == "shm" and mounts["/etc/rlfleet"]["readOnly"] is True
    read_only = {"/etc/rlfleet", "/var/run/secrets/rlfleet"}
    assert all(m["readOnly"] is True for path, m in mounts.items() if path in read_only)
    assert all(m.get("readOnly") is not True for path, m in mounts.items() if path not in read_only)


@pytest.mark.parametrize("role", ROLES)
def test_every_pod_mounts_the_jobs_token_secret_read_only(role):
    job = make_full_job()
    pod = build_statefulset(job, role)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["token"]["secret"] == {"secretName": "t-token", "defaultMode": 0o440,
                                          "items": [{"key": "token", "path": "token"}]}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "token"]
    assert mount == {"name": "token", "mountPath": "/var/run/secrets/rlfleet", "readOnly": True}
    env = {e["name"]: e for e in container_env(job, role)}
    assert env["RLFLEET_TOKEN_FILE"] == {"name": "RLFLEET_TOKEN_FILE", "value": "/var/run/secrets/rlfleet/token"}


def test_token_secret_holds_the_token_and_is_immutable():
    secret = build_token_secret(make_job(), "s3cret-token")
    assert (secret["kind"], secret["metadata"]["name"], secret["immutable"]) == ("Secret", "t-token", True)
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret-token"
    assert secret_token(secret) == "s3cret-token" and secret_token({"data": {}}) is None
    # build_all makes a new random token each time: only the first one is ever created (apply.CREATE_ONLY).
    first, second = (next(o for o in build_all(make_job()) if o["kind"] == "Secret") for _ in range(2))
    assert secret_token(first) != secret_token(second) and len(secret_token(first)) >= 32
    # The pods do not depend on the token: a new one never rolls them.
    assert [o for o in build_all(make_job(), token="a" * 43) if o["kind"] == "StatefulSet"] == \
        [o for o in build_all(make_job(), token="b" * 43) if o["kind"] == "StatefulSet"]


def test_trainer_keeps_its_run_dir_on_a_volume_claim_that_survives_scale_down():
    sts = build_statefulset(make_job(), "trainer", OperatorConfig(trainer_storage="50Gi", storage_class="ssd"))
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "run"
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["storageClassName"] == "ssd"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    assert "run" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}


def test_probes_use_grpc_health_where_the_server_starts_with_the_process():
    for role in ("generator", "scorer"):
        container = build_statefulset(make_job(), role)["spec"]["template"]["spec"]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": GRPC_PORT}
    trainer = build_statefulset(make_job(), "trainer")["spec"]["template"]["spec"]["containers"][0]
    assert "livenessProbe" not in trainer


@pytest.mark.parametrize("role", ROLES)
def test_environment_is_the_planners(role):
    job = make_full_job(**GPU_JOB)
    env = {e["name"]: e for e in container_env(job, role)}
    planned = worker_env(job, role, cluster_endpoints(job), "/etc/rlfleet/job.json", "/var/lib/rlfleet/run",
                         "/var/run/secrets/rlfleet/token")
    for key, value in planned.items():
        if key == "RLFLEET_ENDPOINTS":
            assert env[key]["valueFrom"]["configMapKeyRef"] == {"name": "t-config", "key": "endpoints.json"}
        else:
            assert env[key]["value"] == value
    assert env["RLFLEET_LOG_JSON"]["value"] == "1"
    assert "RLFLEET_RANK" not in env  # a pod's rank is its StatefulSet ordinal (HOSTNAME)


def test_cpu_pods_that_run_a_model_have_as_many_torch_threads_as_their_cpu_request():
    job = make_job(roles={"generator": {"resources": {"gpu": 1}}, "trainer": {"resources": {"cpu": "1500m"}},
                          "reference": {"env": {"OMP_NUM_THREADS": "3"}}})
    threads = {role: {e["name"]: e for e in container_env(job, role)}.get("OMP_NUM_THREADS")
               for role in ("scorer", "generator", "trainer", "reference")}
    from_request = {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}  # rounded up: 2 threads
    assert threads == {"scorer": None, "generator": None, "trainer": {"name": "OMP_NUM_THREADS",
                                                                      "valueFrom": from_request},
                       "reference": {"name": "OMP_NUM_THREADS", "value": "3"}}


def test_configmap_holds_the_resolved_job_and_the_endpoints():
    job = make_job(**GPU_JOB)
    data = build_configmap(job)["data"]
    assert parse_job(json.loads(data["job.json"])) == job
    assert json.loads(data["endpoints.json"]) == json.loads(cluster_endpoints(job).to_json())


def test_headless_service_gives_pods_the_planners_dns_names():
    job = make_full_job()
    for role in ROLES:
        service, sts = build_service(job, role), build_statefulset(job, role)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert sts["spec"]["serviceName"] == service["metadata"]["name"]
        assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        host = f"{sts['metadata']['name']}-0.{service['metadata']['name']}.{job.metadata.namespace}.svc"
        assert host == pod_host(job, role, 0)


def test_network_policy_admits_the_job_the_scrapers_and_the_operator():
    policy = build_network_policy(make_job(), OperatorConfig(operator_namespace="ops"))["spec"]
    assert policy["podSelector"] == {"matchLabels": {"rlfleet.io/job": "t"}}
    own, metrics, operator = policy["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"rlfleet.io/job": "t"}}}]}
    assert metrics == {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]}
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ops"}
    assert operator["ports"] == [{"protocol": "TCP", "port": GRPC_PORT}]


def test_scaling_generators_changes_only_the_generator_statefulset():
    before, after = make_job(), make_job(roles={"generator": {"replicas": 5}})
    for role in ("trainer", "scorer"):
        assert build_statefulset(before, role) == build_statefulset(after, role)
    assert build_statefulset(after, "generator")["spec"]["replicas"] == 5
    assert build_configmap(before) != build_configmap(after)  # endpoints list the new generators


def test_any_other_change_rolls_every_role():
    before, after = make_job(), make_job(algorithm={"learningRate": 0.001})
    assert config_hash(before) != config_hash(after)
    assert config_hash(before) == config_hash(make_job(suspend=True, failurePolicy={"maxRestarts": 9}))


def test_suspend_and_overrides_scale_every_role():
    assert {build_statefulset(make_full_job(suspend=True), r)["spec"]["replicas"] for r in ROLES} == {0}
    assert build_statefulset(make_job(), "trainer", replicas=0)["spec"]["replicas"] == 0


def test_config_from_environment():
    config = OperatorConfig.from_env({"RLFLEET_IMAGE": "r/x:1", "RLFLEET_SHM_SIZE": "1Gi"})
    assert (config.image, config.shm_size, config.trainer_storage) == ("r/x:1", "1Gi", "10Gi")


def test_rendered_yaml_round_trips():
    from rlfleet.operator.render import to_yaml

    objects = build_all(make_job())
    assert list(yaml.safe_load_all(to_yaml(objects))) == objects
    assert [o["kind"] for o in objects] == ["ConfigMap", "Secret"] + ["Service"] * 3 + ["StatefulSet"] * 3 + [
        "NetworkPolicy"]


def test_template_hash_changes_exactly_when_the_pod_would():
    from rlfleet.operator.workload import template_hash

    base = build_statefulset(make_job(), "trainer")
    assert template_hash(base) == template_hash(build_statefulset(make_job(roles={"generator": {"replicas": 3}}),
                                                                  "trainer"))
    assert template_hash(base) != template_hash(build_statefulset(make_job(algorithm={"learningRate": 0.1}),
                                                                  "trainer"))
    assert template_hash(base) != template_hash(build_statefulset(make_job(), "trainer", OperatorConfig(image="x:2")))
    # The API server stores "0.5" CPU as "500m": the annotation, not the stored template, is compared.
    stored = build_statefulset(make_job(roles={"trainer": {"resources": {"cpu": "0.5"}}}), "trainer")
    stored["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "500m"
    assert template_hash(stored) == template_hash(build_statefulset(
        make_job(roles={"trainer": {"resources": {"cpu": "0.5"}}}), "trainer"))


def test_affinity_from_the_spec_reaches_the_pods():
    from rlfleet.operator.workload import build_statefulset
    from rlfleet.workers.spec import parse_job

    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu-type", "operator": "In", "values": ["h100"]}]}]}}}
    job = parse_job({"metadata": {"name": "a"}, "spec": {"roles": {"generator": {"affinity": affinity}}}})
    pod = build_statefulset(job, "generator")["spec"]["template"]["spec"]
    assert pod["affinity"] == affinity
    assert "affinity" not in build_statefulset(job, "trainer")["spec"]["template"]["spec"]


def test_environment_pods_reach_only_the_jobs_pods_and_dns_unless_egress_is_opened():
    closed = build_egress_policy(make_job(roles={"environment": {"type": "tools"}}))
    assert closed["spec"]["podSelector"]["matchLabels"][names.ROLE_LABEL] == "env"
    assert closed["spec"]["policyTypes"] == ["Egress"]
    own, dns = closed["spec"]["egress"]
    assert own == {"to": [{"podSelector": {"matchLabels": names.selector(make_job())}}]}
    assert {p["port"] for p in dns["ports"]} == {53}
    assert build_egress_policy(make_job(roles={"environment": {"type": "tools", "egress": True}})) is None
    assert build_egress_policy(make_job()) is None
    rendered = [o["metadata"]["name"] for o in build_all(make_job(roles={"environment": {"type": "tools"}}))
                if o["kind"] == "NetworkPolicy"]
    assert rendered == ["t", "t-env-egress"]


def test_generators_name_the_http_port_their_openai_endpoint_serves_agents_on():
    job = make_job()
    service = {p["name"]: p["port"] for p in build_service(job, "generator")["spec"]["ports"]}
    container = build_statefulset(job, "generator")["spec"]["template"]["spec"]["containers"][0]
    assert service["http"] == 8000 and {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    assert "http" not in {p["name"] for p in build_service(job, "trainer")["spec"]["ports"]}
