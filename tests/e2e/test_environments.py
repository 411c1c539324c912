"""The environment examples run locally end to end, as their headers say to run them (from the repository): the tiny
tool job, an environment of your own (guess the number) and an agent written against the `openai` client; each
renders for Kubernetes with its environment's pods closed to the outside."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runs import ROOT, evaluated_as_due, metrics, on_a_claim, rlfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLES = ROOT / "manifests" / "examples"


def run_example(name: str, tmp_path: Path, steps: int) -> list[dict]:
    job = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    job["spec"]["algorithm"]["steps"] = steps
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    result = rlfleet("run", str(path), "--out", str(tmp_path / "run"), timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return rows


def test_the_tiny_tool_job_counts_its_turns_and_tools(tmp_path, model_cache):
    rows = run_example("tiny-tools", tmp_path, steps=4)
    for row in rows:  # its random policy writes no call: an episode is one turn, and nothing failed
        assert row["turns_mean"] == 1.0 and row["tool_calls"] == row["tool_errors"] == 0
        assert row["environment_errors"] == 0 and row["samples_trained"] == 16


def test_an_environment_of_your_own_plays_several_turns(tmp_path, model_cache):
    rows = run_example("tiny-guess", tmp_path, steps=4)
    assert min(row["turns_mean"] for row in rows) > 1.0  # wrong guesses get "higher" or "lower" and guess again
    assert all(row["environment_errors"] == 0 and row["samples_dropped_stale"] == 0 for row in rows)
    # The held-out numbers are played as episodes too, greedily, before training and after the last step (the
    # random policy's greedy guess runs on past maxNewTokens: one turn each, cut).
    evaluated = [row for row in rows if "eval_turns_mean" in row]
    evaluated_as_due(evaluated, [0, 4])
    for row in evaluated:
        assert row["eval_total"] == 20 and row["eval_turns_mean"] >= 1.0
        assert row["eval_episodes_truncated"] + row["eval_environment_errors"] <= 20


def test_an_openai_agent_trains_through_the_endpoint(tmp_path, model_cache):
    rows = run_example("tiny-agent", tmp_path, steps=3)
    for row in rows:  # two chat calls an episode, each a turn of the policy, every one trained
        assert row["turns_mean"] == 2.0 and row["environment_errors"] == 0
        assert row["samples_trained"] == 16 and row["tokens_generated"] > 0


@pytest.mark.parametrize("name", ["tiny-tools", "tiny-guess", "tiny-agent", "smollm2-tools"])
def test_an_environment_job_renders_with_its_pods_closed_to_the_outside(name, tmp_path):
    result = rlfleet("render", str(on_a_claim(EXAMPLES / f"{name}.yaml", tmp_path)), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("StatefulSet", f"{name}-env") in names and ("NetworkPolicy", f"{name}-env-egress") in names
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    environment = yaml.safe_load(config["data"]["job.json"])["spec"]["roles"]["environment"]
    assert environment.get("source") or environment["type"] == "tools"  # a file of the job's travels in it
