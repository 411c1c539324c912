"""The planner: an RLJob becomes a list of workers (role, rank, command, environment, ports, resources).

Pure and torch-free. The operator wraps this plan in Kubernetes objects; `rlfleet run` starts the same
commands as local processes. Only the addressing differs: stable DNS names there, loopback ports here.
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import dataclass, field
from typing import Callable

from rlfleet.workers.auth import TOKEN_FILE_ENV, read_token
from rlfleet.workers.executors import BY_ROLE, ROLES
from rlfleet.workers.generator.pools import as_pool, generator_indexes, named_pool, pool_of
from rlfleet.workers.roles import Resources, Role
from rlfleet.workers.spec import RLJob

# Fixed ports inside a pod; pods differ by host name. Trainer 0's sync stores: each receiving kind's sync_port_base.
GRPC_PORT = 50051
METRICS_PORT = 9400
DIST_PORT = 29500
HTTP_PORT = 8000
# `rlfleet run` listens on ports from here up to the kernel's ephemeral range (Linux's default starts at 32768).
LISTEN_PORT_LOW = 20000
EPHEMERAL_LOW = 32768
# A generator pod of a named pool: which pool (its ordinal counts from the pool's first replica).
POOL_ENV = "RLFLEET_POOL"
# A trainer pod of several ranks: which pod it is (in a StatefulSet, its ordinal) and its ranks' metrics ports
# (in a pod, METRICS_PORT + local rank).
POD_ENV = "RLFLEET_POD"
METRICS_PORTS_ENV = "RLFLEET_METRICS_PORTS"
# Beside the job's config file, the runtime keeps the endpoints current as generators are added or removed (the
# operator's ConfigMap, `rlfleet scale` locally); the controller follows the file, every other worker reads its
# peers once from RLFLEET_ENDPOINTS.
ENDPOINTS_FILE = "endpoints.json"
ENDPOINTS_FILE_ENV = "RLFLEET_ENDPOINTS_FILE"
# Where a worker's gRPC and metrics servers listen: every interface in a pod (its Service and Prometheus reach it
# there), loopback under `rlfleet run`, whose peers all call 127.0.0.1.
LISTEN_HOST_ENV = "RLFLEET_LISTEN_HOST"
EVERY_INTERFACE = "0.0.0.0"
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Endpoints:
    """host:port of a job's servers, by executor kind (role): what the controller and the workers call."""

    controller: str
    """Where the controller serves its status: trainer pod 0's gRPC server, or controller pod 0's in a job that runs
    the controller as an executor of its own (spec.roles.controller)."""
    servers: dict[str, list[str]] = field(default_factory=dict)
    """Each replica's gRPC server, for every role the job runs but the controller's host: the trainer's too when the
    controller is its own executor (the trainer then serves it the Trainer service)."""
    sync: dict[str, list[str]] = field(default_factory=dict)
    """For every role that receives weights, each replica's sync store (on trainer rank 0)."""
    rendezvous: dict[str, str] = field(default_factory=dict)
    """For every ranked role, where its ranks meet (MASTER_ADDR:MASTER_PORT, its pod 0's dist port)."""
    http: dict[str, list[str]] = field(default_factory=dict)
    """For every role that serves HTTP (executors.ExecutorKind.serves_http), each replica's HTTP server: the
    generators' OpenAI-compatible endpoint, base URL http://<host:port>/v1."""

    def of(self, role: str) -> list[str]:
        """The gRPC servers of the role's replicas (none when the job does not run it)."""
        return self.servers.get(role, [])

    def http_of(self, role: str) -> list[str]:
        """The HTTP servers of the role's replicas (none when it serves none or the job does not run it)."""
        return self.http.get(role, [])

    def sync_of(self, role: str) -> list[str]:
        """The sync stores of a receiving role's replicas."""
        return self.sync.get(role, [])

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> Endpoints:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Worker:
    role: str
    rank: int
    name: str
    command: list[str]
    env: dict[str, str]
    ports: dict[str, int]
    resources: Resources = field(default_factory=Resources)


def role_spec(job: RLJob, role: str) -> Role | None:
    """The role's section of spec.roles (None: an optional executor the job does not run)."""
    return getattr(job.spec.roles, BY_ROLE[role].spec_field)


def job_roles(job: RLJob) -> list[str]:
    """The executor kinds this job runs, in start order: the three every job has and the optional ones it names."""
    return [role for role in ROLES if role_spec(job, role) is not None]


def replicas(job: RLJob, role: str) -> int:
    """Pods (locally: processes started by `rlfleet run`) of the role."""
    return role_spec(job, role).replicas


