"""Generator pools (spec.roles.generator.pools): validation, the one numbering of replicas, tensor parallelism sized
from the model and the GPU, and what each runtime makes of them (pods, processes, weight pushes, metrics)."""

from __future__ import annotations

import io
import json
import os

import kubernetes_validate
import pytest
from prometheus_client import generate_latest

from conftest import make_job, write_config
from rlfleet.operator.kueue import build_workload
from rlfleet.operator.objects import config_hash
from rlfleet.operator.render import build_all
from rlfleet.workers.auth import TOKEN_FILE_ENV, ensure_token_file
from rlfleet.workers.cli import main
from rlfleet.workers.cores import assign_cores
from rlfleet.workers.generator.pools import generator_indexes, generator_pools, markdown_pools, pool_of, renumbering
from rlfleet.workers.local import CONFIG_FILE, LocalRun, write_config as write_run_config
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.plan import (POOL_ENV, WorkerContext, cluster_endpoints, local_endpoints, local_ports,
                                  plan_workers)
from rlfleet.workers.spec import SpecError, parse_job
from rlfleet.workers.sync.shards import RolePublishers, SyncSettings

LLAMA_70B = {"type": "hf", "path": "/models/llama", "dtype": "bfloat16", "parametersB": 70.6}
TWO_POOLS = {"pools": [{"name": "big", "replicas": 2, "tensorParallelSize": 1},
                       {"name": "small", "replicas": 3, "tensorParallelSize": 2}]}


def pooled(generator: dict, **spec) -> object:
    return make_job(roles={"generator": generator}, **spec)


@pytest.mark.parametrize("generator, problem", [
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "pool names must differ: a is given twice"),
    ({"replicas": 4, "pools": [{"name": "a", "replicas": 2}]}, "replicas 4 disagrees with the pools' replicas"),
    ({"pools": [{"name": "A_1"}]}, "spec.roles.generator.pools.0.name"),
    ({"pools": [{"name": "a", "replicas": 0}]}, "every pool has replicas 0"),
    ({"pools": [{"name": "a", "tensorParallelSize": 4, "resources": {"gpu": 2}}]},
     "roles.generator.pools[0]: tensorParallelSize 4 needs as many GPUs"),
    ({"pools": [{"name": "a", "gpuType": "nvidia-l4"}]}, "roles.generator.pools[0].tensorParallelSize: the model's "
                                                          "size is not known"),
    ({"pools": [{"name": "a", "nodeSelector": {"bad key!": "x"}}]}, "is not a label key"),
    ({"pools": [{"name": "a", "gpuType": "nvidia-v100"}]}, "spec.roles.generator.pools.0.gpuType"),
])
def test_bad_pools_are_refused_naming_the_field(generator, problem):
    model = {"type": "hf", "path": "/m"}
    with pytest.raises(SpecError) as refused:
        pooled(generator, model=model)
    assert problem in str(refused.value)


def test_pool_names_must_leave_the_pods_names_dns_labels():
    generator = {"pools": [{"name": "abcdefghij"}]}
    assert parse_job({"metadata": {"name": "a" * 31}, "spec": {"roles": {"generator": generator}}})
    with pytest.raises(SpecError, match="metadata.name and pool name 'abcdefghij' together exceed 41 characters"):
        parse_job({"metadata": {"name": "a" * 32}, "spec": {"roles": {"generator": generator}}})


def test_each_pool_numbers_its_replicas_in_its_own_block_and_fields_come_from_the_role():
    job = pooled({"kvCacheMB": 64, "resources": {"cpu": "2"}, "nodeSelector": {"zone": "a"}, "pools": [
        {"name": "big", "replicas": 2, "kvCacheMB": 256}, {"name": "small", "replicas": 3, "nodeSelector": {}}]})
    assert job.spec.roles.generator.replicas == 5
    big, small = generator_pools(job.spec)
    assert (big.first, big.count, small.first, small.count) == (0, 2, 128, 3)
    assert generator_indexes(job.spec) == [0, 1, 128, 129, 130]
    assert (big.role.kv_cache_mb, small.role.kv_cache_mb) == (256, 64)
    assert big.role.resources.cpu == small.role.resources.cpu == "2"
    assert (big.role.node_selector, small.role.node_selector) == ({"zone": "a"}, {})
    assert [pool_of(job.spec, replica).name for replica in (0, 1, 2, 127, 128, 130, 131)] == [
        "big", "big", "big", "big", "small", "small", "small"]  # 2, 127 and 131: pods of a pool scaled down


