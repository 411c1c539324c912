"""Held-out evaluation: the prompts, their greedy completions graded by the job's own scorers, and `rlfleet eval` on
a model directory."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rlfleet.workers.data.tasks import Example
from rlfleet.workers.scorer.batch import ItemScore, ScoreInput, Scoring, named_means, pool_size, scorer_names
from rlfleet.workers.scorer.config import ScorerSpec
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)

Grader = Callable[[list[Example], list[str]], list[ItemScore]]
"""Scores greedy completions of held-out examples with the job's scorers, one ItemScore per completion."""


@dataclass(frozen=True)
class HeldOutScores:
    """The job's scorers on the greedy completions of the held-out prompts."""

    total: int
    reward_mean: float
    """Mean reward as training sums it: each scorer's weight times its score (a reward model's is not in it)."""
    means: dict[str, float]
    """Each scorer's mean before its weight (`scorer/<name>`) and each python component's (`reward/<name>`)."""
    correct: int | None
    """Completions the job's first answer-grading scorer (`grades_answers`) gave 1; None in a job without one."""

    @property
    def accuracy(self) -> float | None:
        return None if self.correct is None else self.correct / self.total

    def fields(self) -> dict[str, Any]:
        """Its metrics.jsonl fields: a step record's names, prefixed `eval_`."""
        fields = {"eval_reward_mean": self.reward_mean, "eval_total": self.total,
                  **{f"eval_{name}": mean for name, mean in self.means.items()}}
        if self.correct is not None:
            fields |= {"eval_accuracy": self.accuracy, "eval_correct": self.correct}
        return fields

    def lines(self, how: str) -> list[str]:
        """What `rlfleet eval` prints: the accuracy (where a scorer grades answers), the mean reward and its parts."""
        means = "".join(f", {name} {mean:.3f}" for name, mean in self.means.items())
        lines = [f"reward {self.reward_mean:.3f} (mean over {self.total} held-out prompts, {how}{means})"]
        if self.correct is not None:
            lines.insert(0, f"accuracy {self.accuracy:.3f} ({self.correct}/{self.total} held-out prompts, {how})")
        return lines


def held_out_scores(specs: Sequence[ScorerSpec], scored: list[ItemScore]) -> HeldOutScores:
    graders = [name for spec, name in zip(specs, scorer_names(specs)) if spec.grades_answers]
    correct = sum(item.scores[graders[0]] == 1.0 for item in scored) if graders else None
    return HeldOutScores(len(scored), sum(item.reward for item in scored) / len(scored),
                         named_means([item.scores for item in scored], [item.components for item in scored]), correct)


def held_out_prompts(job: RLJob, tokenizer: Any, limit: int,
                     unseen_wordings: bool = False) -> tuple[list[Example], list[list[int]]]:
    """The first `limit` held-out examples and their prompt token ids, as the generators receive prompts."""
    from rlfleet.workers.data.tasks import render_prompt, task_for

    examples = task_for(job.spec.data).held_out(unseen_wordings)[:limit]
    if not examples:
        raise ValueError("spec.data.heldOut is 0: there is nothing to evaluate on")
    return examples, [render_prompt(e, tokenizer, job.spec.data.template) for e in examples]


def graded(job: RLJob, grade: Grader, texts: list[str], examples: list[Example]) -> HeldOutScores:
    """The held-out scores of the greedy completions `texts`, logging a few of them."""
    for text, example in list(zip(texts, examples))[:3]:
        log.info("eval sample: %r -> %r (answer %s)", example.prompt, text, example.answer)
    return held_out_scores(job.spec.scorers, grade(examples, texts))


def local_grader(scoring: Scoring) -> Grader:
    """Grading by a `Scoring` pool of this process's own (`rlfleet eval`, which runs without a scorer executor)."""
    return lambda examples, texts: scoring.score(
        [ScoreInput(text, e.answer, e.prompt, e.fields) for e, text in zip(examples, texts)])


def evaluate(job: RLJob, model_dir: Path | None, limit: int, unseen_wordings: bool = False) -> HeldOutScores:
    """The job's scorers over the first `limit` held-out prompts' greedy completions. `model_dir` may be a
    checkpoint, a LoRA one included (merged into a temporary full directory first)."""
    from transformers import AutoTokenizer

    from rlfleet.workers.engines import create_engine
    from rlfleet.workers.engines.base import Sampling, SequenceIn
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.trainer.lora import loadable

    with loadable(model_dir or materialize(job.spec.model, default_cache_dir())) as directory:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        examples, prompts = held_out_prompts(job, tokenizer, limit, unseen_wordings)
        engine = create_engine(job, directory)
        sampling = Sampling(job.spec.generation.max_new_tokens, temperature=0.0, top_p=1.0, seed=0)
        segments = engine.generate([SequenceIn(ids, []) for ids in prompts], sampling)
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in segments]
    with Scoring(job.spec.scorers, pool_size()) as scoring:
        return graded(job, local_grader(scoring), texts, examples)
