"""Faults in a real run: workers killed with real signals, and what the run directory shows afterwards.

prompts.jsonl is the proof that nothing was lost: every prompt the run handed out appears once, trained
or dropped for a counted reason, and its counts agree with metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from runs import (
    PER_STEP,
    TINY,
    assert_every_prompt_accounted_once,
    children_of,
    job_file,
    metrics,
    rlfleet,
    start_rlfleet,
    stop,
    wait_for,
    worker_pid,
)

from rlfleet.workers.controller.ledger import TOO_LONG

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SCORER_FROZEN_SECONDS = 15  # many batches' generation: some producer is then waiting on Score


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
        # Frozen first, so that a Score call is surely in flight when it dies: a quick restart between two
        # calls would otherwise go unseen.
        scorer = worker_pid(run.pid, "scorer", 0, workers=4)
        os.kill(scorer, signal.SIGSTOP)
        time.sleep(SCORER_FROZEN_SECONDS)
        os.kill(scorer, signal.SIGKILL)
        output, _ = run.communicate(timeout=900)
    finally:
        stop(run)
    assert run.returncode == 0, output
    assert "genkill-generator-1 exited with code -9; restarting it" in output
    assert "genkill-scorer-0 exited with code -9; restarting it" in output
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    log = (run_dir / "logs" / "genkill-trainer-0.log").read_text().splitlines()
    down = next(i for i, line in enumerate(log) if "generator replica 1 is down" in line)
    back = next((line for line in log[down:] if "generator replica 1 rejoined" in line), None)
    assert back is not None, "the restarted replica never rejoined"
    # Training going on without a replica is test_a_generator_lost_for_good_stalls_nothing's; here the
    # restarted one must come back with the weights of the moment, before it generates again.
    version = int(back.rsplit(" ", 1)[1])
    restarted = (run_dir / "logs" / "genkill-generator-1.log").read_text().split("generator 1 serving")[-1]
    first_version = restarted.split("policy version ")[1].split()[0]
    assert first_version == str(version), "the rejoined replica's first weights were not the current version"
    assert any("Score on the scorers on replica 0 failed" in line for line in log), \
        "no Score call waited for the restarted scorer"
    assert_every_prompt_accounted_once(run_dir, steps)


@pytest.mark.parametrize("training", [{}, {"lora": {"rank": 4}}], ids=["full", "lora"])
def test_a_killed_trainer_resumes_with_its_data_position_version_and_partial_rollouts(training, tmp_path, model_cache):
    run_dir, steps = tmp_path / "run", 20
    # Generation must be the slow side, so that checkpoints catch it mid-batch: long completions one token a visit
    # (each visit costs a round trip whatever the batch), few samples to train (groupSize 2), and no format reward
    # (it teaches the model to stop after a digit or two). With the built-in job's 8 samples per prompt and its
    # format reward the trainer was the slow side now and then, and no checkpoint held a partial rollout (2 runs
    # of 8). With LoRA the checkpoints hold only adapters.
    job = job_file(tmp_path, "trainkill", generation={"maxNewTokens": 16, "segmentTokens": 1},
                   checkpoint={"everySteps": 2, "keep": 10}, steps=steps, groupSize=2,
                   spec={"training": training, "scorers": [{"type": "math_answer"}]})
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    try:
        # An odd step: the newest checkpoint (every 2 steps) lacks at least that one.
        wait_for(lambda: (run_dir / "checkpoints" / "step-000006").is_dir() and _odd_past(len(metrics(run_dir)), 7),
                 600)
        os.kill(worker_pid(run.pid, "trainer", 0, workers=3), signal.SIGKILL)
        output, _ = run.communicate(timeout=120)
    finally:
        stop(run)
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
    assert any(0 < sum(len(t["token_ids"]) for t in r["turns"]) and not r["finished"]
               for s in states for g in s["in_flight"] for r in g["rollouts"]), "no partial rollout was saved"
    prompts = assert_every_prompt_accounted_once(run_dir, steps)
    settled_after = {p["prompt"]: p["step"] for p in prompts}
    assert all(settled_after[g["position"]] > step for g in saved["in_flight"]), "restored prompts were not finished"


def _odd_past(count: int, least: int) -> bool:
    return count >= least and count % 2 == 1


def _log_lines(run_dir: Path, worker: str) -> list[str]:
    return (run_dir / "logs" / f"{worker}.log").read_text().splitlines()


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_a_generator_lost_for_good_stalls_nothing(max_staleness, tmp_path, model_cache):
    """One of two generators is killed and never restarted (a lost node): the other takes every batch,
    the one it held included, and the run reaches its last step."""
    run_dir, steps = tmp_path / "run", 30
    job = job_file(tmp_path, "lost", roles={"generator": {"replicas": 2}}, spec={"failurePolicy": {"maxRestarts": 0}},
                   maxStaleness=max_staleness, steps=steps)
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3, 600)
        os.kill(worker_pid(run.pid, "generator", 1, workers=4), signal.SIGKILL)
        killed_at = len(metrics(run_dir))
        output, _ = run.communicate(timeout=600)
    finally:
        stop(run)
    assert run.returncode == 0, output
    assert "lost-generator-1 exited with code -9 and has used its 0 restarts; going on without it" in output
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))
    assert steps - killed_at >= 20, "the kill came too late to prove anything"
    assert not any("generator replica 1 rejoined" in line for line in _log_lines(run_dir, "lost-trainer-0"))
    assert_every_prompt_accounted_once(run_dir, steps)


def _generating(metrics_port: int) -> bool:
    """Whether the generator is inside a Generate call now (its in-progress gauge)."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
    return any(line.startswith('rlfleet_queue_depth{') and 'queue="generate_requests"' in line
               and float(line.rsplit(" ", 1)[1]) >= 1 for line in page.splitlines())