def test_a_job_without_pools_is_one_pool_of_the_role():
    job = make_job(roles={"generator": {"replicas": 3, "kvCacheMB": 64}})
    [pool] = generator_pools(job.spec)
    assert (pool.name, pool.first, pool.count, pool.role) == ("", 0, 3, job.spec.roles.generator)


@pytest.mark.parametrize("gpu_type, tp", [("nvidia-h200", 2), ("nvidia-h100-80gb", 4), ("nvidia-a100-40gb", 8),
                                          ("nvidia-l40s", 8), ("nvidia-l4", 16)])
def test_tensor_parallelism_is_sized_from_the_model_and_the_gpu(gpu_type, tp):
    # 70.6e9 x 2 bytes = 131.5 GiB: the smallest power of two whose slice is at most half a GPU.
    job = pooled({"pools": [{"name": "p", "gpuType": gpu_type}]}, model=LLAMA_70B)
    [pool] = generator_pools(job.spec)
    assert pool.role.tensor_parallel_size == tp
    assert pool.role.resources.gpu == tp  # a GPU type's pool asks for its replica's GPUs
    assert f"tensorParallelSize {tp}: 70.6B parameters x 2 bytes (bfloat16) = 131.5 GiB" in pool.why
    assert f"at {tp // 2}, {131.5 * 2 / tp:.1f} GiB per GPU would not fit" in pool.why


def test_gpu_type_selects_nodes_by_the_gpu_feature_discovery_label_and_plan_shows_why(capsys, tmp_path):
    job = pooled({"pools": [{"name": "h100", "gpuType": "nvidia-h100-80gb"},
                            {"name": "l4", "gpuType": "nvidia-l4", "nodeSelector": {"pool": "spot"}}]},
                 model=LLAMA_70B)
    h100, l4 = generator_pools(job.spec)
    assert h100.role.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert l4.role.node_selector == {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": "spot"}
    table = markdown_pools(job.spec)
    assert "| h100 | 1 (#0..#0) | NVIDIA-H100-80GB-HBM3 | 4 | 4 |" in table
    assert "| l4 | 1 (#128..#128) | NVIDIA-L4 | 16 | 16 |" in table
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job.to_dict()))
    assert main(["plan", "--job", str(path)]) == 0
    assert capsys.readouterr().out.strip() == table


def test_without_a_gpu_type_a_pool_keeps_the_default_tensor_parallelism():
    job = pooled({"resources": {"gpu": 2}, "pools": [{"name": "a"}, {"name": "b", "resources": {"gpu": 4}}]})
    a, b = generator_pools(job.spec)
    assert (a.role.tensor_parallel_size, b.role.tensor_parallel_size) == (2, 4)


def test_each_replica_gets_the_sync_plan_of_its_pool():
    job = pooled(TWO_POOLS)
    assert [SyncSettings.from_job(job, "generator", replica=r).tp_size for r in generator_indexes(job.spec)] == [
        1, 1, 2, 2, 2]
    assert SyncSettings.from_job(job, "generator", replica=129).address("h", 1, 1).world_size == 1 + 2


class FakePublisher:
    def __init__(self, settings):
        self.settings, self.sent, self.joined = settings, [], []

    def connect(self, replica, host, port, epoch):
        self.joined.append(replica)

    def publish(self, shards, replicas):
        self.sent.append(replicas)
        return 1.0


def test_the_trainer_pushes_each_replica_by_its_pools_plan():
    made = []
    publishers = RolePublishers(pooled(TWO_POOLS), "generator", "", lambda s: made.append(FakePublisher(s)) or made[-1])
    for replica in (0, 129, 130):
        publishers.connect(replica, "h", 1, 1)
    assert publishers.publish({}, [0, 1, 128, 129, 130]) == 2.0  # one pack per plan
    by_tp = {publisher.settings.tp_size: publisher for publisher in made}
    assert sorted(by_tp) == [1, 2]
    assert (by_tp[1].joined, by_tp[1].sent) == ([0], [[0, 1]])
    assert (by_tp[2].joined, by_tp[2].sent) == ([129, 130], [[128, 129, 130]])


def test_cluster_endpoints_list_every_pools_pods_by_index_with_gaps_between_the_blocks():
    job = pooled(TWO_POOLS)
    endpoints = cluster_endpoints(job)
    hosts = [address.rsplit(":", 1)[0] for address in endpoints.of("generator")]
    assert hosts == ["t-generator-big-0.t-generator-big.default.svc", "t-generator-big-1.t-generator-big.default.svc",
                     *[""] * 126, *[f"t-generator-small-{o}.t-generator-small.default.svc" for o in range(3)]]
    stores = endpoints.sync_of("generator")
    assert (stores[1], stores[2], stores[128]) == ("t-trainer-0.t-trainer.default.svc:29601", "",
                                                   "t-trainer-0.t-trainer.default.svc:29728")
    assert [bool(address) for address in endpoints.http_of("generator")] == [bool(host) for host in hosts]


