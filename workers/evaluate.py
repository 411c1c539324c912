"""Held-out greedy accuracy of a model on a job's task (`rlfleet eval`)."""

from __future__ import annotations

import logging
from pathlib import Path

from rlfleet.workers.spec import MathAnswer, RLJob

log = logging.getLogger(__name__)


def evaluate(job: RLJob, model_dir: Path | None, limit: int) -> tuple[int, int]:
    """(correct, total) over the first `limit` held-out prompts, greedy, scored by math_answer."""
    from transformers import AutoTokenizer

    from rlfleet.workers.data.tasks import render_prompt, task_for
    from rlfleet.workers.engines import create_engine
    from rlfleet.workers.engines.base import Sampling, SequenceIn
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.scorer.rules import math_answer

    model_dir = model_dir or materialize(job.spec.model, default_cache_dir())
    examples = task_for(job.spec.data).held_out()[:limit]
    if not examples:
        raise ValueError("spec.data.heldOut is 0: there is nothing to evaluate on")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = create_engine(job, model_dir)
    prompts = [SequenceIn(render_prompt(e, tokenizer, job.spec.data.template), []) for e in examples]
    sampling = Sampling(job.spec.generation.max_new_tokens, temperature=0.0, top_p=1.0, seed=0)
    segments = engine.generate(prompts, sampling)
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in segments]
    correct = sum(math_answer(text, e.answer, MathAnswer()) == 1.0 for text, e in zip(texts, examples))
    for text, example in list(zip(texts, examples))[:3]:
        log.info("eval sample: %r -> %r (answer %s)", example.prompt, text, example.answer)
    return int(correct), len(examples)
