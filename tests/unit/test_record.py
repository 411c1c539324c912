"""metrics.jsonl and prompts.jsonl on a resume: each step appears once."""

from __future__ import annotations

import json

import pytest

from rlfleet.workers.controller.record import METRICS_FILE, append_metrics, keep_lines_until, superseded_path


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    for step in range(1, 8):
        append_metrics(tmp_path, {"step": step, "reward_mean": 0.0, "max_staleness": 0})
    keep_lines_until(tmp_path / METRICS_FILE, 5)
    assert _steps(tmp_path / METRICS_FILE) == [1, 2, 3, 4, 5]
    append_metrics(tmp_path, {"step": 6, "reward_mean": 0.0, "max_staleness": 0})
    assert _steps(tmp_path / METRICS_FILE) == [1, 2, 3, 4, 5, 6]


def test_the_lines_a_resume_drops_move_to_a_side_file_and_come_back_to_the_caller(tmp_path):
    """The held-out result a later record held is the caller's to keep; what the lost steps recorded stays on disk,
    outside the run's own file, over two resumes."""
    path = tmp_path / METRICS_FILE
    for step in range(1, 5):
        append_metrics(tmp_path, {"step": step, "reward_mean": step / 10, "max_staleness": 0})
    dropped = keep_lines_until(path, 2)
    assert [r["step"] for r in dropped] == [3, 4] and dropped[0]["reward_mean"] == 0.3
    append_metrics(tmp_path, {"step": 3, "reward_mean": 0.9, "max_staleness": 0})
    assert [r["step"] for r in keep_lines_until(path, 2)] == [3]
    assert _steps(path) == [1, 2]
    assert _steps(superseded_path(path)) == [3, 4, 3]
    assert keep_lines_until(path, 2) == [], "nothing later: the file is left as it is"


def test_resume_from_scratch_empties_the_file_and_a_missing_file_is_fine(tmp_path):
    keep_lines_until(tmp_path / METRICS_FILE, 0)
    assert not (tmp_path / METRICS_FILE).exists()
    append_metrics(tmp_path, {"step": 1, "reward_mean": 0.0, "max_staleness": 0})
    keep_lines_until(tmp_path / METRICS_FILE, 0)
    assert (tmp_path / METRICS_FILE).read_text() == ""


def test_a_line_torn_by_a_kill_is_dropped(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "prom')
    keep_lines_until(path, 5)
    assert _steps(path) == [1, 2]


class _StoppedTimes:
    def lap(self):
        return 2.0, 1.5, 0.5, {}


def test_a_step_record_covers_the_whole_batch_and_says_which_samples_trained():
    """reward_mean and max_staleness are of every sample of the batch, the stale ones included; the counts
    say how many trained; prompts never generated are counted by reason."""
    from rlfleet.workers.controller.ledger import REFUSED, TOO_LONG
    from rlfleet.workers.controller.record import step_record
    from conftest import sampled
    from rlfleet.workers.controller.rollouts import Batch, Rollout, split_stale

    def rollout(reward, versions):
        return Rollout(sample_id=str(reward), prompt=0, prompt_ids=[1], answer="", turns=sampled([5] * len(versions), versions=versions), reward=reward, finished=True)

    rollouts = [rollout(1.0, [4, 5]), rollout(0.0, [5]), rollout(0.5, [2, 5])]  # the last is too stale for step 5
    fresh, stale = split_stale(rollouts, step=5, max_staleness=1)
    batch = Batch(5, rollouts, 96, dropped={TOO_LONG: 2, REFUSED: 1})
    record = step_record(5, batch, fresh, stale, {}, idle=0.5, generator_times=_StoppedTimes())
    assert record["reward_mean"] == 0.5  # (1 + 0 + 0.5) / 3: what the policy earned, trained or not
    assert record["max_staleness"] == 3, "the dropped sample counts: the bound is on what producers made"
    assert record["max_trained_staleness"] == 1, "the trained samples' alone: the ledger's check of the bound"
    assert (record["samples_trained"], record["samples_dropped_stale"]) == (2, 1)
    assert (record["prompts_too_long"], record["prompts_refused"]) == (2, 1)
    assert record["tokens_generated"] == 5 and record["trainer_busy_seconds"] == 1.5


def test_each_scorers_own_mean_each_component_and_each_failure_reason_reach_the_record():
    """A job of several scorers shows each one's mean, not only their weighted sum (issue 26); a component a failed
    call lacks counts 0, so a scorer's component means add up to its own mean."""
    from rlfleet.workers.controller.record import step_record
    from rlfleet.workers.controller.rollouts import Batch, Rollout

    def rollout(scores, components, failures=()):
        return Rollout(sample_id="s", prompt=0, prompt_ids=[1], answer="", finished=True, scorer_scores=scores,
                       components=components, scorer_failures=list(failures), scorer_errors=["python"] * len(failures))

    rollouts = [rollout({"math_answer": 1.0, "python": 0.9}, {"correct": 1.0, "short": -0.1}),
                rollout({"math_answer": 0.0, "python": 0.0}, {}, ["timeout"]),
                rollout({"math_answer": 1.0, "python": 0.0}, {}, ["raised"]),
                rollout({"math_answer": 0.0, "python": 0.0}, {}, ["timeout"])]
    record = step_record(0, Batch(0, rollouts, 4), rollouts, [], {}, idle=0.0, generator_times=_StoppedTimes())
    assert record["scorer/math_answer"] == 0.5 and record["scorer/python"] == pytest.approx(0.9 / 4)
    assert record["reward/correct"] == 0.25 and record["reward/short"] == pytest.approx(-0.1 / 4)
    assert record["scorer_failures/timeout"] == 2 and record["scorer_failures/raised"] == 1
    assert "scorer_failures/memory" not in record and record["scorer_errors"] == 3


class _TwoReplicas:
    def lap(self):
        return 2.0, 1.5, 0.5, {0: (1.2, 0.1), 1: (0.3, 0.4), 2: (0.0, -0.1)}


def test_each_generator_replicas_share_and_bubble_reach_the_record():
    """A step's batch is split by throughput (dispatch.py): the record says which share each replica made, and each
    replica's busy and idle seconds over the step (its bubble), not only their sums."""
    from rlfleet.workers.controller.record import step_record
    from rlfleet.workers.controller.rollouts import Batch, Rollout

    rollouts = [Rollout(sample_id=str(n), prompt=n, prompt_ids=[1], answer="", finished=True) for n in range(4)]
    batch = Batch(0, rollouts, 4, replica=0, shares={0: 3, 1: 1})
    record = step_record(0, batch, rollouts, [], {}, idle=0.0, generator_times=_TwoReplicas())
    assert record["generator_replica"] == 0
    assert (record["generator_share/0"], record["generator_share/1"], record["generator_share/2"]) == (0.75, 0.25, 0.0)
    assert record["generator_busy_seconds/0"] == 1.2 and record["generator_idle_seconds/1"] == 0.4
    assert record["generator_idle_seconds/2"] == 0.0 and (record["generator_busy_seconds"], record["generator_idle_seconds"]) == (1.5, 0.5)