def test_a_pool_pod_counts_its_rank_from_its_pools_first_replica(tmp_path):
    job = pooled(TWO_POOLS)
    environ = {"RLFLEET_JOB_CONFIG": str(write_config(job, tmp_path)), "RLFLEET_ROLE": "generator",
               "RLFLEET_ENDPOINTS": cluster_endpoints(job).to_json(), TOKEN_FILE_ENV: str(ensure_token_file(tmp_path)),
               "HOSTNAME": "t-generator-small-1", POOL_ENV: "small"}
    ctx = WorkerContext.from_environ(environ)
    assert ctx.rank == 129
    assert ctx.job.spec.roles.generator.tensor_parallel_size == 2  # it runs its pool's fields
    assert WorkerContext.from_environ(environ | {"HOSTNAME": "t-generator-big-1", POOL_ENV: "big"}).rank == 1


def test_rendered_pools_are_a_statefulset_and_service_each_and_validate():
    job = pooled({**TWO_POOLS, "pools": [{**TWO_POOLS["pools"][0], "gpuType": "nvidia-h100-80gb"},
                                         {**TWO_POOLS["pools"][1], "resources": {"gpu": 2},
                                          "tolerations": [{"key": "spot", "operator": "Exists"}]}]})
    objects = build_all(job)
    for obj in objects:
        kubernetes_validate.validate(obj, "1.35.0", strict=True)
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}
    services = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    assert {"t-generator-big", "t-generator-small"} <= set(sets) and "t-generator" not in sets
    assert {"t-generator-big", "t-generator-small"} <= services
    big, small = sets["t-generator-big"], sets["t-generator-small"]
    assert (big["spec"]["replicas"], small["spec"]["replicas"]) == (2, 3)
    assert big["spec"]["selector"]["matchLabels"]["rlfleet.io/pool"] == "big"
    big_pod, small_pod = big["spec"]["template"]["spec"], small["spec"]["template"]["spec"]
    assert big_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "nodeSelector" not in small_pod and small_pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    env = {e["name"]: e.get("value") for e in small_pod["containers"][0]["env"]}
    assert env[POOL_ENV] == "small"
    assert small_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert big_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    pod_sets = {s["name"]: s["count"] for s in build_workload(job, "q", list(sets.values()))["spec"]["podSets"]}
    assert pod_sets == {"trainer": 1, "generator-big": 2, "generator-small": 3, "scorer": 1}


def test_a_job_without_pools_renders_the_names_it_always_had():
    sets = [o["metadata"] for o in build_all(make_job()) if o["kind"] in ("StatefulSet", "Service")]
    assert sorted({m["name"] for m in sets}) == ["t-generator", "t-scorer", "t-trainer"]
    assert all("rlfleet.io/pool" not in m["labels"] for m in sets)


def test_scaling_a_pool_does_not_restart_the_other_roles():
    scaled = {**TWO_POOLS, "pools": [TWO_POOLS["pools"][0], {**TWO_POOLS["pools"][1], "replicas": 5}]}
    assert config_hash(pooled(TWO_POOLS)) == config_hash(pooled(scaled))


def test_every_pool_scales_in_place_and_only_moving_a_pool_with_replicas_is_refused():
    big, small = TWO_POOLS["pools"]
    before = pooled(TWO_POOLS).spec
    for after in ([{**big, "replicas": 3}, small], [{**big, "replicas": 0}, {**small, "replicas": 6}],
                  [*TWO_POOLS["pools"], {"name": "more", "replicas": 2}]):
        assert renumbering(before, pooled({"pools": after}).spec) == "", after
    swapped = renumbering(before, pooled({"pools": [small, big]}).spec)
    assert swapped.startswith("spec.roles.generator.pools[0]: pool big runs generators 0..1 and would be pool "
                              "'small'") and "scale the pool to 0 first" in swapped
    assert "pools[1]: pool small runs generators 128..130 and would be gone" in renumbering(
        before, pooled({"pools": [big]}).spec)
    emptied = pooled({"pools": [{**big, "replicas": 0}, small]}).spec
    assert renumbering(emptied, pooled({"pools": [{"name": "other"}, small]}).spec) == ""  # big had no pods
    assert "spec.roles.generator: pool (the role) runs generators 0..0 and would be pool 'big'" in renumbering(
        make_job().spec, before)


