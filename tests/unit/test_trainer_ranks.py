"""Every GPU of a trainer (or critic) pod is used: a pod runs ranksPerPod ranks (default: its GPUs), the trainer
world is replicas x ranksPerPod, and the spec, the planner (`rlfleet run`), the operator and the weight-sync plan
agree."""

from __future__ import annotations

from conftest import make_job
from rlfleet.operator.workload import build_statefulset, container_env
from rlfleet.workers.plan import (DIST_PORT, METRICS_PORT, METRICS_PORTS_ENV, POD_ENV, local_endpoints, local_ports,
                                 plan_workers)
from rlfleet.workers.sync.shards import SyncSettings
from rlfleet.workers.launch import rank_env

GPU_PODS = {"trainer": {"replicas": 2, "resources": {"gpu": 8}}, "generator": {"resources": {"gpu": 4}}}


def test_gpu_pods_use_every_gpu_by_default():
    roles = make_job(roles=GPU_PODS).spec.roles
    assert (roles.trainer.ranks_per_pod, roles.trainer.world_size) == (8, 16)
    assert roles.generator.tensor_parallel_size == 4
    cpu = make_job().spec.roles
    assert (cpu.trainer.ranks_per_pod, cpu.generator.tensor_parallel_size) == (1, 1)


def test_the_operator_runs_pods_and_tells_each_rank_the_whole_world():
    job = make_job(roles=GPU_PODS)
    trainers = build_statefulset(job, "trainer")
    assert trainers["spec"]["replicas"] == 2
    (container,) = trainers["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e.get("value") for e in container_env(job, "trainer")}
    assert env["WORLD_SIZE"] == "16" and "RLFLEET_RANK" not in env and POD_ENV not in env
    assert SyncSettings.from_job(job).trainers == 16


def test_rlfleet_run_starts_one_process_per_pod_with_its_ranks_ports():
    job = make_job(roles={"trainer": {"replicas": 2, "ranksPerPod": 2}}, algorithm={"promptsPerStep": 2})
    ports = local_ports(job)
    workers = plan_workers(job, local_endpoints(job, ports), "job.json", "run", "token",
                           ports=lambda role, rank: ports[(role, rank)])
    trainers = [w for w in workers if w.role == "trainer"]
    assert [w.env[POD_ENV] for w in trainers] == ["0", "1"]
    assert all("RLFLEET_RANK" not in w.env and w.env["WORLD_SIZE"] == "4" for w in trainers)
    metrics = [port for w in trainers for port in w.env[METRICS_PORTS_ENV].split(",")]
    assert metrics == [str(ports[("trainer", rank)]["metrics"]) for rank in range(4)]
    everything = [p for own in ports.values() for p in own.values()]
    assert len(everything) == len(set(everything))


def test_each_rank_of_a_pod_gets_its_global_rank_gpu_and_metrics_port():
    pod = {"HOSTNAME": "job-trainer-1", "WORLD_SIZE": "4"}
    ranks = [rank_env(pod, 2, local) for local in range(2)]
    assert [(r["RLFLEET_RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in ranks] == [("2", "0", "2"),
                                                                                         ("3", "1", "2")]
    assert [r["RLFLEET_METRICS_PORT"] for r in ranks] == [str(METRICS_PORT), str(METRICS_PORT + 1)]
    local = rank_env({POD_ENV: "0", METRICS_PORTS_ENV: "5001,5002"}, 2, 1)
    assert (local["RLFLEET_RANK"], local["RLFLEET_METRICS_PORT"]) == ("1", "5002")


def test_the_critic_trains_on_ranks_of_its_own():
    """The critic's pod runs a GPU's rank each, in a world of its own that meets at critic pod 0, not the
    trainers' (both runtimes)."""
    job = make_job(roles={"critic": {"resources": {"gpu": 4}}}, algorithm={"advantage": "gae"})
    assert (job.spec.roles.critic.ranks_per_pod, job.spec.roles.critic.world_size) == (4, 4)
    critics = build_statefulset(job, "critic")
    (container,) = critics["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"} in container["ports"]
    env = {e["name"]: e.get("value") for e in container_env(job, "critic")}
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == ("t-critic-0.t-critic.default.svc",
                                                                          str(DIST_PORT), "4")
    local = make_job(roles={"critic": {"ranksPerPod": 2}}, algorithm={"advantage": "gae"})
    ports = local_ports(local)
    workers = plan_workers(local, local_endpoints(local, ports), "job.json", "run", "token",
                           ports=lambda role, rank: ports[(role, rank)])
    (critic,) = [w for w in workers if w.role == "critic"]
    (trainer,) = [w for w in workers if w.role == "trainer"]
    assert critic.env["MASTER_PORT"] == str(ports[("critic", 0)]["dist"]) != trainer.env["MASTER_PORT"]
    assert critic.env["WORLD_SIZE"] == "2" and critic.env[POD_ENV] == "0"
    assert critic.env[METRICS_PORTS_ENV].split(",") == [str(ports[("critic", r)]["metrics"]) for r in range(2)]
