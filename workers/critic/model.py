"""The value model and how it learns: the policy's backbone, a linear value head, AdamW, PPO's clipped value loss.

Values are in the trainer's next-token frame: the value of the state before completion token t is read at the
position that predicts it (the prompt's last position for the first token), so V lines up with log pi token for token.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlfleet.workers.critic.config import CriticRole
from rlfleet.workers.rl.value import value_loss
from rlfleet.workers.world import collective, shard

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

    @classmethod
    def base(cls, model_dir: Path) -> "ValueModel":
        """The critic before any training: the backbone as stored, in float32 (the weights AdamW updates)."""
        from transformers import AutoModel

        return cls(AutoModel.from_pretrained(model_dir, dtype=torch.float32))

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
    """The critic's model, optimizer and version (updates so far) on one rank of the critic's world; not thread-safe
    (the server serialises). With several ranks the model is sharded FSDP2-style, and values, train, save and load
    are collective (workers.world.collective): rank 0's call runs on every rank with the same arguments, each works
    on its share of the rows, and rank 0 gets the results."""

    def __init__(self, model_dir: Path, role: CriticRole, epochs: int, mini_batches: int, seed: int,
                 device: torch.device, compute_dtype: torch.dtype = torch.float32, rank: int = 0,
                 world_size: int = 1):
        torch.manual_seed(seed)
        self.model_dir = model_dir
        self.model = ValueModel.base(model_dir).to(device)
        backbone = self.model.backbone
        self.pad_id = backbone.config.pad_token_id or 0
        self.vocab_size = backbone.config.vocab_size
        self.model.train()  # keep dropout as the config has it (0 for the models RLFleet trains)
        if world_size > 1:
            shard(self.model, backbone.layers)
        self.role, self.epochs, self.mini_batches, self.seed = role, epochs, mini_batches, seed
        self.optimizer = self._new_optimizer()
        self.device, self.compute_dtype = device, compute_dtype
        self.rank, self.world_size = rank, world_size
        self.version = 0
        self.loaded: int | None = 0
        """The step of the checkpoint the weights still equal (0: the base critic; None once trained since)."""

    @collective
    def values(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """V of the state before every completion token, per sequence (on rank 0; each rank values
        ``sequences[rank::world_size]``; the service refuses an empty request)."""
        share = sequences[self.rank :: self.world_size]
        batch = pack(share or sequences[:1], self.pad_id)  # a rank without rows runs one for the collectives
        with torch.no_grad():
            values = self._forward(batch).cpu()
        mine = [values[row][batch.mask[row]].tolist() for row in range(len(share))]
        shares = self._gathered(mine)
        if shares is None:  # not rank 0: its share went there
            return []
        return [shares[index % self.world_size][index // self.world_size] for index in range(len(sequences))]

    @collective
    def train(self, targets: Sequence[Target], step: int) -> dict[str, float]:
        """`epochs` passes over the targets in `mini_batches` optimizer steps each, every step's rows dealt to the
        ranks; its loss is the token mean over all ranks' rows. Returns the loss of the values the advantages used
        (the old ones: it falls as the critic learns), and the first pass's clip fraction."""
        start = time.perf_counter()
        batch = pack([(t.prompt_ids, t.completion_ids) for t in targets], self.pad_id)
        returns = placed([t.returns for t in targets], batch.mask)
        old = placed([t.old_values for t in targets], batch.mask)
        before, found = value_loss(old, old, returns, batch.mask, None)
        clipped = torch.zeros((), dtype=torch.float64)
        for epoch in range(self.epochs):
            order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(self.seed + step + epoch))
            for rows in order.tensor_split(min(self.mini_batches, len(targets))):
                fraction = self._update(batch, returns, old, rows)
                if epoch == 0:
                    clipped += fraction
        self.version += 1
        self.loaded = None
        if self.world_size > 1:
            dist.all_reduce(clipped)
        tokens = float(batch.mask.sum())
        return {"value_loss": float(before), "value_clip_fraction": float(clipped) / max(tokens, 1.0),
                "explained_variance": found["explained_variance"],
                "value_mean": float(old[batch.mask].mean()) if batch.mask.any() else 0.0,
                "train_seconds": time.perf_counter() - start}

    def _update(self, batch: ValueBatch, returns: Tensor, old: Tensor, rows: Tensor) -> float:
        """One optimizer step on the mini-batch `rows`, this rank's share ``rows[rank::world_size]``; returns the
        share's tokens whose clipped term was chosen."""
        mine = rows[self.rank :: self.world_size]
        total = float(batch.mask[rows].sum())  # the step's tokens over every rank: the loss's normalizer
        picked = mine if len(mine) else rows[:1]  # a rank without rows runs one, masked out, for the collectives
        share = _rows(batch, picked)
        mask = share.mask.to(self.device) if len(mine) else torch.zeros_like(share.mask, device=self.device)
        loss, metrics = value_loss(self._forward(share), old[picked].to(self.device),
                                   returns[picked].to(self.device), mask, self.role.value_clip or None,
                                   normalizer=max(total, 1.0))
        # FSDP averages gradients over ranks; the loss is divided by every rank's tokens already, so scaling by
        # the world size turns that average into the sum.
        (loss * self.world_size).backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.role.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            log.warning("critic gradient norm is %s: update skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return metrics["value_clip_fraction"] * float(mask.sum())

    def _forward(self, batch: ValueBatch) -> Tensor:
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            return self.model(batch.input_ids.to(self.device), batch.attention_mask.to(self.device))

    def _gathered(self, mine: list) -> list[list] | None:
        """Every rank's `mine`, by rank, on rank 0; None on the others."""
        if self.world_size == 1:
            return [mine]
        shares: list | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(mine, shares, dst=0)
        return shares

    @collective
    def save(self, root: Path, step: int, keep: int) -> None:
        """Weights, optimizer and version as root/step-N.pt (gathered to rank 0, which writes), written whole or
        not at all. The `keep` newest before it stay too: the controller saves the critic's checkpoint of a step
        before the trainer writes its own, so until then the trainer would resume from the one before."""
        model, optimizer = self._full_state()
        if self.rank != 0:
            return
        root.mkdir(parents=True, exist_ok=True)
        partial = root / f".{CHECKPOINT_PREFIX}{step:08d}.pt.partial"
        torch.save({"model": model, "optimizer": optimizer, "version": self.version, "step": step}, partial)
        partial.replace(root / f"{CHECKPOINT_PREFIX}{step:08d}.pt")
        for old in [saved for saved in saved_steps(root) if saved < step][:-keep]:
            (root / f"{CHECKPOINT_PREFIX}{old:08d}.pt").unlink()

    @collective
    def load(self, root: Path, step: int | None = None) -> int | None:
        """The checkpoint of `step` (None: the newest; 0, or no checkpoint at all: the base critic); returns the
        step loaded, None if there is no checkpoint of `step` (nothing changed). The ranks share their pod's run
        directory, so each finds the same steps; rank 0 reads the file and the others get their shards from it.
        A resumed run's Restore usually names the checkpoint the critic loaded as it started: not read twice."""
        steps = saved_steps(root)
        step = step if step is not None else (steps[-1] if steps else 0)
        if step == self.loaded:
            return step
        if step == 0:
            self._reset()
            return 0
        if step not in steps:
            return None
        path = root / f"{CHECKPOINT_PREFIX}{step:08d}.pt"
        state = torch.load(path, map_location="cpu") if self.rank == 0 else {"model": {}, "optimizer": {},
                                                                              "version": 0}
        self._set_state(state["model"], state["optimizer"])
        self.version = self._from_rank0(state["version"])
        self.loaded = step
        return step

    def _reset(self) -> None:
        """Back to the base critic (a trainer that restarts from its base policy): weights, optimizer, version."""
        self._set_weights(ValueModel.base(self.model_dir).state_dict() if self.rank == 0 else {})
        self.optimizer = self._new_optimizer()
        self.version = 0
        self.loaded = 0

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.role.learning_rate, fused=True)

    def _full_state(self) -> tuple[dict, dict]:
        """Whole weights and optimizer state (by parameter name, whatever the world size) on rank 0's CPU."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(self.model, options=options),
                get_optimizer_state_dict(self.model, self.optimizer, options=options))

    def _set_state(self, model: dict, optimizer: dict) -> None:
        self._set_weights(model)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=self._load_options())

    def _set_weights(self, model: dict) -> None:
        """Whole weights (rank 0's; the others pass {}) into every rank's shard."""
        if self.world_size > 1:
            self.model.reshard()  # a forward without backward (values) leaves the root's parameters gathered
        set_model_state_dict(self.model, model, options=self._load_options())

    def _load_options(self) -> StateDictOptions:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world_size > 1)

    def _from_rank0(self, value: int) -> int:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def saved_steps(root: Path) -> list[int]:
    """Steps of the checkpoints under root, oldest first."""
    names = root.glob(f"{CHECKPOINT_PREFIX}*.pt") if root.is_dir() else []
    return sorted(int(path.stem.removeprefix(CHECKPOINT_PREFIX)) for path in names)


def _rows(batch: ValueBatch, rows: Tensor) -> ValueBatch:
    return ValueBatch(batch.input_ids[rows], batch.attention_mask[rows], batch.mask[rows])
