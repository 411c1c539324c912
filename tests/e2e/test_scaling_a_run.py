"""Generators added to and removed from a running job (`rlfleet scale`, as `kubectl scale rlj` or a pool's replicas in
a cluster): an added one joins with the weights of the moment and generates batches, a removed one's work goes to the
others with nothing lost, and no other worker restarts. The job has two pools, and each scales on its own: the first
grows into its block of indexes (pools.py) while the second's replica keeps its index, then the second shrinks."""

from __future__ import annotations

from datetime import datetime

import pytest
from runs import assert_every_prompt_accounted_once, job_file, metrics, rlfleet, start_rlfleet, stop, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MAX_STALENESS = 1  # the built-in job's
SECOND = 128  # the second pool's first replica: its block's first index


def _makers(record: dict) -> set[int]:
    """The replicas that made part of a step's batch (a batch is split among the replicas by throughput)."""
    return {int(key.split("/")[1]) for key, share in record.items() if key.startswith("generator_share/") and share}


def _replicas(run_dir) -> set[int]:
    return {replica for r in metrics(run_dir) for replica in _makers(r)}


def _logged_at(log: str, message: str) -> float:
    """Unix time of the log line holding `message` (the logs' asctime is local time)."""
    line = next(line for line in log.splitlines() if message in line)
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_generator_added_to_any_pool_mid_run_generates_and_removed_ones_lose_nothing(tmp_path, model_cache):
    run_dir, steps = tmp_path / "run", 160
    # One token a visit, up to 12: a step takes a few tenths of a second, so the run outlasts the start of an
    # added generator (seconds to tens of seconds, with vLLM on a busy machine) by many steps.
    pools = [{"name": "first", "replicas": 1}, {"name": "second", "replicas": 1}]
    job = job_file(tmp_path, "elastic", roles={"generator": {"replicas": 2, "pools": pools}}, steps=steps,
                   generation={"maxNewTokens": 12, "segmentTokens": 1},
                   spec={"scorers": [{"type": "math_answer", "weight": 1.0}], "evaluation": {"everySteps": 0}})
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3, 600, "step 3")
        added = rlfleet("scale", str(run_dir), "--pool", "first", "--generators", "2")
        assert added.returncode == 0, added.stderr
        wait_for(lambda: 1 in _replicas(run_dir) or run.poll() is not None, 300, "a batch from the added generator")
        assert 1 in _replicas(run_dir), "the run ended and the added generator never generated a part of a batch"
        removed = rlfleet("scale", str(run_dir), "--pool", "second", "--generators", "0")
        assert removed.returncode == 0, removed.stderr
        output, _ = run.communicate(timeout=900)
    finally:
        stop(run)
    assert run.returncode == 0, output
    assert "generators 2 -> 3 (added #1, removed none)" in output
    assert "generators 3 -> 2 (added none, removed #128)" in output
    assert "restarting" not in output, "scaling restarted a worker"
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert _replicas(run_dir) == {0, 1, SECOND}, "a replica generated under another index"
    log = (run_dir / "logs" / "elastic-trainer-0.log").read_text()
    # Once the controller left it out, the removed replica claims nothing: what it finished before trains within
    # the staleness window (batches up to the next step + maxStaleness were claimable), nothing later.
    noticed = _logged_at(log, f"generator replica {SECOND} removed from the job")
    removed_at = sum(1 for r in records if r["time"] <= noticed)
    assert removed_at < steps - 10, "the run ended before the removal could be seen"
    late = [r["step"] for r in records if SECOND in _makers(r) and r["step"] > removed_at + 2 + MAX_STALENESS]
    assert not late, f"the removed replica's batches trained at steps {late}, removed after step {removed_at}"
    assert log.count("resuming from") == 0 and "generator replica 1 added to the job" in log
    joined = int(log.split("generator replica 1 rejoined at version ")[1].split()[0])
    first = (run_dir / "logs" / "elastic-generator-1.log").read_text().split("policy version ")[1].split()[0]
    assert first == str(joined), "the added generator generated before it held the current weights"
    assert_every_prompt_accounted_once(run_dir, steps)
