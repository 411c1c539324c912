"""Where an arithmetic job's accuracy is, by kind of problem: greedy held-out accuracy, and pass@k of sampled
training problems, split into +, - with a result >= 0, - with a negative result, and *.

    .venv/bin/python benchmarks/held_out_kinds.py JOB.yaml [MODEL_DIR] [--samples 8] [--problems 240]

Without MODEL_DIR the job's base model. `--samples 0` skips pass@k. BENCHMARKS.md, Time to accuracy, has what it found.
"""

from __future__ import annotations

import argparse
import collections
import itertools
from pathlib import Path


def kind(example) -> str:
    op = next(c for c in example.id.split(":")[1][1:] if c in "+-*")
    return "- negative" if op == "-" and int(example.answer) < 0 else op


def completions(engine, tokenizer, job, examples, temperature: float, samples: int) -> list[list[str]]:
    from rlfleet.workers.data.tasks import render_prompt
    from rlfleet.workers.engines.base import Sampling, SequenceIn

    sequences = [SequenceIn(render_prompt(e, tokenizer, job.spec.data.template), []) for e in examples
                 for _ in range(samples)]
    sampling = Sampling(job.spec.generation.max_new_tokens, temperature=temperature, top_p=1.0, seed=7)
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in engine.generate(sequences, sampling)]
    return [texts[i * samples:(i + 1) * samples] for i in range(len(examples))]


def table(title: str, examples, answered: list[list[bool]]) -> None:
    by_kind = collections.defaultdict(list)
    for example, right in zip(examples, answered):
        by_kind[kind(example)].append(any(right))
    print(title)
    for name in sorted(by_kind):
        right = by_kind[name]
        print(f"  {name:<11} {sum(right):>4}/{len(right):<4} {sum(right) / len(right):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--problems", type=int, default=240)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from rlfleet.workers.data.tasks import task_for
    from rlfleet.workers.engines import create_engine
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.scorer.config import MathAnswer
    from rlfleet.workers.scorer.rules import math_answer
    from rlfleet.workers.spec import load_job

    job = load_job(args.job)
    model_dir = Path(args.model_dir) if args.model_dir else materialize(job.spec.model, default_cache_dir())
    tokenizer, task = AutoTokenizer.from_pretrained(model_dir), task_for(job.spec.data)
    engine = create_engine(job, model_dir)

    def scored(examples, texts):
        return [[math_answer(t, e.answer, MathAnswer()) == 1.0 for t in group] for e, group in zip(examples, texts)]

    held_out = task.held_out()
    table("held-out, greedy:", held_out, scored(held_out, completions(engine, tokenizer, job, held_out, 0.0, 1)))
    if args.samples:
        train = list(itertools.islice(task.train(), args.problems))
        texts = completions(engine, tokenizer, job, train, job.spec.generation.temperature, args.samples)
        table(f"training problems, pass@{args.samples} at temperature {job.spec.generation.temperature}:", train,
              scored(train, texts))


if __name__ == "__main__":
    main()
