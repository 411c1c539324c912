"""reasoning-gym problems (`data.type: reasoning_gym`): a seeded, weighted mix of its procedural datasets.

Problem i is reasoning-gym's composite item i: a function of the spec and i alone, so the train stream resumes from a
position in O(1). Problems 0..size-1 train; problems size..size+heldOut-1 are held out, and a training problem that
asks a held-out question word for word (small problem spaces repeat) is replaced by the next one that does not.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
from typing import Any, Iterator

from rlfleet.workers.data.config import ReasoningGymData
from rlfleet.workers.data.tasks import DataError, Example

# How a question is answered where data.systemPrompt is not given: reasoning-gym's own default instruction.
DEFAULT_PROMPT = "default"


class ReasoningGymTask:
    """Training problems 0..size-1, pass after pass; held out: the heldOut problems after them."""

    def __init__(self, spec: ReasoningGymData):
        self.spec = spec
        self.template = spec.template
        self._dataset = composite(spec)
        self._instruction = instruction(spec)
        # Distinct: a small problem space asks one question twice, which would count twice.
        held_out = {}
        for index in range(spec.size, spec.size + spec.held_out):
            example = self.example(index)
            held_out.setdefault(example.prompt, example)
        self._held_out = list(held_out.values())
        self._held_out_prompts = frozenset(held_out)
        self.train_size = spec.size

    def train(self, start: int = 0) -> Iterator[Example]:
        for position in itertools.count(start):
            yield self._train_example(position)

    def held_out(self, unseen_wordings: bool = False) -> list[Example]:
        if unseen_wordings:
            raise ValueError("reasoning-gym data has no other wordings: its questions are its datasets'")
        return list(self._held_out)

    def example(self, index: int) -> Example:
        """Problem `index`: its question, its answer, and what the dataset's check needs (`fields`: the entry's
        metadata, as JSON values, and its dataset's options)."""
        entry = self._dataset[index]
        metadata = json.loads(json.dumps(entry["metadata"], default=str))
        name = metadata["source_dataset"]
        fields = {"metadata": metadata, "dataset_config": self.spec.datasets[name].config}
        question = entry["question"]
        if self.template == "chat":
            messages = [{"role": "system", "content": self._instruction}] if self._instruction else []
            messages.append({"role": "user", "content": question})
            return Example(id=f"gym:{name}:{index}", prompt=question, answer=str(entry["answer"]), fields=fields,
                           messages=messages if len(messages) > 1 else [])
        prompt = f"{self._instruction}\n\n{question}" if self._instruction else question
        return Example(id=f"gym:{name}:{index}", prompt=prompt, answer=str(entry["answer"]), fields=fields)

    def _train_example(self, position: int) -> Example:
        index = position % self.spec.size
        for attempt in range(self.spec.size):
            example = self.example((index + attempt) % self.spec.size)
            if example.prompt not in self._held_out_prompts:
                return example
        raise DataError("data: every training problem asks a held-out question: raise data.size, or lower "
                        "data.heldOut")


def composite(spec: ReasoningGymData) -> Any:
    """reasoning-gym's composite dataset of the spec's mix, over its training and held-out problems; DataError
    naming the field where a dataset or an option does not exist or is refused by the dataset."""
    try:
        import reasoning_gym
    except ImportError:
        raise DataError("data.type reasoning_gym needs reasoning-gym: pip install 'rlfleet[data]'") from None
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec
    from reasoning_gym.factory import DATASETS

    for name, dataset in spec.datasets.items():
        if name not in DATASETS:
            close = difflib.get_close_matches(name, DATASETS, n=5, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else "see reasoning_gym.factory.DATASETS"
            raise DataError(f"data.datasets.{name}: no such reasoning-gym dataset ({len(DATASETS)} exist): {hint}")
        options = [option.name for option in dataclasses.fields(DATASETS[name][1])]
        if unknown := sorted(set(dataset.config) - set(options)):
            raise DataError(f"data.datasets.{name}.config: no option {', '.join(unknown)} (it has: "
                            f"{', '.join(options)})")
        try:
            reasoning_gym.create_dataset(name, **dataset.config)
        except (TypeError, ValueError, AssertionError) as err:
            raise DataError(f"data.datasets.{name}.config: {err or type(err).__name__}") from None
    size = spec.size + spec.held_out
    specs = [DatasetSpec(name, dataset.weight, {**dataset.config, "size": size})
             for name, dataset in spec.datasets.items()]
    return CompositeDataset(CompositeConfig(size=size, seed=spec.seed, datasets=specs))


def instruction(spec: ReasoningGymData) -> str:
    """The system prompt (or, plain, the text before each question): the spec's, else reasoning-gym's own."""
    if spec.system_prompt is not None:
        return spec.system_prompt
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS[DEFAULT_PROMPT]
