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
from typing import IO

from rlfleet.workers.auth import ensure_token_file
from rlfleet.workers.metrics.scrape import BubbleMeter
from rlfleet.workers.plan import METRICS_PORTS_ENV, Worker, local_endpoints, local_ports, plan_workers
from rlfleet.workers.spec import RLJob

POLL_SECONDS = 0.5
# Prometheus file_sd targets of every worker's metrics port: point a local Prometheus at it.
TARGETS_FILE = "prometheus-targets.json"
# The job as the run started it: `rlfleet run --resume` reads it back.
CONFIG_FILE = "config.json"
SHORT = {"generator": "gen", "scorer": "score", "trainer": "train"}
# Generators and scorers come back like a StatefulSet's pods; the controller rejoins them.
RESTARTABLE = ("generator", "scorer")
STOP_GRACE_SECONDS = 10.0
# Besides SIGINT (KeyboardInterrupt), the signals that ask a program to end.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)
LOG_TAIL_LINES = 20


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
    job = with_absolute_paths(job)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    config_path = out_dir / CONFIG_FILE
    config_path.write_text(json.dumps(job.to_dict(), indent=2))
    children: list[Child] = []
    handlers = {signum: signal.signal(signum, _terminated) for signum in TERMINATING}
    # Explicitly: a script's background job (`rlfleet run ... &`) starts with SIGINT ignored.
    handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        children += start_workers(job, out_dir, config_path, ensure_token_file(out_dir))
        watch(children, out_dir, job.spec.algorithm.steps, job.spec.failure_policy.max_restarts, out)
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
    """Workers run in the run directory: file paths in the job are taken from where `rlfleet run` ran."""
    spec = job.spec
    for section in ("data", "model"):
        source = getattr(spec, section)
        if getattr(source, "path", None):  # a jsonl file or hf directory, not a URI
            absolute = source.model_copy(update={"path": os.path.abspath(source.path)})
            spec = spec.model_copy(update={section: absolute})
    return job.model_copy(update={"spec": spec})


def start_workers(job: RLJob, out_dir: Path, config_path: Path, token_file: Path) -> list[Child]:
    ports = local_ports(job)
    workers = plan_workers(job, local_endpoints(job, ports), str(config_path), str(out_dir), str(token_file),
                           ports=lambda role, rank: ports[(role, rank)])
    write_targets(workers, out_dir / TARGETS_FILE)
    return [spawn(worker, out_dir) for worker in workers]


def write_targets(workers: list[Worker], path: Path) -> None:
    """Prometheus file targets: each worker's metrics port, each rank's in a trainer pod of several."""
    targets = [{"targets": [f"127.0.0.1:{port}" for port in metrics_ports(w)], "labels": {"worker": w.name}}
               for w in workers]
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(targets, indent=2))
    temporary.replace(path)  # Prometheus watches the file: never let it read half of one


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


def watch(children: list[Child], out_dir: Path, total_steps: int, max_restarts: int, out: IO[str]) -> None:
    """Print progress until the controller finishes; restart generators and scorers that die (up to
    max_restarts each); raise WorkerDied if a trainer dies or a worker dies too often."""
    controller = next(c for c in children if c.worker.role == "trainer" and c.worker.rank == 0)
    urls: dict[str, list[str]] = {}
    for child in children:
        urls.setdefault(child.worker.role, []).append(f"http://127.0.0.1:{child.worker.ports['metrics']}/metrics")
    progress = ProgressPrinter(out_dir / "metrics.jsonl", total_steps, out, BubbleMeter(urls))
    while True:
        progress.poll()
        if controller.process.poll() == 0:
            progress.poll()
            return
        for index, child in enumerate(children):
            if child.given_up or child.process.poll() is None or _ended_cleanly(child):
                continue
            if child.worker.role not in RESTARTABLE:
                raise WorkerDied(describe_death(child))
            if child.restarts < max_restarts:
                print(f"rlfleet: worker {child.worker.name} exited with code {child.process.returncode}; restarting "
                      f"it ({child.restarts + 1}/{max_restarts}, its log: {child.log_path})", file=out)
                children[index] = restart(child, out_dir)
            else:
                give_up(child, children, out)
        time.sleep(POLL_SECONDS)


def _ended_cleanly(child: Child) -> bool:
    """Trainer ranks exit 0 only at the end: rank 0 when the run is done, the others when rank 0 tells them to
    stop, which can be a moment before rank 0's own process has exited (its trackers and servers shut down)."""
    return child.worker.role == "trainer" and child.process.returncode == 0


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
