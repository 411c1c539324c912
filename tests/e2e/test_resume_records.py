"""A resumed run keeps every record: a held-out result of weights up to the checkpoint's, which the killed run wrote
into a record of a later step, is in the resumed run's metrics.jsonl, the lost steps' lines are in
metrics.superseded.jsonl, and TensorBoard holds each step once, with metrics.jsonl's values."""

from __future__ import annotations

import json
import os
import signal

import pytest
from runs import job_file, metrics, rlfleet, start_rlfleet, stop, wait_for, worker_pid

from rlfleet.workers.trainer.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS, CHECKPOINT_EVERY = 12, 4


def _result_after_checkpoint(run_dir, run) -> bool:
    """A record after the newest checkpoint holds the result of a version up to it (no step trains it again)."""
    assert run.poll() is None, f"the run ended first: {run.communicate()[0][-3000:]}"
    if not (run_dir / "metrics.jsonl").is_file():
        return False
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    step = int(checkpoint.name.removeprefix("step-")) if checkpoint else 0
    return step > 0 and any(r["step"] > step and r.get("eval_policy_version", step + 1) <= step
                            for r in metrics(run_dir))


def test_a_resumed_run_keeps_the_held_out_result_and_tensorboard_holds_each_step_once(tmp_path, model_cache):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    # Generation one token a visit: steps of a second or so, so that the kill lands before the next checkpoint.
    job = job_file(tmp_path, "resumerec", generation={"maxNewTokens": 16, "segmentTokens": 1},
                   checkpoint={"everySteps": CHECKPOINT_EVERY, "keep": 10}, steps=STEPS,
                   spec={"evaluation": {"everySteps": 2}, "tracking": [{"type": "tensorboard"}]})
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    try:
        wait_for(lambda: _result_after_checkpoint(run_dir, run), 600,
                 "a held-out result recorded after its checkpoint")
        os.kill(worker_pid(run.pid, "trainer", 0, workers=3), signal.SIGKILL)
        run.communicate(timeout=120)
    finally:
        stop(run)
    step = int(latest_checkpoint(run_dir / "checkpoints").name.removeprefix("step-"))
    lost = metrics(run_dir)[step:]
    held = next(r for r in lost if r.get("eval_policy_version", step + 1) <= step)

    resumed = rlfleet("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    superseded = [json.loads(line) for line in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == lost
    kept = [r for r in records if r.get("eval_policy_version") == held["eval_policy_version"]]
    assert len(kept) == 1 and kept[0]["eval_accuracy"] == held["eval_accuracy"], "the result was lost or redone"
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in records]
    scored = {(r["eval_policy_version"], round(r["eval_accuracy"], 6)) for r in records if "eval_accuracy" in r}
    assert {(e.step, round(e.value, 6)) for e in events.Scalars("eval_accuracy")} == scored
