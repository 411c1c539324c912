"""`rlfleet run`: the planner's workers as local processes on loopback ports, with live progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from rlfleet.workers.auth import ensure_token_file
from rlfleet.workers.cores import assign_cores
from rlfleet.workers.executors import KINDS
from rlfleet.workers.generator.config import GeneratorRole
from rlfleet.workers.generator.pools import renumbering
from rlfleet.workers.metrics.scrape import BubbleMeter
from rlfleet.workers.plan import (
    ENDPOINTS_FILE,
    LOOPBACK,
    METRICS_PORTS_ENV,
    ROLES,
    Worker,
    indexes,
    local_endpoints,
    local_ports,
    plan_workers,
)
from rlfleet.workers.spec import RLJob, SpecError, load_job

POLL_SECONDS = 0.5
# Prometheus file_sd targets of every worker's metrics port: point a local Prometheus at it.
TARGETS_FILE = "prometheus-targets.json"
# The job as the run started it: `rlfleet run --resume` reads it back.
CONFIG_FILE = "config.json"
SHORT = {kind.role: kind.short for kind in KINDS}
# Every executor but the trainers (which host the controller) comes back like a StatefulSet's pods; the controller
# rejoins it. With a controller of its own the trainers come back too: its standby resumes them.
RESTARTABLE = tuple(role for role in ROLES if role != "trainer")
STOP_GRACE_SECONDS = 10.0
# Besides SIGINT (KeyboardInterrupt), the signals that ask a program to end.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
LOG_TAIL_LINES = 20
# The file paths a job may name, by the field a user writes and the attributes under spec that hold its `path`.
PATH_FIELDS = (("spec.model.path", ("model",)), ("spec.data.path", ("data",)),
               ("spec.roles.rewardModel.path", ("roles", "reward_model")))


@dataclass
class Child:
    worker: Worker
    process: subprocess.Popen
    log_path: Path
    restarts: int = 0
    given_up: bool = False
    """Past its restarts: left down for the rest of the run."""


class WorkerDied(RuntimeError):
    pass


class Terminated(Exception):
    """SIGTERM or SIGHUP (systemd, CI runners, `timeout`, a closed terminal): stop like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def run_local(job: RLJob, out_dir: Path, out: IO[str] = sys.stdout) -> int:
    """Run the whole job here; returns the exit code (0 when the trainer finished every step)."""
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    config_path = out_dir / CONFIG_FILE
    write_config(config_path, job)
    children: list[Child] = []
    handlers = {signum: signal.signal(signum, _terminated) for signum in TERMINATING}
    # Explicitly: a script's background job (`rlfleet run ... &`) starts with SIGINT ignored.
    handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = LocalRun(job, out_dir, config_path, ensure_token_file(out_dir))
        children += run.start()
        watch(children, out_dir, job.spec.algorithm.steps, job.spec.failure_policy.max_restarts, out, run.follow)
        return 0
    except WorkerDied as died:
        print(f"rlfleet: {died}", file=out)
        return 1
    except KeyboardInterrupt:
        print("rlfleet: interrupted, stopping every worker", file=out)
        return 128 + signal.SIGINT
    except Terminated as terminated:
        print(f"rlfleet: {terminated}, stopping every worker", file=out)
        return 128 + terminated.signum
    finally:
        # A second signal must not cut the clean-up short and leave workers behind.
        for signum in handlers:
            signal.signal(signum, signal.SIG_IGN)
        stop(children)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def with_absolute_paths(job: RLJob) -> RLJob:
    """Workers run in the run directory: file paths in the job are taken, once, from where `rlfleet run` ran."""
    spec = job.spec
    for _, owner in PATH_FIELDS:
        if _path_at(spec, owner):  # a jsonl file or a directory, not a URI
            spec = _with_path(spec, owner, lambda path: os.path.abspath(os.path.expanduser(path)))
    return job.model_copy(update={"spec": spec})