def ranks_per_pod(job: RLJob, role: str) -> int:
    """A pod of a ranked role (trainer, critic) runs ranksPerPod processes, every other pod one."""
    return role_spec(job, role).ranks_per_pod if BY_ROLE[role].ranked else 1


def ranked_roles(job: RLJob) -> list[str]:
    """The job's roles whose ranks form a torch.distributed world of their own, each hosted by its pod 0."""
    return [role for role in job_roles(job) if BY_ROLE[role].ranked]


def receiving_roles(job: RLJob) -> list[str]:
    """The job's roles the trainers push the policy's weights to."""
    return [role for role in job_roles(job) if BY_ROLE[role].receives_weights]


def http_roles(job: RLJob) -> list[str]:
    """The job's roles whose workers also serve HTTP (the generators' OpenAI-compatible endpoint)."""
    return [role for role in job_roles(job) if BY_ROLE[role].serves_http]


def ranks(job: RLJob, role: str) -> int:
    """Processes of the role, over all its pods."""
    return replicas(job, role) * ranks_per_pod(job, role)


def indexes(job: RLJob, role: str) -> list[int]:
    """The indexes of the role's pods (replicas): 0..replicas-1; a generator's by its pool's block (pools.py)."""
    return generator_indexes(job.spec) if role == "generator" else list(range(replicas(job, role)))


def listed(job: RLJob, role: str, entry: Callable[[int], str]) -> list[str]:
    """`entry(index)` for each index up to the role's last replica's, "" in the gaps between generator pools."""
    present = set(indexes(job, role))
    return [entry(index) if index in present else "" for index in range(max(present, default=-1) + 1)]


def has_gpu(job: RLJob, role: str) -> bool:
    return role_spec(job, role).resources.gpu > 0


def controller_host(job: RLJob) -> str:
    """The role whose pod 0 runs the controller: its own (`control`) when the job names spec.roles.controller."""
    return "control" if job.spec.roles.controller else "trainer"


def replica_job(job: RLJob, role: str, replica: int) -> RLJob:
    """The job as one replica of `role` runs it: a generator's pool's fields in place of the role's."""
    return as_pool(job, pool_of(job.spec, replica)) if role == "generator" else job


def set_name(job: RLJob, role: str, pool: str = "") -> str:
    """Name of a role's StatefulSet and headless Service (a named generator pool's: <job>-generator-<pool>)."""
    return f"{job.metadata.name}-{role}" + (f"-{pool}" if pool else "")


def pod_host(job: RLJob, role: str, rank: int) -> str:
    """Stable DNS name of a StatefulSet pod behind its headless Service; a generator's is its pool's."""
    pool, ordinal = "", rank
    if role == "generator":
        found = pool_of(job.spec, rank)
        pool, ordinal = found.name, rank - found.first
    name = set_name(job, role, pool)
    return f"{name}-{ordinal}.{name}.{job.metadata.namespace}.svc"


def _endpoints(job: RLJob, address: Callable[[str, int, str], str]) -> Endpoints:
    """`address(role, rank, port name)` gives host:port; trainer 0 also serves the sync stores, each ranked role's
    pod 0 its ranks' dist."""
    host = controller_host(job)
    return Endpoints(
        controller=address(host, 0, "grpc"),
        servers={role: listed(job, role, lambda r, role=role: address(role, r, "grpc"))
                 for role in job_roles(job) if role != host},
        sync={role: listed(job, role, lambda r, role=role: address("trainer", 0, sync_port_name(role, r)))
              for role in receiving_roles(job)},
        rendezvous={role: address(role, 0, "dist") for role in ranked_roles(job)},
        http={role: listed(job, role, lambda r, role=role: address(role, r, "http")) for role in http_roles(job)},
    )


def sync_port_name(role: str, replica: int) -> str:
    """The sync store trainer rank 0 hosts for replica `replica` of a receiving `role`."""
    return f"{BY_ROLE[role].sync_port}{replica}"


def cluster_port(name: str) -> int:
    """Fixed ports inside a pod; replica r of a receiving kind has its sync store at the kind's sync_port_base + r."""
    for kind in BY_ROLE.values():
        replica = name.removeprefix(kind.sync_port) if kind.receives_weights else ""
        if replica.isdigit():
            return kind.sync_port_base + int(replica)
    return {"grpc": GRPC_PORT, "dist": DIST_PORT, "http": HTTP_PORT}[name]


