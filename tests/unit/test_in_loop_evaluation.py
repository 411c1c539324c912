"""Evaluation in the loop without worker processes: a fake generator answers, the job's scorers (a Scorer service in
this process) grade the held-out completions greedily generated at the version a replica holds, and the best checkpoint
only ever holds the weights that were scored."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlfleet.v1 import generator_pb2
from rlfleet.workers.evaluation.held_out import HeldOutScores
from rlfleet.workers.evaluation.in_loop import EvalResult, HeldOutEvaluator, InLoopEvaluation
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import ControllerMetrics
from rlfleet.workers.scorer.stage import remote_grader
from rlfleet.workers.trainer.checkpoint import BEST_DIR, CHECKPOINTS_DIR, STATE_FILE, best_state

from conftest import make_job
from fleet_fakes import InProcessScorer

SPEC = {"algorithm": {"steps": 7}, "data": {"type": "arithmetic", "maxOperand": 9, "heldOut": 20},
        "evaluation": {"everySteps": 2, "limit": 10}, "generation": {"maxNewTokens": 3},
        "weightSync": {"timeoutSeconds": 2}}
JOB = make_job(**SPEC)


class CharTokenizer:
    """One character per id: enough to render plain prompts and decode answers."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class Generator:
    """Answers `right` of the prompts correctly (the rest with 0), at `version`; remembers the requests."""

    def __init__(self, right: int, version: int):
        self.right, self.version, self.requests = right, version, []

    def Generate(self, request, timeout=None):
        self.requests.append(request)
        segments = []
        for index, sequence in enumerate(request.sequences):
            a, op, b = "".join(chr(i) for i in sequence.prompt_ids).rstrip("=").partition("+")
            answer = str(int(a) + int(b)) if index < self.right else "0"
            segments.append(generator_pb2.Segment(sample_id=sequence.sample_id, token_ids=[ord(c) for c in answer]))
        return generator_pb2.GenerateResponse(policy_version=self.version, segments=segments)


@pytest.fixture(scope="module")
def scorer():
    replica = InProcessScorer(JOB)
    yield replica
    replica.close()


def evaluator(generator: Generator, versions: dict[int, int | None], scorer: InProcessScorer,
              job=JOB) -> HeldOutEvaluator:
    return HeldOutEvaluator(job, CharTokenizer(), [generator], lambda replica: versions[replica],
                            remote_grader(job, [scorer]))


def test_scores_the_held_out_prompts_greedily_on_a_replica_that_holds_the_version(scorer):
    generator = Generator(right=7, version=4)
    held = evaluator(generator, {0: 4}, scorer)
    held.start(4)
    result = held.take(wait=True)
    assert (result.scores.correct, result.scores.total, result.policy_version) == (7 - _zero_sums(held, 7), 10, 4)
    request = generator.requests[0]
    assert request.temperature == 0.0 and request.max_tokens == 3 and len(request.sequences) == 10
    assert held.take() is None, "a result is handed out once"


def _zero_sums(held: HeldOutEvaluator, right: int) -> int:
    """Held-out problems among the wrong-answered ones whose sum is 0 (answered right by accident)."""
    return -sum(e.answer == "0" for e in held.examples[right:])


def test_a_replica_without_the_version_is_not_used_and_the_evaluation_is_skipped(scorer):
    generator = Generator(right=10, version=3)
    held = evaluator(generator, {0: 3}, scorer)
    held.start(4)
    assert held.take(wait=True) is None and generator.requests == []


class Trainer:
    """Snapshots numbered from 1; a run directory's trainer writes the best one's state as the real one does."""

    def __init__(self, run_dir: Path | None = None):
        self.saved, self.snapshots, self.run_dir = [], 0, run_dir
        self.clock = SimpleNamespace(idle=lambda reason: nullcontext())

    def snapshot(self):
        self.snapshots += 1
        return {"w": self.snapshots}

    def save_best(self, snapshot, state):
        self.saved.append((snapshot, state))
        if self.run_dir:
            best = self.run_dir / CHECKPOINTS_DIR / BEST_DIR
            best.mkdir(parents=True, exist_ok=True)
            (best / STATE_FILE).write_text(json.dumps(state))

    def best(self):
        return best_state(self.run_dir / CHECKPOINTS_DIR) if self.run_dir else {}


