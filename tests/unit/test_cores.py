"""The cores of a local CPU run: each worker that runs a model gets cores of its own (a real process checks the pin)."""

from __future__ import annotations

import os
import subprocess
import sys

from rlfleet.workers.cores import CPUS_ENV, assign_cores
from rlfleet.workers.local import LocalRun

from conftest import make_job, write_config
from test_plan import plan

PINNED = (CPUS_ENV, "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")


def planned(job, cores):
    workers, _, _ = plan(job)
    return {w.name.removeprefix("t-"): {k: w.env[k] for k in PINNED if k in w.env}
            for w in assign_cores(job, workers, cores)}


def test_on_two_cores_the_generator_and_the_trainer_each_have_one_and_the_scorer_is_left_free():
    assert planned(make_job(), [0, 1]) == {
        "scorer-0": {},
        "generator-0": {CPUS_ENV: "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"},
        "trainer-0": {CPUS_ENV: "1", "OMP_NUM_THREADS": "1"},
    }


def test_rlfleet_run_starts_its_workers_with_their_cores(tmp_path):
    run = LocalRun(make_job(), tmp_path, write_config(make_job(), tmp_path), tmp_path / "token")
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert {w.role: w.env.get("OMP_NUM_THREADS") for w in run._publish()} == {
        "scorer": None, "generator": threads, "trainer": threads}


def test_ranks_and_tensor_parallel_workers_each_have_their_share_and_a_leftover_core_stays_free():
    job = make_job(roles={"generator": {"tensorParallelSize": 2}, "trainer": {"ranksPerPod": 2},
                          "reference": {}})
    assert planned(job, list(range(11))) == {
        "scorer-0": {},
        "generator-0": {CPUS_ENV: "0,1,2,3", "OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"},
        "reference-0": {CPUS_ENV: "4,5", "OMP_NUM_THREADS": "2"},
        "trainer-0": {CPUS_ENV: "6,7,8,9", "OMP_NUM_THREADS": "2"},
    }


def test_more_processes_than_cores_get_one_thread_each_and_no_pin():
    job = make_job(roles={"generator": {"replicas": 2}, "reference": {}})
    one_thread = {"OMP_NUM_THREADS": "1"}
    assert planned(job, [0, 1]) == {"scorer-0": {}, "generator-0": one_thread, "generator-1": one_thread,
                                    "reference-0": one_thread, "trainer-0": one_thread}


def test_gpu_workers_are_left_alone_and_a_roles_own_env_wins():
    job = make_job(roles={"generator": {"resources": {"gpu": 1}},
                          "trainer": {"env": {"OMP_NUM_THREADS": "3"}}})
    assert planned(job, [0, 1, 2, 3]) == {
        "scorer-0": {}, "generator-0": {}, "trainer-0": {CPUS_ENV: "0,1,2,3", "OMP_NUM_THREADS": "3"}}


def test_a_pinned_worker_and_the_threads_it_starts_run_on_its_cores_only():
    core = max(os.sched_getaffinity(0))
    script = ("import os, threading; from rlfleet.workers.cores import pin_to_planned_cores; "
              "pin_to_planned_cores(os.environ); seen = []; "
              "thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); thread.start(); "
              "thread.join(); print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))")
    out = subprocess.run([sys.executable, "-c", script], env=os.environ | {CPUS_ENV: str(core)}, check=True,
                         capture_output=True, text=True).stdout
    assert out.split() == [f"[{core}]", f"[{core}]"]
