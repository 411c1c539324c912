"""End-to-end: `rlfleet run` on the built-in job, as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "manifests" / "examples" / "tiny-local.yaml"
FIELDS = {"step", "policy_version", "reward_mean", "max_staleness", "step_seconds", "generator_busy_seconds",
          "generator_idle_seconds", "trainer_busy_seconds", "trainer_idle_seconds", "tokens_generated",
          "samples_trained", "samples_dropped_stale"}


def _job(tmp_path: Path, name: str, roles: dict | None = None, generation: dict | None = None,
         **algorithm) -> Path:
    job = yaml.safe_load(TINY.read_text())
    job["metadata"]["name"] = name
    job["spec"]["algorithm"].update(algorithm)
    for role, fields in (roles or {}).items():
        job["spec"]["roles"][role].update(fields)
    job["spec"]["generation"].update(generation or {})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _rlfleet(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.workers.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_builtin_job_learns_within_its_staleness_bound(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    result = _rlfleet("run", str(TINY), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    records = _metrics(run_dir)
    bound = yaml.safe_load(TINY.read_text())["spec"]["algorithm"]["maxStaleness"]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert all(FIELDS <= r.keys() for r in records)
    assert max(r["max_staleness"] for r in records) <= bound
    assert max(r["max_staleness"] for r in records) == bound, "asynchronous run never overlapped"
    fifth = len(records) // 5
    first = statistics.mean(r["reward_mean"] for r in records[:fifth])
    last = statistics.mean(r["reward_mean"] for r in records[-fifth:])
    assert last >= first + 0.05, f"reward did not improve: first fifth {first:.3f}, last fifth {last:.3f}"
    assert json.loads((run_dir / "config.json").read_text())["metadata"]["name"] == "tiny-local"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == f"step-{len(records):06d}"
    assert "reward" in result.stdout and "tok/s" in result.stdout


def test_synchronous_baseline_never_trains_stale_rollouts(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    result = _rlfleet("run", str(_job(tmp_path, "sync", maxStaleness=0, steps=15)), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    records = _metrics(run_dir)
    assert len(records) == 15
    assert all(r["max_staleness"] == 0 and r["samples_dropped_stale"] == 0 for r in records)
    assert all(r["samples_trained"] == 16 * 8 for r in records)


def test_two_generators_two_trainers_and_partial_rollouts(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    job = _job(tmp_path, "wide", roles={"generator": {"replicas": 2}, "trainer": {"replicas": 2}},
               generation={"segmentTokens": 1}, steps=12)
    result = _rlfleet("run", str(job), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    records = _metrics(run_dir)
    assert len(records) == 12 and max(r["max_staleness"] for r in records) <= 1
    assert all(r["segments"] >= 2 for r in records), "maxNewTokens 3 in segments of 1 takes several visits"
    assert sum(r["resumed_sequences"] for r in records) > 0
    logs = {p.name: p.read_text() for p in (run_dir / "logs").iterdir()}
    assert all("policy version 12 received" in logs[f"wide-generator-{g}.log"] for g in (0, 1))


def test_a_rerun_resumes_from_the_last_checkpoint(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    first = _job(tmp_path, "again", steps=6)
    text = first.read_text().replace("everySteps: 50", "everySteps: 3")
    first.write_text(text)
    assert _rlfleet("run", str(first), "--out", str(run_dir)).returncode == 0
    longer = tmp_path / "longer.yaml"
    longer.write_text(text.replace("steps: 6", "steps: 9"))
    result = _rlfleet("run", str(longer), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, 10))
    log = (run_dir / "logs" / "again-trainer-0.log").read_text()
    assert "resuming from" in log and "step-000006" in log
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step-000009"


def test_a_dying_worker_fails_the_run_and_names_it(tmp_path, model_cache):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    job = yaml.safe_load(TINY.read_text())
    job["metadata"]["name"] = "broken"
    job["spec"]["data"] = {"type": "jsonl", "path": str(data)}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(job))
    result = _rlfleet("run", str(path), "--out", str(tmp_path / "run"), timeout=300)
    assert result.returncode == 1
    assert "worker broken-trainer-0 exited with code" in result.stdout
    assert "line 2" in result.stdout, "the message should carry the worker's last log lines"


def test_ctrl_c_stops_every_worker(tmp_path, model_cache):
    run = subprocess.Popen([sys.executable, "-m", "rlfleet.workers.cli", "run", str(_job(tmp_path, "stopme", steps=100000)),
                            "--out", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        children = _wait_for_children(run.pid, count=3)
        _wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), 300)
        run.send_signal(signal.SIGINT)
        output, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, output
    assert "interrupted" in output
    assert not [pid for pid in children if _alive(pid)], "workers survived Ctrl-C"


def _wait_for_children(pid: int, count: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    _wait_for(lambda: len(path.read_text().split()) >= count, 60)
    return [int(child) for child in path.read_text().split()]


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"