class Scripted:
    """An evaluator whose results the test hands in: (version started, result returned) in order."""

    def __init__(self, results):
        self.job, self.results, self.started, self.running = JOB, list(results), [], False

    def busy(self):
        return self.running

    def start(self, version):
        self.started.append(version)
        self.running = True

    def take(self, wait=False):
        """A None in the results is one look that finds the evaluation still running (a wait looks past it)."""
        if not self.running:
            return None
        while self.results[0] is None:
            self.results.pop(0)
            if not wait:
                return None
        self.running = False
        return self.results.pop(0)


def result(version: int, correct: int) -> EvalResult:
    return EvalResult(version, HeldOutScores(10, correct / 10, {"scorer/math_answer": correct / 10}, correct), 0.1)


def observed(meters: SimpleNamespace):
    """What a ControllerMetrics stand-in records of each evaluation: (accuracy, version)."""
    return lambda fields: meters.observed.append((fields["eval_accuracy"], fields["eval_policy_version"]))


def test_best_checkpoint_holds_the_scored_snapshot_and_only_improvements(tmp_path):
    meters = SimpleNamespace(observed=[])
    meters.observe_eval = observed(meters)
    trainer = Trainer(tmp_path)
    scripted = Scripted([result(0, 2), result(2, 5), result(4, 6), result(7, 9)])
    loop = InLoopEvaluation(scripted, trainer, meters)
    loop.before_training(0)
    fields = [loop.after_step(step) for step in range(1, 8)]
    assert scripted.started == [0, 2, 4, 7], "version 6's record would be the last's: the last step evaluates"
    # Each result lands in the record of the step after it started; the last step waits for its own.
    assert [f.get("eval_policy_version") for f in fields] == [0, None, 2, None, 4, None, 7]
    # Best: version 0 (0.2), version 2 (0.5), version 4 (0.6), version 7 (0.9), each its own snapshot.
    assert [(weights["w"], state["policy_version"]) for weights, state in trainer.saved] == [
        (1, 0), (2, 2), (3, 4), (4, 7)]
    assert fields[-1]["eval_best_accuracy"] == pytest.approx(0.9)
    assert meters.observed[-1] == (0.9, 7)
    assert InLoopEvaluation(Scripted([]), trainer, meters).best == pytest.approx(0.9), "kept over a resume"


def test_a_result_for_another_version_than_the_snapshot_is_recorded_but_never_the_best(tmp_path):
    meters = SimpleNamespace(observe_eval=lambda fields: None)
    trainer = Trainer()
    loop = InLoopEvaluation(Scripted([result(3, 9)]), trainer, meters)
    fields = loop.after_step(7)
    assert fields["eval_policy_version"] == 3 and trainer.saved == []


def test_an_evaluation_still_running_is_not_started_again(tmp_path):
    meters = SimpleNamespace(observe_eval=lambda fields: None)
    scripted = Scripted([None, result(2, 1)])
    loop = InLoopEvaluation(scripted, Trainer(), meters)
    loop.after_step(2)
    loop.after_step(4)
    assert scripted.started == [2]


def test_an_evaluation_still_running_near_the_end_reaches_a_record_beside_the_last_one(tmp_path):
    # Steps 7, every 2: version 4's evaluation outlives steps 5 and 6 (a loaded machine); it and the last both land.
    meters = SimpleNamespace(observe_eval=lambda fields: None)
    scripted = Scripted([result(0, 2), result(2, 3), None, None, result(4, 4), result(7, 6)])
    loop = InLoopEvaluation(scripted, Trainer(), meters)
    loop.before_training(0)
    fields = [loop.after_step(step) for step in range(1, 8)]
    assert [f["eval_policy_version"] for f in fields if f] == [0, 2, 4, 7]


