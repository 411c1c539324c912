"""Toy reward models: a sequence-classification Llama (one label) on the tiny policy's character tokenizer, built
here, never downloaded; `train_reward_model` teaches one a preference from synthetic (prompt, completion) pairs, as a
user would train one on labelled data. The tests use them, and `rlfleet toy-reward-model` makes the one the examples
name (a completion with a given digit preferred)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

from rlfleet.workers.models.tiny import CHARACTERS, MAX_POSITIONS, build_tokenizer


# The built-in job's problems (maxOperand 9), as the reward model reads them.
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


def build_reward_model(out_dir: Path, seed: int = 0, hidden: int = 64, layers: int = 2, labels: int = 1):
    """An untrained reward model saved as a HF directory (weights, config with num_labels 1, tokenizer); returns
    the model and its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32,
                         intermediate_size=2 * hidden, max_position_embeddings=MAX_POSITIONS, num_labels=labels,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config).to(torch.float32)
    save(model, tokenizer, out_dir)
    return model, tokenizer


def save(model, tokenizer, out_dir: Path) -> Path:
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def random_completion(rng: random.Random, longest: int) -> str:
    """What a random policy writes: up to `longest` characters of the tiny vocabulary (fewer when it stopped)."""
    return "".join(rng.choice(CHARACTERS) for _ in range(rng.randint(0, longest)))


def synthetic_pairs(prompts: Sequence[str], prefers: Callable[[str], bool], make: Callable[[random.Random], str],
                    force: Callable[[random.Random, str], str], count: int, rng: random.Random):
    """`count` (prompt, completion, label) triples, half of them made to have the preferred property (`force`)."""
    triples = []
    for index in range(count):
        completion = make(rng)
        if index % 2:
            completion = force(rng, completion)
        triples.append((rng.choice(prompts), completion, float(prefers(completion))))
    return triples


def train_reward_model(out_dir: Path, prefers: Callable[[str], bool], prompts: Sequence[str],
                       make: Callable[[random.Random], str], force: Callable[[random.Random, str], str],
                       steps: int = 300, batch: int = 64, lr: float = 3e-3, seed: int = 0) -> float:
    """Regress a fresh reward model's score onto 1 (completion preferred) or 0, on fresh synthetic pairs every step;
    saves it to out_dir and returns its accuracy (score above 0.5 = preferred) on pairs it never saw."""
    import torch

    model, tokenizer = build_reward_model(out_dir, seed=seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def scores(triples):
        batch_in = tokenizer([p + c for p, c, _ in triples], padding=True, return_tensors="pt")
        return model(**batch_in).logits[:, 0]

    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            triples = synthetic_pairs(prompts, prefers, make, force, batch, rng)
            loss = torch.nn.functional.mse_loss(scores(triples), torch.tensor([t[2] for t in triples]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    held_out = synthetic_pairs(prompts, prefers, make, force, 512, random.Random(seed + 1))
    with torch.inference_mode():
        predicted = scores(held_out) > 0.5
    save(model, tokenizer, out_dir)
    return sum(bool(p) == bool(t[2]) for p, t in zip(predicted, held_out)) / len(held_out)


def train_digit_preference(out_dir: Path, digit: str = "7", longest: int = 3, steps: int = 200) -> float:
    """A reward model that prefers completions (of up to `longest` characters) containing `digit`, trained on the
    built-in prompts; returns its held-out accuracy."""

    def with_digit(rng: random.Random, completion: str) -> str:
        at = rng.randrange(len(completion)) if completion else 0
        return completion[:at] + digit + completion[at + 1:]

    return train_reward_model(out_dir, lambda completion: digit in completion, PROMPTS,
                              lambda rng: random_completion(rng, longest), with_digit, steps=steps)