def missing_paths(job: RLJob) -> list[str]:
    """A line naming the field for each file or directory the job names that is not there."""
    return [f"{field} {path!r}: no such file or directory" for field, owner in PATH_FIELDS
            if (path := _path_at(job.spec, owner)) and not os.path.exists(path)]


def _path_at(spec: Any, owner: tuple[str, ...]) -> str | None:
    for name in owner:
        spec = getattr(spec, name, None)
    return getattr(spec, "path", None)


def _with_path(spec: Any, owner: tuple[str, ...], change: Callable[[str], str]) -> Any:
    if not owner:
        return spec.model_copy(update={"path": change(spec.path)})
    return spec.model_copy(update={owner[0]: _with_path(getattr(spec, owner[0]), owner[1:], change)})


def write_config(path: Path, job: RLJob) -> None:
    """The job as the run runs it; replaced whole, since the run follows it (`rlfleet scale`)."""
    _replace(path, json.dumps(job.to_dict(), indent=2))


class LocalRun:
    """The planner's workers on loopback ports. Like the operator with an RLJob, it follows the generator count
    of the run's config (`rlfleet scale` changes it): it starts or stops generators and rewrites the endpoints
    file, which the controller follows. Every other field is read once, at start."""

    def __init__(self, job: RLJob, out_dir: Path, config_path: Path, token_file: Path):
        self.job, self.out_dir, self.config_path, self.token_file = job, out_dir, config_path, token_file
        self.ports = local_ports(job)
        self._seen = config_path.stat().st_mtime_ns

    def start(self) -> list[Child]:
        return [spawn(worker, self.out_dir) for worker in self._publish()]

    def follow(self, children: list[Child], out: IO[str]) -> None:
        """Start or stop generators when the config's count (any pool's) changed."""
        generators = self._wanted_generators(out)
        if generators is None:
            return
        roles = self.job.spec.roles.model_copy(update={"generator": self.job.spec.roles.generator.model_copy(
            update={"replicas": generators.replicas, "pools": generators.pools})})
        changed = self.job.model_copy(update={"spec": self.job.spec.model_copy(update={"roles": roles})})
        had, wanted = set(indexes(self.job, "generator")), set(indexes(changed, "generator"))
        if had == wanted:
            return
        if moved := renumbering(self.job.spec, changed.spec):
            print(f"rlfleet: {self.config_path} changed but the run goes on as it was: {moved}", file=out)
            return
        self.job = changed
        self.ports = local_ports(self.job, given=self.ports)  # a generator added again gets its old ports back
        workers = self._publish()
        print(f"rlfleet: generators {len(had)} -> {len(wanted)} (added {_names(wanted - had)}, removed "
              f"{_names(had - wanted)})", file=out)
        for child in [c for c in children if c.worker.role == "generator" and c.worker.rank not in wanted]:
            children.remove(child)
            stop([child])
        children += [spawn(w, self.out_dir) for w in workers if w.role == "generator" and w.rank not in had]

    def _publish(self) -> list[Worker]:
        """The workers of the job as it is now, with their endpoints and metrics targets written down."""
        endpoints = local_endpoints(self.job, self.ports)
        workers = plan_workers(self.job, endpoints, str(self.config_path), str(self.out_dir), str(self.token_file),
                               ports=lambda role, rank: self.ports[(role, rank)], listen_host=LOOPBACK)
        _replace(self.out_dir / ENDPOINTS_FILE, endpoints.to_json())
        write_targets(workers, self.out_dir / TARGETS_FILE)
        return assign_cores(self.job, workers, sorted(os.sched_getaffinity(0)))

    def _wanted_generators(self, out: IO[str]) -> GeneratorRole | None:
        """The config's generators (their count, their pools), when the config changed since the last look."""
        stamp = self.config_path.stat().st_mtime_ns
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            return load_job(str(self.config_path)).spec.roles.generator
        except (SpecError, OSError) as error:
            print(f"rlfleet: {self.config_path} changed but cannot be read ({error}); the run goes on as it was",
                  file=out)
            return None


