"""The cores of a local run on CPU: each worker that runs a model gets cores of its own and one torch thread per core.

Left to themselves, the trainer and the generator each start a thread per core of the machine, and their OpenMP
teams share every core: each parallel region ends at a barrier that waits for the thread the other team preempted.
On two cores, the SmolLM2 example's trainer step took 12.1 s (median) beside a generator that way and 8.2 s on a
core of its own (BENCHMARKS.md, Time to accuracy). Torch-free: `rlfleet run` plans, and each worker pins itself as
it starts.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Mapping

from rlfleet.workers.executors import BY_ROLE
from rlfleet.workers.plan import Worker, has_gpu, ranks_per_pod, replica_job, role_spec
from rlfleet.workers.spec import RLJob

CPUS_ENV = "RLFLEET_CPUS"
"""The cores a worker's process (and the processes it starts) may run on, comma-separated."""


def assign_cores(job: RLJob, workers: list[Worker], cores: list[int]) -> list[Worker]:
    """`workers` with their share of `cores`: disjoint cores when every process that runs a model on CPU can have
    one, else one thread each (no pinning, but no team of one process larger than its share). Cores left over
    stay free for the scorers and the controller's threads. A role's own `env` wins over what is planned here."""
    # A generator's own job: its pool's GPUs and tensor parallelism.
    computing = [w for w in workers if computes_on_cpu(replica_job(job, w.role, w.rank), w.role)]
    processes_of = {w.name: _processes(replica_job(job, w.role, w.rank), w.role) for w in computing}
    total = sum(processes_of.values())
    if not total:
        return workers
    per_process = len(cores) // total
    planned, start = {}, 0
    for worker in computing:
        processes = processes_of[worker.name]
        if not per_process:
            planned[worker.name] = {"OMP_NUM_THREADS": "1"}
            continue
        own = cores[start:start + processes * per_process]
        start += len(own)
        planned[worker.name] = _pinned(worker.role, own, processes)
    return [replace(w, env=w.env | planned[w.name] | role_spec(job, w.role).env) if w.name in planned else w
            for w in workers]


def computes_on_cpu(job: RLJob, role: str) -> bool:
    """Its workers run a model, on CPU: their torch threads are worth planning (here, and by the operator)."""
    return BY_ROLE[role].computes and not has_gpu(job, role)


def _processes(job: RLJob, role: str) -> int:
    """The processes of one of its workers that run the model: ranks of a pod, or vLLM's tensor-parallel workers."""
    if role == "generator":
        return job.spec.roles.generator.tensor_parallel_size
    return ranks_per_pod(job, role) if BY_ROLE[role].ranked else 1


def _pinned(role: str, own: list[int], processes: int) -> dict[str, str]:
    threads = len(own) // processes
    env = {CPUS_ENV: _listed(own), "OMP_NUM_THREADS": str(threads)}
    if role == "generator":  # vLLM binds each tensor-parallel worker's team itself, to the cores named here
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(_listed(own[i * threads:(i + 1) * threads])
                                                   for i in range(processes))
    return env


def _listed(cores: list[int]) -> str:
    return ",".join(str(core) for core in cores)


def pin_to_planned_cores(environ: Mapping[str, str]) -> None:
    """Keep this process, and every thread and process it starts later, on the cores `rlfleet run` gave it."""
    if CPUS_ENV in environ:
        os.sched_setaffinity(0, {int(core) for core in environ[CPUS_ENV].split(",")})
