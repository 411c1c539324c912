"""The planner: workers, ranks, names, ports, endpoints and environment of a 2-generator, 3-scorer, 2-trainer job."""

from __future__ import annotations

import itertools
import json

import pytest

import rlfleet.workers.plan as plan_module
from rlfleet.workers.executors import BY_ROLE, SERVING, ExecutorKind
from rlfleet.workers.plan import (
    DIST_PORT,
    GRPC_PORT,
    HTTP_PORT,
    LISTEN_PORT_LOW,
    METRICS_PORT,
    Endpoints,
    WorkerContext,
    cluster_endpoints,
    local_endpoints,
    local_ports,
    plan_workers,
)
from rlfleet.workers.auth import TOKEN_FILE_ENV, ensure_token_file, read_token
from rlfleet.workers.spec import parse_job

from conftest import make_job, write_config

ROLES = {"generator": {"replicas": 2}, "scorer": {"replicas": 3},
         "trainer": {"replicas": 2, "resources": {"cpu": "2", "memory": "8Gi"}}}


def counting_ports():
    """Ports as the OS may hand them out: a just-released one comes again (here each one twice in a row)."""
    counter = itertools.count(2 * 40000)
    return lambda: next(counter) // 2


def plan(job, config="/run/config.json", run_dir="/run", token_file="/run/token"):
    ports = local_ports(job, allocate=counting_ports())
    endpoints = local_endpoints(job, ports)
    workers = plan_workers(job, endpoints, config, run_dir, token_file, ports=lambda role, rank: ports[(role, rank)])
    return workers, endpoints, ports


@pytest.fixture
def job():
    return make_job(roles=ROLES)


def test_workers_ranks_names_and_commands(job):
    workers, _, _ = plan(job)
    assert [(w.role, w.rank) for w in workers] == [
        ("scorer", 0), ("scorer", 1), ("scorer", 2), ("generator", 0), ("generator", 1), ("trainer", 0), ("trainer", 1)]
    for worker in workers:
        assert worker.name == f"t-{worker.role}-{worker.rank}"
        assert worker.command == ["rlfleet", "worker", worker.role]
        assert worker.env["RLFLEET_ROLE"] == worker.role
        assert worker.env["RLFLEET_RANK"] == str(worker.rank)
        assert worker.env["RLFLEET_JOB_CONFIG"] == "/run/config.json"
        assert worker.env["RLFLEET_RUN_DIR"] == "/run"
        assert worker.env["RLFLEET_TOKEN_FILE"] == "/run/token"  # the path: never the token itself
        assert worker.resources == getattr(job.spec.roles, worker.role).resources
    assert next(w for w in workers if w.role == "trainer").resources.memory == "8Gi"


def test_local_ports_are_distinct_and_match_the_environment(job):
    workers, _, ports = plan(job)
    every = [port for own in ports.values() for port in own.values()]
    # grpc + metrics per worker, trainer 0's rendezvous plus one sync port per generator, and each generator's http.
    assert len(every) == 7 * 2 + 1 + 2 + 2
    assert len(set(every)) == len(every)
    assert set(ports[("trainer", 0)]) == {"grpc", "metrics", "dist", "sync0", "sync1"}
    assert set(ports[("trainer", 1)]) == {"grpc", "metrics"}
    for worker in workers:
        assert worker.ports == ports[(worker.role, worker.rank)]
        assert worker.env["RLFLEET_GRPC_PORT"] == str(worker.ports["grpc"])
        assert worker.env["RLFLEET_METRICS_PORT"] == str(worker.ports["metrics"])
        assert worker.env.get("RLFLEET_HTTP_PORT") == (str(worker.ports["http"]) if worker.role == "generator" else None)


