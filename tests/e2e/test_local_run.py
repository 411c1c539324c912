"""End-to-end: `rlfleet run` on the built-in job, as a user runs it."""

from __future__ import annotations

import json
import re
import statistics

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlfleet.workers.trainer.config import CosineSchedule
from rlfleet.workers.trainer.schedule import lr_factor

from runs import TINY, evaluated_as_due, job_file, metrics, rlfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# max_staleness covers every sample of the step's batch, trained or dropped: with none dropped and the whole
# batch trained, `max_staleness <= bound` is a statement about every sample the run produced.
FIELDS = {"step", "policy_version", "reward_mean", "max_staleness", "step_seconds", "generator_busy_seconds",
          "generator_idle_seconds", "trainer_busy_seconds", "trainer_idle_seconds", "tokens_generated",
          "samples_trained", "samples_dropped_stale"}


def test_builtin_job_learns_within_its_staleness_bound(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    result = rlfleet("run", str(TINY), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    records = metrics(run_dir)
    bound = yaml.safe_load(TINY.read_text())["spec"]["algorithm"]["maxStaleness"]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert all(FIELDS <= r.keys() for r in records)
    assert all(r["samples_dropped_stale"] == 0 and r["samples_trained"] == 16 * 8 for r in records)
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
    result = rlfleet("run", str(job_file(tmp_path, "sync", maxStaleness=0, steps=15)), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    records = metrics(run_dir)
    assert len(records) == 15
    assert all(r["max_staleness"] == 0 and r["samples_dropped_stale"] == 0 for r in records)
    assert all(r["samples_trained"] == 16 * 8 for r in records)


def test_two_generators_two_trainers_lora_partial_rollouts_and_evaluation(tmp_path, model_cache):
    """LoRA adapters from two FSDP ranks to two vLLM generators, which merge them, with partial rollouts and the
    held-out set scored in the loop; the best checkpoint holds adapters that `rlfleet merge` makes a full model.
    The job's learning-rate schedule and TensorBoard tracking reach the trainer and the run directory."""
    run_dir = tmp_path / "run"
    schedule = {"type": "cosine", "warmupSteps": 3, "minRatio": 0.2}
    job = job_file(tmp_path, "wide", roles={"generator": {"replicas": 2}, "trainer": {"replicas": 2}},
                   generation={"segmentTokens": 1}, steps=12,
                   spec={"training": {"lora": {"rank": 4}, "lrSchedule": schedule}, "evaluation": {"everySteps": 5},
                         "tracking": [{"type": "tensorboard"}]})
    result = rlfleet("run", str(job), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    records = metrics(run_dir)
    assert len(records) == 12 and max(r["max_staleness"] for r in records) <= 1
    assert all(r["samples_dropped_stale"] == 0 and r["samples_trained"] == 16 * 8 for r in records)
    assert all(r["segments"] >= 2 for r in records), "maxNewTokens 3 in segments of 1 takes several visits"
    assert sum(r["resumed_sequences"] for r in records) > 0
    logs = {p.name: p.read_text() for p in (run_dir / "logs").iterdir()}
    assert all("policy version 12 received" in logs[f"wide-generator-{g}.log"] for g in (0, 1))
    scored = [r for r in records if "eval_accuracy" in r]
    due = [0, 5, 10, 12]  # before training, every 5 steps, the last (docs/algorithms.md: a newer push may serve it)
    evaluated_as_due(records, due)
    assert all(r["eval_total"] == 20 for r in scored)
    # Graded by the job's scorer executor with both its scorers, weighted as in training.
    assert all(r["eval_accuracy"] == r["eval_scorer/math_answer"] and r["eval_reward_mean"] == pytest.approx(
        r["eval_scorer/math_answer"] + 0.1 * r["eval_scorer/regex_format"]) for r in scored)
    best = run_dir / "checkpoints" / "best"
    state = json.loads((best / "state.json").read_text())
    # Only a version scored on its own snapshot's weights may become the best.
    assert state["eval_accuracy"] == max(r["eval_accuracy"] for r in scored if r["eval_policy_version"] in due)
    assert (best / "adapter_model.safetensors").is_file() and not (best / "model.safetensors").exists()
    merged = rlfleet("merge", str(run_dir / "checkpoints" / "step-000012"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stdout + merged.stderr
    assert (tmp_path / "merged" / "model.safetensors").is_file() and (tmp_path / "merged" / "tokenizer.json").is_file()
    peak = yaml.safe_load(TINY.read_text())["spec"]["algorithm"]["learningRate"]
    expected = [peak * lr_factor(CosineSchedule(warmup_steps=3, min_ratio=0.2), step, 12) for step in range(12)]
    assert [r["learning_rate"] for r in records] == pytest.approx(expected)
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in records]
    assert [e.step for e in events.Scalars("eval_accuracy")] == [r["eval_policy_version"] for r in scored]


def test_a_bfloat16_job_trains_in_bfloat16_and_every_push_reaches_the_generator_intact(tmp_path, model_cache):
    """`model.dtype: bfloat16` on a CPU: the trainer's forward and the weight push in bfloat16, into a vLLM generator
    that runs bfloat16, every version checked by content (`weightSync.verify`)."""
    run_dir = tmp_path / "run"
    job = job_file(tmp_path, "bf16", steps=4, spec={"model": {"dtype": "bfloat16"}, "weightSync": {"verify": True}})
    result = rlfleet("run", str(job), "--out", str(run_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    records = metrics(run_dir)
    assert len(records) == 4 and all(r["samples_trained"] == 16 * 8 for r in records)
    logs = {p.name: p.read_text() for p in (run_dir / "logs").iterdir()}
    assert "forward in bfloat16 (model.dtype: bfloat16)" in logs["bf16-trainer-0.log"]
    assert "dtype': 'bfloat16'" in logs["bf16-generator-0.log"], "vLLM should run the job's dtype"
    assert "policy version 4 received" in logs["bf16-generator-0.log"], "each version is received once verified"


def test_a_dying_worker_fails_the_run_and_names_it(tmp_path, model_cache):
    """A model whose weights file is not safetensors passes every check made before the workers start (its config is
    sound; rlfleet run opens the data, not the weights): the first worker to load it dies, and the run says which,
    with its last log lines."""
    import shutil

    from rlfleet.workers.models import materialize
    from rlfleet.workers.models.config import TinyModel

    model = tmp_path / "model"
    shutil.copytree(materialize(TinyModel(hidden_size=128, num_heads=4, num_layers=2, intermediate_size=256),
                                model_cache), model)
    (model / "model.safetensors").write_bytes(b"not safetensors")
    job = yaml.safe_load(TINY.read_text())
    job["metadata"]["name"] = "broken"
    job["spec"]["model"] = {"type": "hf", "path": str(model)}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(job))
    result = rlfleet("run", str(path), "--out", str(tmp_path / "run"), timeout=300)
    assert result.returncode == 1
    assert re.search(r"worker broken-(trainer|generator|scorer)-0 exited with code", result.stdout), result.stdout
    assert "deserializing header" in result.stdout, "the message should carry the worker's last log lines"
