"""Helpers of the end-to-end tests: job files made from the built-in job, and `rlfleet` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rlfleet.workers.controller.ledger import OUTCOMES, REFUSED, TOO_LONG, UNFINISHED

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "manifests" / "examples" / "tiny-local.yaml"
RLFLEET = [sys.executable, "-m", "rlfleet.workers.cli"]
PER_STEP = 16  # promptsPerStep of the built-in job


def job_file(tmp_path: Path, name: str, roles: dict | None = None, generation: dict | None = None,
             checkpoint: dict | None = None, spec: dict | None = None, **algorithm) -> Path:
    """The built-in job renamed, with these fields changed (`spec`: other sections, field by field),
    written to tmp_path."""
    job = yaml.safe_load(TINY.read_text())
    job["metadata"]["name"] = name
    job["spec"]["algorithm"].update(algorithm)
    for role, fields in (roles or {}).items():
        job["spec"]["roles"].setdefault(role, {}).update(fields)
    sections = {"generation": generation or {}, "checkpoint": checkpoint or {}} | (spec or {})
    for section, fields in sections.items():
        if isinstance(fields, list):  # a list section (tracking) is replaced whole
            job["spec"][section] = fields
        else:
            job["spec"].setdefault(section, {}).update(fields)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def rlfleet(*args: str, timeout: float = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*RLFLEET, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          cwd=cwd)


def start_rlfleet(*args: str, preexec_fn=None) -> subprocess.Popen:
    return subprocess.Popen([*RLFLEET, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)


def stop(run: subprocess.Popen, grace: float = 60) -> None:
    """End a process a test started: SIGTERM, then SIGKILL after `grace`. On SIGTERM `rlfleet run` stops its workers
    (each has a process group of its own, which a SIGKILL of the run alone leaves running)."""
    if run.poll() is not None:
        return
    run.terminate()
    try:
        run.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        run.kill()
        run.communicate()


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evaluated_as_due(records: list[dict], due: list[int]) -> list[int]:
    """The versions the run's evaluations scored, checked against the versions they were due at: an evaluation runs
    while the next step trains, so it may meet, and name, a newer push, never one as new as the next one due."""
    versions = [r["eval_policy_version"] for r in records if "eval_policy_version" in r]
    bounds = due[1:] + [due[-1] + 1]
    assert len(versions) == len(due) and all(v <= got < nxt for v, got, nxt in zip(due, versions, bounds)), versions
    return versions


def wait_for(condition, seconds: float, what: str = "condition", every: float = 0.2):
    """Poll condition() until it returns something truthy; returns that."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {seconds:.0f} s waiting for {what}"
        time.sleep(every)
    return value


def children_of(pid: int, count: int) -> list[int]:
    """The first `count` child processes of `pid` (the workers of a run), once there are that many."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    wait_for(lambda: len(path.read_text().split()) >= count, 60)
    return [int(child) for child in path.read_text().split()]


def worker_pid(run_pid: int, role: str, rank: int, workers: int) -> int:
    """The process of one worker of a run, found by the environment the planner gave it."""
    for pid in children_of(run_pid, workers):
        environ = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry)
        if environ.get("RLFLEET_ROLE") == role and environ.get("RLFLEET_RANK") == str(rank):
            return pid
    raise AssertionError(f"no {role}-{rank} among the workers of {run_pid}")


def prompts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]


def assert_every_prompt_accounted_once(run_dir: Path, steps: int) -> list[dict]:
    """Every prompt of the stream is written down once, every step trained a whole batch, and the ledger's sample
    counts match the metrics'."""
    written, records = prompts(run_dir), metrics(run_dir)
    positions = sorted(p["prompt"] for p in written)
    assert positions == list(range(len(positions))), "a prompt was lost or written twice"
    assert {p["outcome"] for p in written} <= set(OUTCOMES)
    settled = [p for p in written if p["outcome"] not in (UNFINISHED, TOO_LONG, REFUSED)]
    assert all(sum(p["step"] == s for p in settled) == PER_STEP for s in range(1, steps + 1)), "a batch went missing"
    assert sum(p["samples_trained"] for p in written) == sum(r["samples_trained"] for r in records)
    assert sum(p["samples_stale"] for p in written) == sum(r["samples_dropped_stale"] for r in records)
    return written


def on_a_claim(example: Path, tmp_path: Path) -> Path:
    """The example as a cluster needs it: a local data file (own-task's) moved onto a claim the pods mount, as
    docs/kubernetes.md's steps do; render refuses a data.path on no volume."""
    document = yaml.safe_load(example.read_text())
    data = document["spec"].get("data", {})
    if not str(data.get("path", "/")).startswith("/"):
        data["path"] = "/data/" + Path(data["path"]).name
        document["spec"]["storage"] = {"volumes": [{"name": "data", "claim": "rl-data", "mountPath": "/data"}]}
        example = tmp_path / example.name
        example.write_text(yaml.safe_dump(document))
    return example
