"""The peer's side of `rlfleet bench peer`: TRL's GRPOTrainer on a job's model, data and scorers, for a wall time.

Run by the bench in a child process of its own (`python -m rlfleet.benchmarks.peer_trl ...`). The prompts are the
job's own, rendered by its template to the exact token ids RLFleet's generators receive, and the reward is the job's
own scorers. At each mark of training time the weights are saved (the clock stops meanwhile) so that the bench can
evaluate them exactly as it evaluates RLFleet's. Needs `pip install 'rlfleet[peer]'` (TRL).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

# Examples handed to TRL's sampler: more than any time budget here trains on, fewer than a pass over a big task.
MAX_EXAMPLES = 50_000
MARKS_FILE = "marks.jsonl"


class TimeBudget:
    """Training time since `started` (epoch seconds), less the seconds spent saving; saves at each mark."""

    def __init__(self, started: float, marks: list[float], out: Path, save: Any):
        self.started = started
        self.marks = list(marks)
        self.out = out
        self.save = save
        self.paused = 0.0

    def elapsed(self) -> float:
        return time.time() - self.started - self.paused

    def after_step(self, step: int, samples: int) -> bool:
        """Save the weights at every mark passed; True once the last mark is passed (training stops)."""
        elapsed = self.elapsed()
        while self.marks and elapsed >= self.marks[0]:
            mark = self.marks.pop(0)
            saving = time.time()
            directory = self.out / f"at-{mark:06.0f}"
            self.save(directory)
            self.paused += time.time() - saving
            _append(self.out / MARKS_FILE, {"mark": mark, "elapsed": elapsed, "step": step, "samples": samples,
                                            "model_dir": str(directory)})
        return not self.marks


def trl_dataset(job: Any, tokenizer: Any) -> tuple[Any, list[Any]]:
    """The job's training stream as TRL's prompts (text that tokenizes back to RLFleet's prompt ids), and the
    examples by row."""
    from datasets import Dataset

    from rlfleet.workers.data.tasks import render_prompt, task_for

    task = task_for(job.spec.data)
    examples = list(itertools.islice(task.train(0), min(task.train_size, MAX_EXAMPLES)))
    rows = []
    for index, example in enumerate(examples):
        ids = render_prompt(example, tokenizer, job.spec.data.template)
        text = tokenizer.decode(ids)
        if list(tokenizer(text, add_special_tokens=False)["input_ids"]) != ids:
            raise ValueError(f"example {example.id!r}: its rendered prompt does not tokenize back to the same ids, "
                             "so TRL would not see RLFleet's prompt")
        rows.append({"prompt": text, "row": index})
    return Dataset.from_list(rows), examples


def reward_function(job: Any, examples: list[Any], scoring: Any) -> Any:
    """The job's scorers as a TRL reward function: the summed weighted reward, as RLFleet trains on."""
    from rlfleet.workers.scorer.batch import ScoreInput

    def job_reward(prompts: list[str], completions: list[str], row: list[int], **_: Any) -> list[float]:
        items = [ScoreInput(text, examples[i].answer, examples[i].prompt, examples[i].fields)
                 for text, i in zip(completions, row)]
        return [item.reward for item in scoring.score(items)]

    return job_reward


def grpo_config(job: Any, out: Path, overrides: dict[str, Any]) -> Any:
    """TRL's defaults with what a CPU run and the task fix: the job's completion length, float32 on the CPU, no
    schedule horizon (the run stops on time, not steps), no checkpoints of TRL's own; then `overrides`."""
    from trl import GRPOConfig

    settings = {"output_dir": str(out / "trl"), "use_cpu": True, "bf16": False, "max_steps": 10**6,
                "max_completion_length": job.spec.generation.max_new_tokens, "save_strategy": "no",
                "report_to": "none", "logging_steps": 10, "seed": job.spec.algorithm.seed}
    return GRPOConfig(**(settings | overrides))


def train(job: Any, model_dir: Path, out: Path, started: float, marks: list[float], overrides: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlfleet.workers.scorer.batch import Scoring, pool_size

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset, examples = trl_dataset(job, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")

    def save(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    budget = TimeBudget(started, marks, out, save)
    config = grpo_config(job, out, overrides)

    class OnTime(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            samples = state.global_step * config.per_device_train_batch_size * config.gradient_accumulation_steps
            control.should_training_stop = budget.after_step(state.global_step, samples)
            return control

    with Scoring(job.spec.scorers, pool_size()) as scoring:
        trainer = GRPOTrainer(model=model, reward_funcs=reward_function(job, examples, scoring), args=config,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[OnTime()])
        trainer.train()


def _append(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.benchmarks.peer_trl", description=__doc__.splitlines()[0])
    parser.add_argument("job", help="the RLJob YAML whose model, data, scorers and maxNewTokens TRL trains with")
    parser.add_argument("--out", required=True, help="directory for the weights at each mark and marks.jsonl")
    parser.add_argument("--started", type=float, required=True, help="epoch seconds the wall time counts from")
    parser.add_argument("--marks", required=True, help="comma-separated seconds of training time to save weights at")
    parser.add_argument("--config", type=json.loads, default={}, help="GRPOConfig fields over its defaults (JSON)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.spec import load_job

    job = load_job(args.job)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    marks = sorted(float(mark) for mark in args.marks.split(","))
    train(job, materialize(job.spec.model, default_cache_dir()), out, args.started, marks, args.config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
