"""The reward model itself: a Hugging Face sequence-classification model with one label, scoring texts in batches."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from rlfleet.workers.reward_model.config import RewardModelRole

log = logging.getLogger(__name__)


class RewardModel:
    """Scores (prompt, completion) pairs: its own tokenizer reads each pair as one text, the model's single logit is
    the score. Loaded once; `score` is one forward pass over the pairs it is given."""

    def __init__(self, path: str | Path, device: str = "cpu", dtype: str = "float32", max_length: int = 2048,
                 template: str = "plain"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.template = template
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # The classifier reads the last token: a text too long loses its beginning, never the completion's end.
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        if model.config.num_labels != 1:
            raise ValueError(f"{path}: a reward model has one label (num_labels 1), this one has "
                             f"{model.config.num_labels}")
        if model.config.pad_token_id is None:  # how the model finds each sequence's last token in a padded batch
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        log.info("reward model %s (%s, %d parameters) on %s", path, type(model).__name__, model.num_parameters(),
                 self.device)

    @classmethod
    def for_role(cls, role: RewardModelRole) -> RewardModel:
        gpu = role.resources.gpu > 0
        return cls(role.path, device="cuda" if gpu else "cpu", dtype=role.dtype or ("bfloat16" if gpu else "float32"),
                   max_length=role.max_length, template=role.template)

    def text(self, prompt: str, completion: str) -> str:
        if self.template == "chat":
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(turns, tokenize=False)
        return prompt + completion

    def score(self, items: Sequence[tuple[str, str]]) -> list[float]:
        """One score per (prompt, completion), in order: one forward pass over them all."""
        batch = self.tokenizer([self.text(p, c) for p, c in items], padding=True, truncation=True,
                               max_length=self.max_length, return_tensors="pt").to(self.device)
        with self.torch.inference_mode():
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits[:, 0].float().cpu().tolist()
