"""`rlfleet eval` grades the held-out completions with the job's own scorers (a Scoring pool of its own): the mean
reward as training sums it, each scorer's mean, and the accuracy of the scorer that grades answers 0/1."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rlfleet.workers.data.tasks import task_for
from rlfleet.workers.engines.base import SegmentOut
from rlfleet.workers.evaluation.held_out import evaluate
from rlfleet.workers.models.config import TinyModel
from rlfleet.workers.models.tiny import build_tiny

from conftest import make_job

REWARDS = "def score(completion, answer, prompt, **fields):\n    return {'digits': len(completion) / 10}\n"


class Adder:
    """An engine that answers the first `right` prompts (a+b=) with their sum, the others with 0."""

    def __init__(self, tokenizer, right: int):
        self.tokenizer, self.right, self.texts = tokenizer, right, []

    def generate(self, sequences, sampling):
        assert sampling.temperature == 0.0, "evaluation is greedy"
        prompts = [self.tokenizer.decode(s.prompt_ids, skip_special_tokens=True) for s in sequences]
        sums = [sum(map(int, prompt.rstrip("=").split("+"))) for prompt in prompts]
        self.texts = [str(total) if index < self.right else "0" for index, total in enumerate(sums)]
        return [SegmentOut(self.tokenizer(text, add_special_tokens=False)["input_ids"], [], True)
                for text in self.texts]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny(TinyModel(), out)
    return out


def test_eval_gives_every_scorers_mean_and_the_accuracy_of_the_one_that_grades_answers(tmp_path, tiny_dir,
                                                                                      monkeypatch):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    job = make_job(data={"type": "arithmetic", "maxOperand": 9, "heldOut": 20},
                   scorers=[{"type": "python", "path": str(rewards), "source": REWARDS},
                            {"type": "math_answer", "weight": 0.5}])
    engine = Adder(AutoTokenizer.from_pretrained(tiny_dir), right=6)
    monkeypatch.setattr("rlfleet.workers.engines.create_engine", lambda job, directory: engine)
    scores = evaluate(job, tiny_dir, limit=10)
    answers = [e.answer for e in task_for(job.spec.data).held_out()[:10]]
    correct = sum(text == answer for text, answer in zip(engine.texts, answers))
    digits = sum(len(text) / 10 for text in engine.texts) / 10
    assert (scores.correct, scores.total, scores.accuracy) == (correct, 10, correct / 10)
    assert scores.means == pytest.approx({"scorer/score": digits, "reward/digits": digits,
                                          "scorer/math_answer": correct / 10})
    assert scores.reward_mean == pytest.approx(digits + 0.5 * correct / 10)
    assert scores.lines("greedy") == [
        f"accuracy {correct / 10:.3f} ({correct}/10 held-out prompts, greedy)",
        f"reward {digits + correct / 20:.3f} (mean over 10 held-out prompts, greedy, scorer/score {digits:.3f}, "
        f"scorer/math_answer {correct / 10:.3f}, reward/digits {digits:.3f})"]


def test_eval_of_a_job_without_an_answer_grading_scorer_gives_its_mean_reward_and_no_accuracy(tiny_dir, monkeypatch):
    job = make_job(data={"type": "arithmetic", "maxOperand": 9, "heldOut": 20},
                   scorers=[{"type": "regex_format", "pattern": "[1-9][0-9]*", "weight": 2.0}])
    engine = Adder(AutoTokenizer.from_pretrained(tiny_dir), right=5)
    monkeypatch.setattr("rlfleet.workers.engines.create_engine", lambda job, directory: engine)
    scores = evaluate(job, tiny_dir, limit=10)
    formatted = sum(text != "0" for text in engine.texts) / 10
    assert scores.correct is None and scores.accuracy is None
    assert scores.reward_mean == pytest.approx(2 * formatted)
    assert scores.lines("greedy") == [
        f"reward {2 * formatted:.3f} (mean over 10 held-out prompts, greedy, scorer/regex_format {formatted:.3f})"]