def cluster_endpoints(job: RLJob) -> Endpoints:
    return _endpoints(job, lambda role, rank, port: f"{pod_host(job, role, rank)}:{cluster_port(port)}")


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range. Ports are chosen before the processes that listen
    on them start; an ephemeral one could meanwhile become the local port of one of the run's own outgoing
    connections (seen: a trainer's sync store refused with EADDRINUSE for five minutes, the port held by a
    connection of the same run)."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(LISTEN_PORT_LOW, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LISTEN_PORT_LOW}..{low - 1}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = EPHEMERAL_LOW
    # A range that starts low leaves no room below it: then any port of the default ranges' gap.
    return low if low > LISTEN_PORT_LOW + 1000 else EPHEMERAL_LOW


def distinct(allocate: Callable[[], int], taken: set[int] | None = None) -> Callable[[], int]:
    """The OS may hand a just-released port out again: never give the same one twice (nor one `taken`)."""
    given = set(taken or ())

    def next_port() -> int:
        port = allocate()
        while port in given:
            port = allocate()
        given.add(port)
        return port

    return next_port


Ports = dict[tuple[str, int], dict[str, int]]


def local_ports(job: RLJob, allocate: Callable[[], int] = free_port, given: Ports | None = None) -> Ports:
    """Distinct loopback ports for every worker (grpc, metrics; trainer 0 also dist and sync ports, critic 0 dist,
    generators http).
    Ports `given` are kept: generators added to a running job get new ones, and the others keep theirs."""
    ports = {key: dict(named) for key, named in (given or {}).items()}
    allocate = distinct(allocate, {port for named in ports.values() for port in named.values()})
    for role in job_roles(job):
        for rank in _ranks(job, role):
            _allocate(ports.setdefault((role, rank), {}), ("grpc", "metrics"), allocate)
    for role in http_roles(job):
        for rank in _ranks(job, role):
            _allocate(ports[(role, rank)], ("http",), allocate)
    for role in ranked_roles(job):
        _allocate(ports[(role, 0)], ("dist",), allocate)
    for role in receiving_roles(job):
        _allocate(ports[("trainer", 0)], tuple(sync_port_name(role, r) for r in indexes(job, role)), allocate)
    return ports


def _ranks(job: RLJob, role: str) -> list[int]:
    """The role's processes: a generator's are its replicas' indexes, any other role's count from 0 over its pods."""
    return indexes(job, role) if role == "generator" else list(range(ranks(job, role)))


def _allocate(ports: dict[str, int], names: tuple[str, ...], allocate: Callable[[], int]) -> None:
    for name in names:
        if name not in ports:
            ports[name] = allocate()


def local_endpoints(job: RLJob, ports: Ports) -> Endpoints:
    return _endpoints(job, lambda role, rank, port: f"127.0.0.1:{ports[(role, rank)][port]}")


def plan_workers(job: RLJob, endpoints: Endpoints, config_path: str, run_dir: str, token_file: str,
                 ports: Callable[[str, int], dict[str, int]], listen_host: str = EVERY_INTERFACE) -> list[Worker]:
    """Every worker (pod) of the job; `ports(role, rank)` gives the ports a rank listens on, on `listen_host`. A pod
    of several ranks (trainer, critic) is one worker that starts its ranks itself (workers.launch), as in a pod."""
    workers = []
    for role in job_roles(job):
        per_pod = ranks_per_pod(job, role)
        for pod in indexes(job, role):
            first = pod * per_pod
            own_job = replica_job(job, role, pod)
            env = worker_env(own_job, role, endpoints, config_path, run_dir, token_file)
            own = ports(role, first)
            env |= {"RLFLEET_GRPC_PORT": str(own["grpc"]), "RLFLEET_METRICS_PORT": str(own["metrics"]),
                    LISTEN_HOST_ENV: listen_host}
            if "http" in own:
                env["RLFLEET_HTTP_PORT"] = str(own["http"])
            if per_pod > 1:
                metrics = [str(ports(role, first + local)["metrics"]) for local in range(per_pod)]
                env |= {POD_ENV: str(pod), METRICS_PORTS_ENV: ",".join(metrics)}
            else:
                env["RLFLEET_RANK"] = str(first)
            workers.append(Worker(
                role=role,
                rank=pod,
                name=f"{job.metadata.name}-{role}-{pod}",
                command=["rlfleet", "worker", role],
                env=env,
                ports=own,
                resources=role_spec(own_job, role).resources,
            ))
    return workers


