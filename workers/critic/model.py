"""The value model and how it learns: the policy's backbone, a linear value head, AdamW, PPO's clipped value loss.

Values are in the trainer's next-token frame: the value of the state before completion token t is read at the
position that predicts it (the prompt's last position for the first token), so V lines up with log pi token for token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from rlfleet.workers.critic.config import CriticRole
from rlfleet.workers.rl.value import value_loss

log = logging.getLogger(__name__)
CHECKPOINT_PREFIX = "step-"


@dataclass(frozen=True)
class Target:
    """A completion to learn from: its tokens, the GAE return of each and the value it had when it was sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    returns: list[float]
    old_values: list[float]


class ValueModel(nn.Module):
    """The backbone's last hidden state through a linear head. The head starts at zero: every value is 0 until the
    critic has learned something, so the first advantages are the plain returns."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


@dataclass(frozen=True)
class ValueBatch:
    input_ids: Tensor
    """``[B, L]`` each prompt and its completion but the last token, right-padded."""
    attention_mask: Tensor
    mask: Tensor
    """``[B, L]`` bool: the positions whose value is a completion token's."""


def pack(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> ValueBatch:
    """(prompt_ids, completion_ids) pairs, each non-empty."""
    rows = [list(prompt) + list(completion)[:-1] for prompt, completion in sequences]
    input_ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for row, ((prompt, completion), ids) in enumerate(zip(sequences, rows)):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        mask[row, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = True
    return ValueBatch(input_ids, attention_mask, mask)


def placed(rows: Sequence[Sequence[float]], mask: Tensor) -> Tensor:
    """Per-completion lists of floats put at the mask's positions of a ``[B, L]`` float32 tensor (0 elsewhere)."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[mask] = torch.tensor([x for row in rows for x in row], dtype=torch.float32)
    return out


class ValueTrainer:
    """The critic's model, optimizer and version (updates so far); not thread-safe (the server serialises)."""

    def __init__(self, model_dir: Path, role: CriticRole, epochs: int, mini_batches: int, seed: int,
                 device: torch.device, compute_dtype: torch.dtype = torch.float32):
        from transformers import AutoModel

        torch.manual_seed(seed)
        backbone = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
        self.pad_id = backbone.config.pad_token_id or 0
        self.vocab_size = backbone.config.vocab_size
        self.model = ValueModel(backbone).to(device)
        self.model.train()  # keep dropout as the config has it (0 for the models RLFleet trains)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=role.learning_rate, fused=True)
        self.role, self.epochs, self.mini_batches, self.seed = role, epochs, mini_batches, seed
        self.device, self.compute_dtype = device, compute_dtype
        self.version = 0
        self.loaded: int | None = None
        """The step of the checkpoint the weights still equal (None once trained since, or never loaded)."""

    def values(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """V of the state before every completion token, per sequence."""
        batch = pack(sequences, self.pad_id)
        with torch.no_grad():
            values = self._forward(batch).cpu()
        return [values[row][batch.mask[row]].tolist() for row in range(len(sequences))]

    def train(self, targets: Sequence[Target], step: int) -> dict[str, float]:
        """`epochs` passes over the targets in `mini_batches` optimizer steps each. Returns the loss of the values
        the advantages used (the old ones: it falls as the critic learns), and the first pass's clip fraction."""
        start = time.perf_counter()
        batch = pack([(t.prompt_ids, t.completion_ids) for t in targets], self.pad_id)
        returns = placed([t.returns for t in targets], batch.mask)
        old = placed([t.old_values for t in targets], batch.mask)
        before, found = value_loss(old, old, returns, batch.mask, None)
        clipped, tokens = 0.0, 0.0
        for epoch in range(self.epochs):
            order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(self.seed + step + epoch))
            for rows in order.tensor_split(min(self.mini_batches, len(targets))):
                metrics = self._update(_rows(batch, rows), returns[rows], old[rows])
                if epoch == 0:
                    clipped += metrics["value_clip_fraction"] * metrics["tokens"]
                    tokens += metrics["tokens"]
        self.version += 1
        self.loaded = None
        return {"value_loss": float(before), "value_clip_fraction": clipped / max(tokens, 1.0),
                "explained_variance": found["explained_variance"],
                "value_mean": float(old[batch.mask].mean()) if batch.mask.any() else 0.0,
                "train_seconds": time.perf_counter() - start}

    def _update(self, batch: ValueBatch, returns: Tensor, old: Tensor) -> dict[str, float]:
        mask = batch.mask.to(self.device)
        loss, metrics = value_loss(self._forward(batch), old.to(self.device), returns.to(self.device), mask,
                                   self.role.value_clip or None)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.role.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("critic gradient norm is %s: update skipped", float(grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        return metrics | {"tokens": float(mask.sum())}

    def _forward(self, batch: ValueBatch) -> Tensor:
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            return self.model(batch.input_ids.to(self.device), batch.attention_mask.to(self.device))

    def save(self, root: Path, step: int, keep: int) -> None:
        """Weights, optimizer and version as root/step-N.pt, written whole or not at all; the `keep` newest stay."""
        root.mkdir(parents=True, exist_ok=True)
        partial = root / f".{CHECKPOINT_PREFIX}{step:08d}.pt.partial"
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "version": self.version, "step": step}, partial)
        partial.replace(root / f"{CHECKPOINT_PREFIX}{step:08d}.pt")
        for old in saved_steps(root)[:-keep]:
            (root / f"{CHECKPOINT_PREFIX}{old:08d}.pt").unlink()

    def load(self, root: Path, step: int | None = None) -> int:
        """The checkpoint of `step` (None: the newest) if there is one; returns its step, 0 when none was loaded.
        A resumed run's Restore usually names the checkpoint the critic loaded as it started: not read twice."""
        steps = saved_steps(root)
        step = step if step is not None else (steps[-1] if steps else 0)
        if step == self.loaded:
            return step
        if step not in steps:
            return 0
        state = torch.load(root / f"{CHECKPOINT_PREFIX}{step:08d}.pt", map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.loaded = step
        return step


def saved_steps(root: Path) -> list[int]:
    """Steps of the checkpoints under root, oldest first."""
    names = root.glob(f"{CHECKPOINT_PREFIX}*.pt") if root.is_dir() else []
    return sorted(int(path.stem.removeprefix(CHECKPOINT_PREFIX)) for path in names)


def _rows(batch: ValueBatch, rows: Tensor) -> ValueBatch:
    return ValueBatch(batch.input_ids[rows], batch.attention_mask[rows], batch.mask[rows])
