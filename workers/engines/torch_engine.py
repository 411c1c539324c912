"""The reference engine: plain transformers on torch. Runs anywhere; used to check vLLM and in fast tests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rlfleet.workers.engines.base import Sampling, SegmentOut, SequenceIn
from rlfleet.workers.models.forward import align_forward
from rlfleet.workers.rl.sampling import processed_logits, sampled_logprobs
from rlfleet.workers.sync.buckets import DTYPES
from rlfleet.workers.sync.receiving import AdapterReceiver, ShardReceiver, receiver_for
from rlfleet.workers.trainer.shared_prompts import ATTENTION


# Sequences per forward when scoring given tokens: bounds the [B, L, V] logits one call holds.
SCORE_BATCH = 8


class TorchEngine:
    def __init__(self, model_dir: Path, *, dtype: str, max_model_len: int, device: str = "cpu"):
        from transformers import AutoModelForCausalLM, GenerationConfig

        # The trainer's attention function and roundings, so that both compute log-probs alike (and as vLLM does).
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype],
                                                          attn_implementation=ATTENTION).to(device).eval()
        align_forward(self.model, generators_on_gpu=torch.device(device).type != "cpu")
        self.model_dir = model_dir
        self.device = device
        self.max_model_len = max_model_len
        self.vocab_size = self.model.config.vocab_size
        self.eos_ids = _eos_ids(self.model)
        self.pad_id = self.model.config.pad_token_id or 0
        # generate() fills what a call leaves unset from the model's generation_config.json (repetition_penalty,
        # min_p, ...); vLLM ignores those, and the trainer cannot apply them: sample only what Sampling says.
        self.model.generation_config = GenerationConfig(eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)
        self.receiver: ShardReceiver | AdapterReceiver | None = None
        self.concurrent_receive = True

    @torch.no_grad()
    def generate(self, sequences: list[SequenceIn], sampling: Sampling) -> list[SegmentOut]:
        from transformers import LogitsProcessorList

        torch.manual_seed(sampling.seed)
        ids, mask = self._left_padded([s.prompt_ids + s.completion_ids for s in sequences])
        sample = sampling.temperature > 0
        processors = [_Processed(sampling.temperature, sampling.top_p)] if sample else []
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=sample,
            # HF's own temperature and top-p warpers stay off: the trainer's rule does both (rl/sampling.py).
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            logits_processor=LogitsProcessorList(processors),
            max_new_tokens=sampling.max_tokens,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        # scores are the processed logits the tokens were drawn from (raw logits when greedy, as vLLM reports).
        logprobs = torch.stack(out.scores, dim=1).float().log_softmax(-1)
        new_tokens = out.sequences[:, ids.shape[1]:]
        return [self._segment(new_tokens[row], logprobs[row]) for row in range(len(sequences))]

    @torch.no_grad()
    def logprobs(self, sequences: list[SequenceIn], temperature: float, top_p: float) -> list[list[float]]:
        """Log-prob of each completion token under the sampling distribution (temperature, top-p), as the trainer
        scores its own: the reference executor's forward."""
        found: list[list[float]] = []
        for first in range(0, len(sequences), SCORE_BATCH):
            found += self._scored(sequences[first:first + SCORE_BATCH], temperature, top_p)
        return found

    def _scored(self, sequences: list[SequenceIn], temperature: float, top_p: float) -> list[list[float]]:
        rows = [s.prompt_ids + s.completion_ids for s in sequences]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        scored = sampled_logprobs(logits, ids[:, 1:], temperature, top_p).cpu()
        # Column t scores the token at t + 1: a completion starts at the prompt's last column.
        return [scored[i, len(s.prompt_ids) - 1:len(rows[i]) - 1].tolist() for i, s in enumerate(sequences)]

    def join_sync_group(self, join: dict[str, Any]) -> None:
        self.receiver = receiver_for(join, 0, self.vocab_size, self.device, self.model_dir, self.model.dtype)

    def receive_weights(self) -> float:
        start = time.perf_counter()
        self.receiver.receive()
        return time.perf_counter() - start

    def load_weights(self) -> float:
        """A swap of storage, not a copy: the generator stalls for microseconds, not a memcpy of the model."""
        start = time.perf_counter()
        self.receiver.swap_into(dict(self.model.named_parameters()))
        return time.perf_counter() - start

    def _left_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _segment(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> SegmentOut:
        ids: list[int] = []
        for token in tokens.tolist():
            ids.append(token)
            if token in self.eos_ids:
                return SegmentOut(ids, _picked(logprobs, ids), True)
        return SegmentOut(ids, _picked(logprobs, ids), False)


class _Processed:
    """HF logits processor: the sampling distribution of rl/sampling.py (temperature, then top-p)."""

    def __init__(self, temperature: float, top_p: float):
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return processed_logits(scores, self.temperature, self.top_p)


def _picked(logprobs: torch.Tensor, ids: list[int]) -> list[float]:
    return [logprobs[i, token].item() for i, token in enumerate(ids)]


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id or model.config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])