def worker_env(job: RLJob, role: str, endpoints: Endpoints, config_path: str, run_dir: str,
               token_file: str) -> dict[str, str]:
    """What every replica of a role needs to find its job and its peers (rank excluded).

    `token_file` holds the job's gRPC token (`auth`): the path, never the token, goes into the environment.
    """
    # The job's own variables first (NCCL_*, ...): the spec refuses any name set below.
    env = dict(role_spec(job, role).env) | {
        "RLFLEET_JOB_CONFIG": config_path,
        "RLFLEET_RUN_DIR": run_dir,
        TOKEN_FILE_ENV: token_file,
        "RLFLEET_ROLE": role,
        "RLFLEET_ENDPOINTS": endpoints.to_json(),
        "PYTHONUNBUFFERED": "1",
    }
    if role == "generator" and not has_gpu(job, role):
        # In-process engine on CPU: starts in ~2 s and uses a quarter of the memory (ENVIRONMENT.md).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        tp = job.spec.roles.generator.tensor_parallel_size
        if tp > 1:  # one core per CPU tensor-parallel worker, else vLLM refuses to start
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))
    if BY_ROLE[role].ranked:
        master_host, master_port = endpoints.rendezvous[role].rsplit(":", 1)
        env |= {"MASTER_ADDR": master_host, "MASTER_PORT": master_port, "WORLD_SIZE": str(ranks(job, role))}
    if role == controller_host(job):
        env[ENDPOINTS_FILE_ENV] = os.path.join(os.path.dirname(config_path), ENDPOINTS_FILE)
    return env


@dataclass(frozen=True)
class WorkerContext:
    """What a worker process reads from its environment at start."""

    job: RLJob
    role: str
    rank: int
    endpoints: Endpoints
    grpc_port: int
    metrics_port: int
    run_dir: str
    token: str = ""
    """The job's gRPC token; empty in contexts that neither serve nor call gRPC (wire refuses it)."""
    endpoints_file: str = ""
    """Where the runtime keeps the endpoints current (trainers only; ENDPOINTS_FILE)."""
    listen_host: str = EVERY_INTERFACE
    """The address the worker's gRPC, metrics and HTTP servers listen on (LISTEN_HOST_ENV)."""
    http_port: int = HTTP_PORT
    """Where a generator serves its OpenAI-compatible endpoint (generator/openai_api.py)."""
    leader_epoch: int | None = None
    """The controller's fencing token once it leads (controller/leadership.py): every channel it opens to an
    executor carries it (wire.channel's epoch). None in every other worker."""

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerContext:
        from rlfleet.workers.spec import parse_job

        env = os.environ if environ is None else environ
        with open(env["RLFLEET_JOB_CONFIG"], encoding="utf-8") as handle:
            job = parse_job(json.load(handle))
        role, rank = env["RLFLEET_ROLE"], _rank(env, job)
        # A generator runs its pool's fields (a pod of a named pool: its pool's, whatever its ordinal).
        own = as_pool(job, named_pool(job.spec, env[POOL_ENV])) if env.get(POOL_ENV) else replica_job(job, role, rank)
        return cls(
            job=own,
            role=role,
            rank=rank,
            endpoints=Endpoints.from_json(env["RLFLEET_ENDPOINTS"]),
            grpc_port=int(env.get("RLFLEET_GRPC_PORT", GRPC_PORT)),
            metrics_port=int(env.get("RLFLEET_METRICS_PORT", METRICS_PORT)),
            http_port=int(env.get("RLFLEET_HTTP_PORT", HTTP_PORT)),
            run_dir=env.get("RLFLEET_RUN_DIR", "."),
            token=_token(env),
            endpoints_file=env.get(ENDPOINTS_FILE_ENV, ""),
            listen_host=env.get(LISTEN_HOST_ENV, EVERY_INTERFACE),
        )


def _token(env: dict[str, str]) -> str:
    """Secure by default: a worker without a token does not start."""
    if not env.get(TOKEN_FILE_ENV):
        raise RuntimeError(f"{TOKEN_FILE_ENV} is not set: workers need the job's gRPC token file")
    return read_token(env[TOKEN_FILE_ENV])


def _rank(env: dict[str, str], job: RLJob) -> int:
    """Locally the planner sets the rank; in a StatefulSet it is the pod's ordinal (name-role-N), counted from its
    generator pool's first replica."""
    if "RLFLEET_RANK" in env:
        return int(env["RLFLEET_RANK"])
    first = named_pool(job.spec, env[POOL_ENV]).first if env.get(POOL_ENV) else 0
    return first + int(env["HOSTNAME"].rsplit("-", 1)[1])
