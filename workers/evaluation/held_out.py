"""Held-out greedy accuracy: the prompts, the scoring, and `rlfleet eval` on a model directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlfleet.workers.data.tasks import Example
from rlfleet.workers.spec import RLJob
from rlfleet.workers.scorer.config import MathAnswer

log = logging.getLogger(__name__)


def held_out_prompts(job: RLJob, tokenizer: Any, limit: int,
                     unseen_wordings: bool = False) -> tuple[list[Example], list[list[int]]]:
    """The first `limit` held-out examples and their prompt token ids, as the generators receive prompts."""
    from rlfleet.workers.data.tasks import render_prompt, task_for

    examples = task_for(job.spec.data).held_out(unseen_wordings)[:limit]
    if not examples:
        raise ValueError("spec.data.heldOut is 0: there is nothing to evaluate on")
    return examples, [render_prompt(e, tokenizer, job.spec.data.template) for e in examples]


def correct_answers(texts: list[str], examples: list[Example]) -> int:
    """How many greedy completions give the right answer (math_answer), logging a few of them."""
    from rlfleet.workers.scorer.rules import math_answer

    for text, example in list(zip(texts, examples))[:3]:
        log.info("eval sample: %r -> %r (answer %s)", example.prompt, text, example.answer)
    return sum(math_answer(text, e.answer, MathAnswer()) == 1.0 for text, e in zip(texts, examples))


def evaluate(job: RLJob, model_dir: Path | None, limit: int, unseen_wordings: bool = False) -> tuple[int, int]:
    """(correct, total) over the first `limit` held-out prompts, greedy, scored by math_answer. `model_dir` may be
    a checkpoint, a LoRA one included (merged into a temporary full directory first)."""
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
    return correct_answers(texts, examples), len(examples)
