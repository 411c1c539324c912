"""A trainer pod of several ranks (`roles.trainer.ranksPerPod`, by default one per GPU), run by `rlfleet run` as a
pod runs it: one process that starts its ranks (LOCAL_RANK, RANK, WORLD_SIZE as torchrun sets them) and fails
with any of them."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from runs import job_file, metrics, rlfleet, start_rlfleet, stop, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 8


def test_a_pod_of_two_ranks_trains_as_a_world_of_two_and_fails_and_resumes_as_one(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    job = job_file(tmp_path, "pod2", roles={"trainer": {"replicas": 1, "ranksPerPod": 2}}, steps=STEPS,
                   checkpoint={"everySteps": 2, "keep": 5})
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    log = run_dir / "logs" / "pod2-trainer-0.log"
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step-000002").is_dir(), 600, "a checkpoint")
        started = re.search(r"trainer pod started ranks (\d+), (\d+)", log.read_text())
        rank0, rank1 = (int(pid) for pid in started.groups())
        os.kill(rank1, signal.SIGKILL)
        output, _ = run.communicate(timeout=120)
    finally:
        stop(run)
    # The pod failed with its rank (the other, in a broken collective, fails too: either code may be the pod's),
    # and took its other rank down: nothing of it is left running.
    assert run.returncode == 1 and "worker pod2-trainer-0 exited with code" in output, output
    assert not os.path.exists(f"/proc/{rank0}") or "zombie" in open(f"/proc/{rank0}/status").read().lower()

    resumed = rlfleet("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))
    text = log.read_text()
    # Two ranks, one process each, in one world of two with the generator's sync group.
    assert {"trainer-0", "trainer-1"} <= set(re.findall(r" (trainer-\d) ", text))
    assert "joined as rank 1/3" in text and "resuming from" in text
    assert (run_dir / "spans" / "trainer-1.jsonl").is_file()
    targets = json.loads((run_dir / "prometheus-targets.json").read_text())
    assert len(next(t for t in targets if t["labels"]["worker"] == "pod2-trainer-0")["targets"]) == 2
