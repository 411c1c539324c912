"""spec.storage and the per-role NCCL settings as pods get them: volumes mounted where the job reads its files,
URIs fetched by an init container into the cache, checkpoints on a claim, extra env, resources, host network."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_full_job, make_job
from rlfleet.operator.workload import CACHE_DIR, RUN_DIR, build_statefulset
from rlfleet.workers.plan import ROLES
from rlfleet.workers.spec import load_job, parse_job
from rlfleet.workers.storage import uris
from rlfleet.workers.storage.config import POD_PATHS
from rlfleet.workers.storage.fetch import uris_for

GPU_EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "gpu-llama-8b.yaml"
VOLUMES = [
    {"name": "models", "claim": "weights", "mountPath": "/models", "roles": ["generator", "trainer"]},
    {"name": "data", "nfs": {"server": "nfs.internal", "path": "/export/data"}, "mountPath": "/data",
     "roles": ["trainer"]},
    {"name": "scratch", "hostPath": "/mnt/scratch", "mountPath": "/scratch", "readOnly": False},
]


def pod(job, role: str) -> dict:
    return build_statefulset(job, role)["spec"]["template"]["spec"]


def mounts(job, role: str) -> dict[str, dict]:
    (container,) = pod(job, role)["containers"]
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def volumes(job, role: str) -> dict[str, dict]:
    return {v["name"]: v for v in pod(job, role)["volumes"]}


def env(job, role: str) -> dict[str, dict]:
    (container,) = pod(job, role)["containers"]
    return {e["name"]: e for e in container["env"]}


@pytest.mark.parametrize("role", ROLES)
def test_each_volume_is_mounted_into_the_roles_it_names_and_no_others(role):
    job = make_full_job(storage={"volumes": VOLUMES})
    seen = mounts(job, role)
    for volume in VOLUMES:
        wanted = role in volume.get("roles", ROLES)
        assert (volume["mountPath"] in seen) == wanted, (role, volume["name"])
        if wanted:
            mount = seen[volume["mountPath"]]
            assert mount["readOnly"] is volume.get("readOnly", True)
            assert mount["name"] in volumes(job, role)
    if role == "trainer":
        pods = volumes(job, role)
        assert pods["data-models"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
        assert pods["data-data"]["nfs"] == {"server": "nfs.internal", "path": "/export/data", "readOnly": True}
        assert pods["data-scratch"]["hostPath"] == {"path": "/mnt/scratch", "type": "Directory"}


def test_the_pods_own_mounts_are_the_paths_a_volume_may_not_hide():
    """storage.config.POD_PATHS is what the spec keeps job volumes off: it must be every path the pods mount."""
    for role in ROLES:
        assert set(mounts(make_full_job(), role)) == set(POD_PATHS), role


def test_a_uri_is_fetched_by_an_init_container_of_the_roles_that_read_it():
    job = make_job(model={"type": "hf", "uri": "s3://models-bucket/llama"},
                   data={"type": "jsonl", "uri": "hf://datasets/org/gsm8k@v2/train.jsonl"},
                   storage={"credentialsSecret": "s3-keys"})
    assert uris_for(job, "generator") == ["s3://models-bucket/llama"]
    assert uris_for(job, "trainer") == ["s3://models-bucket/llama", "hf://datasets/org/gsm8k@v2/train.jsonl"]
    assert "initContainers" not in pod(job, "scorer")
    for role in ("generator", "trainer"):
        (init,) = pod(job, role)["initContainers"]
        (worker,) = pod(job, role)["containers"]
        assert init["command"][:2] == ["rlfleet", "fetch"] and init["command"][-2:] == ["--role", role]
        assert init["image"] == worker["image"] and init["securityContext"] == worker["securityContext"]
        # Into the volume the worker reads its cache from, with the fetcher's credentials only.
        cache = next(m for m in init["volumeMounts"] if m["mountPath"] == CACHE_DIR)
        assert cache["name"] == next(m for m in worker["volumeMounts"] if m["mountPath"] == CACHE_DIR)["name"]
        assert init["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]
        assert "envFrom" not in worker


def test_a_cache_claim_is_shared_by_every_pod_and_unset_each_pod_has_its_own():
    for role in ROLES:
        assert volumes(make_full_job(), role)["cache"] == {"name": "cache", "emptyDir": {}}
        shared = volumes(make_full_job(storage={"cacheClaim": "rl-cache"}), role)["cache"]
        assert shared["persistentVolumeClaim"] == {"claimName": "rl-cache"}


def test_checkpoints_on_a_claim_go_to_one_folder_per_trainer_pod():
    own = build_statefulset(make_job(), "trainer")
    assert [t["metadata"]["name"] for t in own["spec"]["volumeClaimTemplates"]] == ["run"]
    job = make_job(storage={"checkpointClaim": "rl-checkpoints"})
    shared = build_statefulset(job, "trainer")
    assert "volumeClaimTemplates" not in shared["spec"]
    assert volumes(job, "trainer")["run"]["persistentVolumeClaim"] == {"claimName": "rl-checkpoints"}
    run = mounts(job, "trainer")[RUN_DIR]
    assert run["subPathExpr"] == "$(POD_NAME)"
    assert env(job, "trainer")["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "subPathExpr" not in mounts(job, "generator")[RUN_DIR]


def test_nccl_settings_reach_the_pods_of_their_role():
    job = make_job(roles={"trainer": {"env": {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "INFO"}, "hostNetwork": True,
                                      "resources": {"gpu": 8, "extra": {"rdma/hca": "1"}}}})
    assert env(job, "trainer")["NCCL_IB_HCA"] == {"name": "NCCL_IB_HCA", "value": "mlx5"}
    assert "NCCL_IB_HCA" not in env(job, "generator")
    trainer = pod(job, "trainer")
    assert trainer["hostNetwork"] is True and trainer["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostNetwork" not in pod(job, "generator")
    # Fixed ports on the node's network: at most one pod of the role per node.
    (term,) = trainer["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["rlfleet.io/role"] == "trainer"
    assert "affinity" not in pod(job, "generator")
    (container,) = trainer["containers"]
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["rdma/hca"] == "1"
        assert container["resources"][kind]["nvidia.com/gpu"] == "8"


def test_gpu_pods_get_host_memory_for_their_gpus_unless_set():
    job = make_full_job(roles={"trainer": {"resources": {"gpu": 8}}, "reference": {"resources": {"gpu": 1}},
                               "generator": {"resources": {"gpu": 2, "memory": "100Gi"}}, "critic": {"resources": {"gpu": 1}}})
    memory = {role: pod(job, role)["containers"][0]["resources"]["limits"]["memory"] for role in ROLES}
    assert memory == {"trainer": "256Gi", "generator": "100Gi", "scorer": "4Gi", "reference": "32Gi", "reward": "4Gi",
                      "critic": "32Gi", "env": "4Gi", "control": "4Gi"}


def test_the_gpu_example_reads_its_model_and_data_from_volumes_its_pods_mount():
    job = load_job(str(GPU_EXAMPLE))
    for role, path in (("generator", job.spec.model.path), ("trainer", job.spec.model.path),
                       ("trainer", job.spec.data.path)):
        assert any(path.startswith(mount.rstrip("/") + "/") for mount in mounts(job, role)), (role, path)
    resources = pod(job, "trainer")["containers"][0]["resources"]["limits"]
    assert resources["rdma/hca"] == "1" and resources["nvidia.com/gpu"] == "8"
    assert job.spec.roles.trainer.world_size == 32 and job.spec.roles.generator.tensor_parallel_size == 8


@pytest.mark.parametrize("uri, location", [
    ("s3://bucket-1/models/llama/", uris.Location("s3", "bucket-1", "models/llama/")),
    ("s3://bucket-1", uris.Location("s3", "bucket-1", "")),
    ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", uris.Location("hf", "HuggingFaceTB/SmolLM2-135M-Instruct")),
    ("hf://org/model@refs-pr-1", uris.Location("hf", "org/model", "", "refs-pr-1")),
    ("hf://datasets/openai/gsm8k@main/main/train.jsonl",
     uris.Location("hf", "openai/gsm8k", "main/train.jsonl", "main", "dataset")),
])
def test_uris_parse_into_where_they_point(uri, location):
    assert uris.parse(uri) == location


@pytest.mark.parametrize("uri", ["gs://bucket/x", "s3://", "s3://UPPER/x", "hf://only-one-part", "/models/x"])
def test_other_uris_are_refused_with_the_grammar(uri):
    with pytest.raises(ValueError, match="s3://BUCKET/KEY or hf://"):
        uris.parse(uri)


def test_a_data_uri_must_name_a_file_and_a_model_uri_a_tree():
    with pytest.raises(ValueError, match="names no file"):
        uris.check_file("s3://bucket-1/data/")
    with pytest.raises(ValueError, match="whole repository"):
        uris.check_tree("hf://org/model/config.json")
    parse_job({"metadata": {"name": "ok"}, "spec": {"model": {"type": "hf", "uri": "s3://bucket-1/prefix"}}})