def test_local_processes_run_their_pools_tensor_parallelism_in_replica_order():
    job = pooled({"pools": [{"name": "one", "replicas": 1}, {"name": "two", "replicas": 1, "tensorParallelSize": 2}]})
    ports = local_ports(job, allocate=iter(range(30000, 31000)).__next__)
    workers = plan_workers(job, local_endpoints(job, ports), "c.json", "run", "token",
                           ports=lambda role, rank: ports[(role, rank)], listen_host="127.0.0.1")
    generators = [w for w in workers if w.role == "generator"]
    assert [w.rank for w in generators] == [0, 128]
    pinned = {w.rank: w.env for w in assign_cores(job, workers, list(range(8))) if w.role == "generator"}
    assert len(pinned[0]["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 1
    assert len(pinned[128]["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2


@pytest.mark.parametrize("generator, rank, pool", [(TWO_POOLS, 129, "small"), ({"replicas": 2}, 1, "default")])
def test_every_generator_metric_carries_its_pool(generator, rank, pool, tmp_path):
    ctx = WorkerContext(job=pooled(generator), role="generator", rank=rank, endpoints=cluster_endpoints(make_job()),
                        grpc_port=0, metrics_port=0, run_dir=str(tmp_path))
    metrics = WorkerMetrics.for_worker(ctx)
    metrics.counter("rlfleet_generated_tokens_total", "tokens").inc(7)
    text = generate_latest(metrics.registry).decode()
    labels = f'job="t",namespace="default",pool="{pool}",rank="{rank}",role="generator"'
    assert f"rlfleet_busy_seconds_total{{{labels}}}" in text
    assert f"rlfleet_generated_tokens_total{{{labels}}} 7.0" in text


def test_other_roles_have_no_pool_label(tmp_path):
    ctx = WorkerContext(job=make_job(), role="scorer", rank=0, endpoints=cluster_endpoints(make_job()),
                        grpc_port=0, metrics_port=0, run_dir=str(tmp_path))
    assert "pool=" not in generate_latest(WorkerMetrics.for_worker(ctx).registry).decode()


def test_rlfleet_scale_scales_one_pool(tmp_path):
    write_run_config(tmp_path / CONFIG_FILE, pooled(TWO_POOLS))
    with pytest.raises(SystemExit, match="--pool: name one of the job's generator pools \\(big, small\\)"):
        main(["scale", str(tmp_path), "--generators", "4"])
    assert main(["scale", str(tmp_path), "--pool", "small", "--generators", "4"]) == 0
    saved = parse_job(json.loads((tmp_path / CONFIG_FILE).read_text())).spec.roles.generator
    assert ([pool.replicas for pool in saved.pools], saved.replicas) == ([2, 4], 6)


def _followed(tmp_path, generator: dict, monkeypatch) -> tuple[LocalRun, str, list]:
    """A local run of TWO_POOLS after its config changed to `generator`: its output, and the workers it started
    (recorded, not run)."""
    config = tmp_path / CONFIG_FILE
    write_run_config(config, pooled(TWO_POOLS))
    run = LocalRun(pooled(TWO_POOLS), tmp_path, config, tmp_path / "token")
    started = []
    monkeypatch.setattr("rlfleet.workers.local.spawn", lambda worker, _dir: started.append(worker) or worker)
    write_run_config(config, pooled(generator))
    os.utime(config, ns=(1, 1))  # a change the run sees, however fast the test
    out = io.StringIO()
    run.follow([], out)
    return run, out.getvalue(), started


def test_a_local_run_refuses_to_renumber_its_running_generators(tmp_path, monkeypatch):
    run, out, started = _followed(tmp_path, {"pools": TWO_POOLS["pools"][::-1]}, monkeypatch)
    assert "the run goes on as it was" in out and "pool big runs generators 0..1 and would be pool 'small'" in out
    assert run.job.spec.roles.generator.replicas == 5 and started == []


def test_a_local_run_grows_its_first_pool_in_place(tmp_path, monkeypatch):
    big, small = TWO_POOLS["pools"]
    run, out, started = _followed(tmp_path, {"pools": [{**big, "replicas": 3}, small]}, monkeypatch)
    assert "generators 5 -> 6 (added #2, removed none)" in out
    assert [(w.role, w.rank, w.name) for w in started] == [("generator", 2, "t-generator-2")]
    endpoints = json.loads((tmp_path / "endpoints.json").read_text())
    assert [bool(address) for address in endpoints["servers"]["generator"]] == [True] * 3 + [False] * 125 + [True] * 3