def _metrics_port(pid: int) -> int:
    environ = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
    return int(environ["RLFLEET_METRICS_PORT"])


def test_a_generator_stopped_mid_generate_misses_its_deadline_and_rejoins_when_resumed(tmp_path, model_cache):
    """SIGSTOP while a Generate call runs (a hung GPU): the call it holds fails by its deadline, the
    batch goes to the other replica, training goes on; after SIGCONT the replica rejoins."""
    run_dir, steps, deadline, push_deadline = tmp_path / "run", 60, 4, 5
    # Long completions, so a scrape that finds a call in progress is followed by the stop while it still runs.
    job = job_file(tmp_path, "hung", roles={"generator": {"replicas": 2}},
                   generation={"maxNewTokens": 24, "timeoutSeconds": deadline},
                   spec={"weightSync": {"timeoutSeconds": push_deadline}}, steps=steps)
    run = start_rlfleet("run", str(job), "--out", str(run_dir))
    stopped = None
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3, 600)
        stopped = worker_pid(run.pid, "generator", 1, workers=4)
        port = _metrics_port(stopped)
        wait_for(lambda: _generating(port), 60)
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.time()
        wait_for(lambda: len([r for r in metrics(run_dir) if r["time"] > stopped_at + deadline + 5]) >= 5, 300)
        os.kill(stopped, signal.SIGCONT)
        output, _ = run.communicate(timeout=600)
    finally:
        if stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)  # a stopped process ignores SIGTERM until continued
        stop(run)
    assert run.returncode == 0, output
    log = _log_lines(run_dir, "hung-trainer-0")
    down = next(line for line in log if "generator replica 1 is down" in line)
    # Whichever call the stopped replica held reaches its deadline first marks it down: the Generate call (4 s) or,
    # when one was under way, a weight push (weightSync.timeoutSeconds, 5 s).
    assert re.search(r"(Generate failed|weight push failed): DEADLINE_EXCEEDED", down), down
    assert _log_time(down) - stopped_at < max(deadline, push_deadline) + 3, "the call was not cut at its deadline"
    assert any("generator replica 1 rejoined" in line for line in log), "the resumed replica never rejoined"
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))
    assert_every_prompt_accounted_once(run_dir, steps)


def test_prompts_longer_than_the_model_are_filtered_counted_and_the_run_goes_on(tmp_path, model_cache):
    """JSONL data with prompts over the generators' budget (the tiny model has 512 positions)."""
    data, steps = tmp_path / "data.jsonl", 6
    lines = [{"prompt": f"{n % 10}+{n // 10}=", "answer": str(n % 10 + n // 10)} for n in range(40)]
    for n in (3, 17, 30):
        lines[n]["prompt"] = "1+" * 300 + "1="  # 602 characters, one token each
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = yaml.safe_load(TINY.read_text())
    job["metadata"]["name"] = "overlong"
    job["spec"]["data"] = {"type": "jsonl", "path": str(data)}
    job["spec"]["evaluation"] = {"everySteps": 0}  # the data has no held-out prompts
    job["spec"]["algorithm"]["steps"] = steps
    path = tmp_path / "overlong.yaml"
    path.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    result = rlfleet("run", str(path), "--out", str(run_dir), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    prompts = assert_every_prompt_accounted_once(run_dir, steps)
    too_long = sorted(p["prompt"] for p in prompts if p["outcome"] == TOO_LONG)
    # Training cycles over the data: positions 3, 17, 30 of each pass are the long ones.
    assert too_long and all(p % 40 in (3, 17, 30) for p in too_long)
    assert sum(r["prompts_too_long"] for r in metrics(run_dir)) == len(too_long)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_run_stops_every_worker(signum, tmp_path, model_cache):
    """Ctrl-C, and the SIGTERM or SIGHUP that systemd, CI runners and `timeout` send, alike; also when started
    with the signal ignored, as a script's background job (`cmd &`) inherits SIGINT."""
    run = start_rlfleet("run", str(job_file(tmp_path, "stopme", steps=100000)), "--out", str(tmp_path / "run"),
                        preexec_fn=lambda: signal.signal(signum, signal.SIG_IGN))
    children: list[int] = []
    try:
        children += children_of(run.pid, count=3)
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), 300)
        run.send_signal(signum)
        output, _ = run.communicate(timeout=60)
    finally:
        run.kill()
        survivors = [pid for pid in children if _alive(pid)]
        for pid in survivors:  # a failed run must not leave its workers to the next tests
            os.kill(pid, signal.SIGKILL)
    assert run.returncode == 128 + signum, output
    assert "stopping every worker" in output
    assert not survivors, "workers survived the signal"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"
