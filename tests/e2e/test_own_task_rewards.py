"""The own-task example runs to its end: a user's JSONL data and reward file (named components, a function that
raises on some completions, one that hangs on some prompts), every failure scored 0 and counted by reason, the run
never stopped for one; the same job renders for Kubernetes with the file in its ConfigMap."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from runs import ROOT, metrics, on_a_claim, rlfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLE = "manifests/examples/own-task.yaml"
REWARDS = ROOT / "manifests" / "examples" / "own-task" / "rewards.py"
STEPS = 12


def test_the_own_task_example_runs_to_the_end_with_every_failure_counted(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    # As its header says: from the repository root, where its relative paths point.
    result = rlfleet("run", EXAMPLE, "--out", str(run_dir), timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    failures = Counter()
    for row in rows:
        counted = {key: value for key, value in row.items() if key.startswith("scorer_failures/")}
        assert sum(counted.values()) == row["scorer_errors"], row
        failures.update(counted)
        # Each scorer's own mean, and the components of `score` (the job has three python scorers: prefixed).
        assert {"scorer/score", "scorer/strict", "scorer/slow"} <= row.keys()
        parts = [row[f"reward/score/{name}"] for name in ("correct", "carry_bonus", "length")]
        assert sum(parts) == pytest.approx(row["scorer/score"])
    # `strict` raises on completions without a number; `slow` hangs on the prompts with a 9 (11 of the first 48).
    assert failures["scorer_failures/raised"] > 0 and failures["scorer_failures/timeout"] >= 4, failures
    assert set(failures) <= {"scorer_failures/raised", "scorer_failures/timeout"}, failures
    # The run's config holds the code it ran, for a resume.
    config = json.loads((run_dir / "config.json").read_text())
    assert all(s["source"] == REWARDS.read_text() for s in config["spec"]["scorers"])


def test_the_own_task_example_renders_with_its_reward_file_in_the_configmap(tmp_path):
    # Its data on a claim, as docs/kubernetes.md's steps put it: render refuses a data.path on no volume.
    result = rlfleet("render", str(on_a_claim(ROOT / EXAMPLE, tmp_path)), timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    [configmap] = [o for o in yaml.safe_load_all(result.stdout) if o["kind"] == "ConfigMap"]
    job = json.loads(configmap["data"]["job.json"])
    assert [s["source"] for s in job["spec"]["scorers"]] == [REWARDS.read_text()] * 3
    assert Path(job["spec"]["scorers"][0]["path"]).name == "rewards.py"
