"""The `reasoning_gym` scorer: each reasoning-gym problem graded by its own dataset's `score_answer`.

It runs in `Scoring`'s child process like every rule scorer. The problem's metadata and its dataset's options reach it
as the example's fields (data/gym.py): the dataset is built once per child from those options, as the composite
dataset routes scoring by `metadata["source_dataset"]`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import reasoning_gym
from reasoning_gym.utils import extract_answer


def reasoning_gym_score(completion: str, answer: str, prompt: str, spec: Any, **fields: Any) -> float:
    """The dataset's score of the completion's answer (what its last <answerTag> holds, or all of it when answerTag
    is null) against the problem; raises KeyError where the fields carry no reasoning-gym metadata."""
    metadata = fields["metadata"]
    given = completion.strip() if spec.answer_tag is None else extract_answer(completion, tag_name=spec.answer_tag)
    dataset = _dataset(metadata["source_dataset"], json.dumps(fields.get("dataset_config") or {}, sort_keys=True))
    return float(dataset.score_answer(given, {"question": prompt, "answer": answer, "metadata": metadata}))


@lru_cache(maxsize=None)
def _dataset(name: str, config_json: str) -> Any:
    """The dataset whose check grades `name`'s problems, with the job's options for it (some checks read them)."""
    return reasoning_gym.create_dataset(name, **json.loads(config_json))
