"""Test helpers: start real worker processes exactly as `rlfleet run` does."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Iterator

from rlfleet.workers import wire
from rlfleet.workers.auth import RUN_DIR_TOKEN, ensure_token_file, read_token, sync_key
from rlfleet.workers.local import Child, spawn, stop
from rlfleet.workers.plan import LOOPBACK, Endpoints, Worker, local_endpoints, local_ports, plan_workers
from rlfleet.workers.spec import RLJob
from rlfleet.workers.sync.shards import RolePublishers, ShardPublisher, SyncSettings, global_shapes, local_shards

from conftest import write_config

READY_SECONDS = 300
FIXED_TOKEN = hashlib.sha256(b"rlfleet tests").hexdigest()
"""A job token that is the same in every process a test spawns (each imports the test's module afresh)."""


def start_workers(job: RLJob, run_dir: Path, roles: set[str]) -> tuple[list[Child], Endpoints, dict]:
    """Start the planned workers of `roles` (logs in run_dir/logs, token in run_dir) and wait for their gRPC
    health; `run_token(run_dir)` is what calls to them need."""
    workers, endpoints, ports = plan_local(job, run_dir)
    children = [spawn(w, run_dir) for w in workers if w.role in roles]
    try:
        for child in children:
            wire.wait_ready(f"127.0.0.1:{child.worker.ports['grpc']}", READY_SECONDS)
    except Exception:
        stop(children)
        raise
    return children, endpoints, ports


@contextlib.contextmanager
def one_worker(job: RLJob, run_dir: Path, role: str) -> Iterator[tuple[Child, Endpoints, str]]:
    """The first planned worker of `role` started in run_dir and stopped on leaving: (its process, the job's
    endpoints, the token calls to it need)."""
    children, endpoints, _ = start_workers(job, run_dir, {role})
    try:
        yield children[0], endpoints, run_token(run_dir)
    finally:
        stop(children)


def plan_local(job: RLJob, run_dir: Path) -> tuple[list[Worker], Endpoints, dict]:
    """The workers `rlfleet run` would start in run_dir (its config, token and logs folder made)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config = write_config(job, run_dir)
    ports = local_ports(job)
    endpoints = local_endpoints(job, ports)
    workers = plan_workers(job, endpoints, str(config), str(run_dir), str(ensure_token_file(run_dir)),
                           ports=lambda r, k: ports[(r, k)], listen_host=LOOPBACK)
    return workers, endpoints, ports


def run_token(run_dir: Path) -> str:
    """The gRPC token of the workers started in run_dir."""
    return read_token(run_dir / RUN_DIR_TOKEN)


def log_text(child: Child) -> str:
    return Path(child.log_path).read_text(errors="replace")


def end_trainer_rank(trainer) -> None:
    """A trainer rank's process ends as `rlfleet worker` ends it: stopped in order, then without the interpreter's
    teardown (which torch's process-group threads can abort)."""
    from rlfleet.workers.cli import exit_now

    trainer.stop()
    exit_now(0)


class RankZero:
    """Trainer rank 0 of a one-rank job, without training: its model and its shard publisher to `role`'s replicas
    (what WeightReceivers drives)."""

    def __init__(self, model, job: RLJob, token: str, role: str = "generator"):
        self.model = model
        self.role = role
        self.world_size = 1
        self.push_shapes = global_shapes(model)
        self.publisher = ShardPublisher(0, SyncSettings.from_job(job, role, sync_key(token)), self.push_shapes,
                                        model.config.vocab_size)
        self.publishers = RolePublishers(job, role, sync_key(token), lambda _: self.publisher)

    def connect(self, role, *args):
        assert role == self.role
        return self.publisher.connect(*args)

    def arrived(self, role, *args):
        assert role == self.role
        return self.publishers.arrived(*args)

    def publish(self, role, *args):
        assert role == self.role
        return self.publisher.publish(local_shards(self.model), *args)