def test_a_resumed_run_records_the_result_of_a_version_up_to_its_checkpoint_that_a_superseded_record_held(tmp_path):
    """Checkpoint at step 2; the lost run's record 3 held version 2's result (no step redoes it), record 5 version
    4's (its weights are trained again): only the first is carried, into the first record after the resume."""
    meters = SimpleNamespace(observed=[])
    meters.observe_eval = observed(meters)
    superseded = [{"step": 3, "reward_mean": 0.5, **result(2, 3).fields(), "eval_best_accuracy": 0.3},
                  {"step": 4, "reward_mean": 0.5}, {"step": 5, **result(4, 9).fields(), "eval_best_accuracy": 0.9}]
    scripted = Scripted([result(4, 5), result(7, 8)])
    loop = InLoopEvaluation(scripted, Trainer(), meters)
    loop.carry(superseded, 2)
    fields = [loop.after_step(step) for step in range(3, 8)]
    assert [f.get("eval_policy_version") for f in fields] == [2, None, 4, None, 7]
    assert fields[0] == {**result(2, 3).fields(), "eval_best_accuracy": 0.3}, "the numbers the lost record had"
    assert meters.observed[0] == (pytest.approx(0.3), 2)


REWARDS = "def score(completion, answer, prompt, **fields):\n    return {'digits': len(completion) / 10}\n"


def scored_at_the_last_step(job, generator: Generator, tmp_path: Path) -> tuple[HeldOutEvaluator, dict, Trainer, Any]:
    """The last step's evaluation through the controller's path: the job's scorer service, real ControllerMetrics."""
    replica = InProcessScorer(job)
    try:
        held = evaluator(generator, {0: generator.version}, replica, job)
        meters = ControllerMetrics(WorkerMetrics("trainer", job=job.metadata.name))
        trainer = Trainer()
        fields = InLoopEvaluation(held, trainer, meters).after_step(job.spec.algorithm.steps)
    finally:
        replica.close()
    return held, fields, trainer, meters.worker.registry


def test_the_held_out_completions_are_graded_by_every_scorer_of_the_job_weighted_as_in_training(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    job = make_job(**SPEC, scorers=[{"type": "math_answer", "weight": 2.0},
                                    {"type": "python", "path": str(rewards), "source": REWARDS}])
    held, fields, trainer, registry = scored_at_the_last_step(job, Generator(right=7, version=7), tmp_path)
    texts = [e.answer if i < 7 else "0" for i, e in enumerate(held.examples)]
    accuracy = sum(t == e.answer for t, e in zip(texts, held.examples)) / 10
    digits = sum(len(t) / 10 for t in texts) / 10
    assert fields["eval_scorer/math_answer"] == pytest.approx(accuracy)
    assert fields["eval_scorer/score"] == pytest.approx(digits) == fields["eval_reward/digits"]
    assert fields["eval_reward_mean"] == pytest.approx(2 * accuracy + digits)
    assert (fields["eval_accuracy"], fields["eval_correct"], fields["eval_total"]) == (accuracy, accuracy * 10, 10)
    assert fields["eval_best_accuracy"] == accuracy and trainer.saved, "the best checkpoint is still by accuracy"
    labels = {"job": "t", "namespace": "", "role": "trainer", "rank": "0"}
    assert registry.get_sample_value("rlfleet_eval_scorer_mean", {**labels, "scorer": "score"}) == pytest.approx(digits)
    assert registry.get_sample_value("rlfleet_eval_reward_mean", labels) == pytest.approx(2 * accuracy + digits)
    assert registry.get_sample_value("rlfleet_eval_accuracy_ratio", labels) == pytest.approx(accuracy)


def test_a_job_without_an_answer_grading_scorer_is_evaluated_by_its_mean_reward(tmp_path):
    job = make_job(**SPEC, scorers=[{"type": "regex_format", "pattern": "[1-9][0-9]*"}])
    held, fields, trainer, registry = scored_at_the_last_step(job, Generator(right=6, version=7), tmp_path)
    formatted = sum(e.answer != "0" for e in held.examples[:6]) / 10  # the other 4 answered "0"
    assert fields["eval_reward_mean"] == fields["eval_scorer/regex_format"] == pytest.approx(formatted)
    assert "eval_accuracy" not in fields and "eval_correct" not in fields
    assert fields["eval_best_reward_mean"] == pytest.approx(formatted) and len(trainer.saved) == 1
    labels = {"job": "t", "namespace": "", "role": "trainer", "rank": "0"}
    assert registry.get_sample_value("rlfleet_eval_reward_mean", labels) == pytest.approx(formatted)
