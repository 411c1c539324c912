"""Faults in a real run: workers killed with real signals, and what the run directory shows afterwards.

prompts.jsonl is the proof that nothing was lost: every prompt the run handed out appears once, trained
or dropped for a counted reason, and its counts agree with metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime
from pathlib import Path

import pytest
from runs import job_file, metrics, rlfleet, start_rlfleet, wait_for, worker_pid

from rlfleet.workers.controller.ledger import STALE, TOO_FEW, TRAINED, UNFINISHED

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PER_STEP = 16  # promptsPerStep of the built-in job


def _prompts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]


def _assert_every_prompt_accounted_once(run_dir: Path, steps: int) -> list[dict]:
    prompts, records = _prompts(run_dir), metrics(run_dir)
    positions = sorted(p["prompt"] for p in prompts)
    assert positions == list(range(len(positions))), "a prompt was lost or written twice"
    assert {p["outcome"] for p in prompts} <= {TRAINED, STALE, TOO_FEW, UNFINISHED}
    settled = [p for p in prompts if p["outcome"] != UNFINISHED]
    assert all(sum(p["step"] == s for p in settled) == PER_STEP for s in range(1, steps + 1)), "a batch went missing"
    assert sum(p["samples_trained"] for p in prompts) == sum(r["samples_trained"] for r in records)
    assert sum(p["samples_stale"] for p in prompts) == sum(r["samples_dropped_stale"] for r in records)
    return prompts


def _log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_killed_generator_and_scorer_lose_no_prompt_and_the_run_goes_on(tmp_path, model_cache):
    run_dir, steps = tmp_path / "run", 60
    job = job_file(tmp_path, "genkill", roles={"generator": {"replicas": 2}}, steps=steps)
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 5, 600)
        os.kill(worker_pid(run.pid, "generator", 1, workers=4), signal.SIGKILL)
        wait_for(lambda: len(metrics(run_dir)) >= 10, 600)
        os.kill(worker_pid(run.pid, "scorer", 0, workers=4), signal.SIGKILL)
        output, _ = run.communicate(timeout=900)
    finally:
        run.kill()
    assert run.returncode == 0, output
    assert "genkill-generator-1 exited with code -9; restarting it" in output
    assert "genkill-scorer-0 exited with code -9; restarting it" in output
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    log = (run_dir / "logs" / "genkill-trainer-0.log").read_text().splitlines()
    down = next(line for line in log if "generator replica 1 is down" in line)
    back = next((line for line in log if "generator replica 1 is back" in line), None)
    while_down = [r for r in records if _log_time(down) < r["time"] < (_log_time(back) if back else float("inf"))]
    # More steps than the buffer could hold when it died (maxStaleness 1): the other replica made them.
    assert len(while_down) >= 5, f"only {len(while_down)} steps trained while replica 1 was down"
    assert any("scorer 0 unavailable" in line for line in log), "no Score call waited for the restarted scorer"
    _assert_every_prompt_accounted_once(run_dir, steps)


def test_a_killed_trainer_resumes_with_its_data_position_version_and_partial_rollouts(tmp_path, model_cache):
    run_dir, steps = tmp_path / "run", 20
    # Long completions one token a visit: generation is the slow side (until the model learns to stop
    # early), so the early checkpoints catch it mid-batch.
    job = job_file(tmp_path, "trainkill", generation={"maxNewTokens": 16, "segmentTokens": 1},
                   checkpoint={"everySteps": 2, "keep": 10}, steps=steps)
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step-000006").is_dir() and len(metrics(run_dir)) >= 7, 600)
        os.kill(worker_pid(run.pid, "trainer", 0, workers=3), signal.SIGKILL)
        output, _ = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 1 and "trainkill-trainer-0 exited with code -9" in output, output
    killed_at = len(metrics(run_dir))
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    saved = json.loads((checkpoint / "state.json").read_text())
    step = saved["step"]
    assert step < killed_at, "the kill should come after steps the checkpoint does not hold"

    refused = rlfleet("run", str(job), "--out", str(run_dir))
    assert refused.returncode != 0 and f"rlfleet run --resume {run_dir}" in refused.stderr

    resumed = rlfleet("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[step]["policy_version"] == step + 1
    log = (run_dir / "logs" / "trainkill-trainer-0.log").read_text()
    assert (f"resuming from {checkpoint}: step {step}, data position {step * PER_STEP}, "
            f"{len(saved['in_flight'])} prompts in flight restored") in log
    # Partial rollouts are saved with their tokens: some checkpoint caught a sequence half generated.
    states = [json.loads((c / "state.json").read_text()) for c in (run_dir / "checkpoints").glob("step-*")]
    assert any(0 < len(r["completion_ids"]) and not r["finished"]
               for s in states for g in s["in_flight"] for r in g["rollouts"]), "no partial rollout was saved"
    prompts = _assert_every_prompt_accounted_once(run_dir, steps)
    settled_after = {p["prompt"]: p["step"] for p in prompts}
    assert all(settled_after[g["position"]] > step for g in saved["in_flight"]), "restored prompts were not finished"