def _names(generators: set[int]) -> str:
    return ", ".join(f"#{index}" for index in sorted(generators)) or "none"


def write_targets(workers: list[Worker], path: Path) -> None:
    """Prometheus file targets: each worker's metrics port, each rank's in a pod of several (trainer, critic)."""
    targets = [{"targets": [f"127.0.0.1:{port}" for port in metrics_ports(w)], "labels": {"worker": w.name}}
               for w in workers]
    _replace(path, json.dumps(targets, indent=2))


def _replace(path: Path, text: str) -> None:
    """Write a file others watch (Prometheus, the controller, the run): never let them read half of one."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(path)


def metrics_ports(worker: Worker) -> list[str]:
    listed = worker.env.get(METRICS_PORTS_ENV)
    return listed.split(",") if listed else [str(worker.ports["metrics"])]


def spawn(worker: Worker, run_dir: Path) -> Child:
    """Start one worker with its log in run_dir/logs.

    It runs in run_dir: `python -m` puts the working directory on sys.path, and a source checkout's
    `operator/` folder there would shadow the standard library's `operator` in every child Python
    (torch's compiler probes start some).
    """
    argv = [sys.executable, "-m", "rlfleet.workers.cli", *worker.command[1:]]
    log_path = run_dir / "logs" / f"{worker.name}.log"
    log = open(log_path, "ab")
    process = subprocess.Popen(argv, env=os.environ | worker.env, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True, cwd=run_dir)
    log.close()
    return Child(worker, process, log_path)


def watch(children: list[Child], out_dir: Path, total_steps: int, max_restarts: int, out: IO[str],
          follow: Callable[[list[Child], IO[str]], None] | None = None) -> None:
    """Print progress until the controller finishes; restart generators and scorers that die (up to
    max_restarts each); raise WorkerDied if a trainer dies or a worker dies too often. `follow` may add or
    remove workers on each round."""
    bubbles = BubbleMeter(metrics_urls(children))
    progress = ProgressPrinter(out_dir / "metrics.jsonl", total_steps, out, bubbles)
    while True:
        if follow:
            follow(children, out)
            bubbles.urls = metrics_urls(children)
        progress.poll()
        if _controller_finished(children):
            progress.poll()
            return
        for index, child in enumerate(children):
            if child.given_up or child.process.poll() is None or _ended_cleanly(child):
                continue
            if not _restartable(child, children):
                raise WorkerDied(describe_death(child))
            if child.restarts < max_restarts:
                print(f"rlfleet: worker {child.worker.name} exited with code {child.process.returncode}; restarting "
                      f"it ({child.restarts + 1}/{max_restarts}, its log: {child.log_path})", file=out)
                children[index] = restart(child, out_dir)
            else:
                give_up(child, children, out)
        time.sleep(POLL_SECONDS)


def metrics_urls(children: list[Child]) -> dict[str, list[str]]:
    """The executors' metrics, for the bubble line: a controller of its own has none to show (a standby is idle by
    design, a leader busy)."""
    urls: dict[str, list[str]] = {}
    for child in (c for c in children if c.worker.role != "control"):
        urls.setdefault(child.worker.role, []).append(f"http://127.0.0.1:{child.worker.ports['metrics']}/metrics")
    return urls


def _restartable(child: Child, children: list[Child]) -> bool:
    """A trainer is, beside a controller of its own: the leader, its calls failing, ends, and the standby leads on from
    the last checkpoint with the trainer that came back."""
    return child.worker.role in RESTARTABLE or any(c.worker.role == "control" for c in children)


def _controller_finished(children: list[Child]) -> bool:
    """Whether the controller ended the run: a controller of its own exited 0 (a standby that leads a finished run
    ends at once too), else trainer rank 0, which hosts it, did."""
    hosts = [c for c in children if c.worker.role == "control"] or \
        [c for c in children if c.worker.role == "trainer" and c.worker.rank == 0]
    return any(c.process.poll() == 0 for c in hosts)


def _ended_cleanly(child: Child) -> bool:
    """Trainer ranks and controllers exit 0 only at the end: trainer rank 0 or the leading controller when the run
    is done, the other trainer ranks when rank 0 tells them to stop, which can be a moment before rank 0's own
    process has exited (its trackers and servers shut down)."""
    return child.worker.role in ("trainer", "control") and child.process.returncode == 0


def give_up(child: Child, children: list[Child], out: IO[str]) -> None:
    """A generator or scorer past its restarts stays down (a lost node); the run goes on while its role
    has another live replica, as the controller hands its work to them."""
    child.given_up = True
    if all(c.given_up for c in children if c.worker.role == child.worker.role):
        raise WorkerDied(f"every {child.worker.role} is down for good; the last: {describe_death(child)}")
    print(f"rlfleet: worker {child.worker.name} exited with code {child.process.returncode} and has used its "
          f"{child.restarts} restarts; going on without it (its log: {child.log_path})", file=out)


def restart(child: Child, run_dir: Path) -> Child:
    fresh = spawn(child.worker, run_dir)
    fresh.restarts = child.restarts + 1
    return fresh


def describe_death(child: Child) -> str:
    with open(child.log_path, encoding="utf-8", errors="replace") as handle:
        tail = "".join(deque(handle, maxlen=LOG_TAIL_LINES))
    return (f"worker {child.worker.name} exited with code {child.process.returncode}; "
            f"last lines of {child.log_path}:\n{tail}")


def stop(children: list[Child]) -> None:
    """SIGTERM every worker's process group, then SIGKILL what is still there after the grace period."""
    for child in children:
        _signal(child, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(child, signal.SIGKILL)
            child.process.wait()


def _signal(child: Child, signum: int) -> None:
    try:
        os.killpg(child.process.pid, signum)
    except ProcessLookupError:
        pass


class ProgressPrinter:
    """Prints one line per trainer step as metrics.jsonl grows.

    Lines already there when it starts (a resumed run's) are not printed again, nor are the ones a
    resume keeps when it rewrites the file (a new inode: reading starts over, known lines skipped).
    """

    def __init__(self, path: Path, total_steps: int, out: IO[str], bubbles: BubbleMeter | None = None):
        self.path, self.total, self.out = path, total_steps, out
        self.bubbles = bubbles
        self.offset, self.inode = 0, -1
        self.seen = {hash(line) for line in self._new_lines()}

    def poll(self) -> None:
        lines = [line for line in self._new_lines() if hash(line) not in self.seen]
        self.seen.update(hash(line) for line in lines)
        # Bubble ratios since the previous lines were printed (scraped only when there is something new).
        bubbles = self.bubbles.read() if lines and self.bubbles else {}
        for line in lines:
            self.out.write(format_progress(json.loads(line), self.total, bubbles) + "\n")
        self.out.flush()

    def _new_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as handle:
            inode = os.fstat(handle.fileno()).st_ino
            if inode != self.inode:
                self.offset, self.inode = 0, inode
            handle.seek(self.offset)
            lines = handle.readlines()
            if lines and not lines[-1].endswith("\n"):
                lines.pop()
            self.offset += sum(len(line.encode()) for line in lines)
        return lines


def format_progress(record: dict, total: int, bubbles: dict[str, float] | None = None) -> str:
    rate = record["tokens_generated"] / max(record["step_seconds"], 1e-9)
    line = (f"step {record['step']:>5}/{total}  reward {record['reward_mean']:.3f}  "
            f"staleness {record['max_staleness']}  {rate:,.0f} tok/s  "
            f"step {record['step_seconds']:.2f}s  dropped {record['samples_dropped_stale']}")
    if bubbles:
        line += "  bubble " + " ".join(f"{SHORT.get(r, r)} {ratio:.2f}" for r, ratio in sorted(bubbles.items()))
    return line