def test_local_endpoints_point_at_the_right_ports(job):
    workers, endpoints, ports = plan(job)
    trainer0 = ports[("trainer", 0)]
    assert endpoints.of("generator") == [f"127.0.0.1:{ports[('generator', g)]['grpc']}" for g in range(2)]
    assert endpoints.of("scorer") == [f"127.0.0.1:{ports[('scorer', s)]['grpc']}" for s in range(3)]
    assert endpoints.http_of("generator") == [f"127.0.0.1:{ports[('generator', g)]['http']}" for g in range(2)]
    assert endpoints.http_of("scorer") == []
    assert endpoints.controller == f"127.0.0.1:{trainer0['grpc']}"
    assert endpoints.rendezvous == {"trainer": f"127.0.0.1:{trainer0['dist']}"}
    assert endpoints.sync == {"generator": [f"127.0.0.1:{trainer0['sync0']}", f"127.0.0.1:{trainer0['sync1']}"]}
    for worker in workers:
        assert Endpoints.from_json(worker.env["RLFLEET_ENDPOINTS"]) == endpoints


def test_trainer_environment_has_the_rendezvous(job):
    workers, _, ports = plan(job)
    for worker in workers:
        if worker.role == "trainer":
            assert worker.env["MASTER_ADDR"] == "127.0.0.1"
            assert worker.env["MASTER_PORT"] == str(ports[("trainer", 0)]["dist"])
            assert worker.env["WORLD_SIZE"] == "2"
        else:
            assert not {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"} & set(worker.env)


@pytest.mark.parametrize("gpu", [0, 1])
def test_only_cpu_generators_run_vllm_in_process(gpu):
    job = make_job(roles={**ROLES, "generator": {"replicas": 2, "resources": {"gpu": gpu}}})
    workers, _, _ = plan(job)
    for worker in workers:
        expected = worker.role == "generator" and gpu == 0
        assert (worker.env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") == expected, worker.name
        assert expected or "VLLM_ENABLE_V1_MULTIPROCESSING" not in worker.env


def test_cluster_endpoints_use_stable_pod_dns_names():
    job = parse_job({"metadata": {"name": "rl", "namespace": "ml"}, "spec": {"roles": ROLES}})
    endpoints = cluster_endpoints(job)
    assert endpoints.of("generator") == [f"rl-generator-{g}.rl-generator.ml.svc:{GRPC_PORT}" for g in range(2)]
    assert endpoints.of("scorer") == [f"rl-scorer-{s}.rl-scorer.ml.svc:{GRPC_PORT}" for s in range(3)]
    assert endpoints.controller == f"rl-trainer-0.rl-trainer.ml.svc:{GRPC_PORT}"
    assert endpoints.rendezvous == {"trainer": f"rl-trainer-0.rl-trainer.ml.svc:{DIST_PORT}"}
    base = BY_ROLE["generator"].sync_port_base
    assert endpoints.sync == {"generator": [f"rl-trainer-0.rl-trainer.ml.svc:{base + g}" for g in range(2)]}
    assert Endpoints.from_json(endpoints.to_json()) == endpoints


def test_a_kind_that_receives_weights_is_planned_from_its_table_entry_alone(monkeypatch):
    """A new receiving kind needs no planner code: trainer 0 gets a sync store port per replica of it, and the
    endpoints list its servers and stores (the made-up kind borrows the reward model's spec section)."""
    kind = ExecutorKind("penalty", "reward_model", "rlfleet.workers.reward_model.main", SERVING, "pen",
                        receives_weights=True, sync_port="pensync", sync_port_base=27000)
    monkeypatch.setitem(BY_ROLE, "penalty", kind)
    monkeypatch.setattr(plan_module, "ROLES", ("penalty",) + plan_module.ROLES)
    job = parse_job({"metadata": {"name": "rl", "namespace": "ml"},
                     "spec": {"roles": {"rewardModel": {"path": "/models/reward", "replicas": 2}}}})
    ports = local_ports(job, allocate=counting_ports())
    assert {"pensync0", "pensync1", "sync0"} <= set(ports[("trainer", 0)])
    endpoints = local_endpoints(job, ports)
    assert endpoints.of("penalty") == [f"127.0.0.1:{ports[('penalty', p)]['grpc']}" for p in range(2)]
    assert endpoints.sync_of("penalty") == [f"127.0.0.1:{ports[('trainer', 0)][f'pensync{p}']}" for p in range(2)]
    cluster = cluster_endpoints(job)
    assert cluster.of("penalty") == [f"rl-penalty-{p}.rl-penalty.ml.svc:{GRPC_PORT}" for p in range(2)]
    assert cluster.sync_of("penalty") == [f"rl-trainer-0.rl-trainer.ml.svc:{27000 + p}" for p in range(2)]
    assert Endpoints.from_json(cluster.to_json()) == cluster


def test_worker_context_from_the_planned_environment(job, tmp_path):
    config = write_config(job, tmp_path)
    token_file = ensure_token_file(tmp_path)
    workers, endpoints, _ = plan(job, config=str(config), run_dir=str(tmp_path), token_file=str(token_file))
    trainer1 = next(w for w in workers if (w.role, w.rank) == ("trainer", 1))
    ctx = WorkerContext.from_environ(trainer1.env)
    assert (ctx.role, ctx.rank, ctx.run_dir) == ("trainer", 1, str(tmp_path))
    assert ctx.token == read_token(token_file)
    assert ctx.job == job
    assert ctx.endpoints == endpoints
    assert (ctx.grpc_port, ctx.metrics_port) == (trainer1.ports["grpc"], trainer1.ports["metrics"])


@pytest.mark.parametrize(
    "extra, rank",
    [
        ({"HOSTNAME": "t-generator-1"}, 1),
        ({"HOSTNAME": "my-long-job-generator-12"}, 12),
        ({"RLFLEET_RANK": "3", "HOSTNAME": "t-generator-1"}, 3),
        ({"RLFLEET_RANK": "0"}, 0),
    ],
    ids=["hostname", "hostname-with-dashes", "rank-wins", "rank-only"],
)
def test_worker_context_rank_from_rank_or_hostname(job, tmp_path, extra, rank):
    config = write_config(job, tmp_path)
    environ = {"RLFLEET_JOB_CONFIG": str(config), "RLFLEET_ROLE": "generator",
               "RLFLEET_ENDPOINTS": cluster_endpoints(job).to_json(),
               TOKEN_FILE_ENV: str(ensure_token_file(tmp_path)), **extra}
    ctx = WorkerContext.from_environ(environ)
    assert ctx.rank == rank
    assert ctx.role == "generator"
    # In a pod nothing sets the ports: the fixed in-pod ports apply.
    assert (ctx.grpc_port, ctx.metrics_port, ctx.http_port, ctx.run_dir) == (GRPC_PORT, METRICS_PORT, HTTP_PORT, ".")
    assert ctx.endpoints.http_of("generator")[0].endswith(f"-generator-0.t-generator.default.svc:{HTTP_PORT}")
    assert json.loads(config.read_text()) == job.to_dict()


@pytest.mark.parametrize("token", [None, "", "short"], ids=["unset", "empty-file", "too-short"])
def test_worker_without_a_token_does_not_start(job, tmp_path, token):
    """Secure by default: no token file, no worker (and so no unauthenticated gRPC server)."""
    environ = {"RLFLEET_JOB_CONFIG": str(write_config(job, tmp_path)), "RLFLEET_ROLE": "scorer",
               "RLFLEET_RANK": "0", "RLFLEET_ENDPOINTS": cluster_endpoints(job).to_json()}
    if token is not None:
        (tmp_path / "token").write_text(token)
        environ[TOKEN_FILE_ENV] = str(tmp_path / "token")
    with pytest.raises((RuntimeError, ValueError), match="token"):
        WorkerContext.from_environ(environ)


def test_local_ports_lie_below_the_ephemeral_range():
    """Chosen before their listeners start: an ephemeral port could meanwhile become the local port of one of the
    run's own outgoing connections (a sync store then failed with EADDRINUSE until the run was killed)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        low = int(handle.read().split()[0])
    ports = [p for own in local_ports(make_job(roles={"generator": {"replicas": 3}})).values() for p in own.values()]
    assert len(ports) == len(set(ports)) and all(LISTEN_PORT_LOW <= p < low for p in ports), ports
