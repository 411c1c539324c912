"""Generator side of a join request: the receiver for one tensor-parallel worker."""

from __future__ import annotations

from typing import Any

import torch

from rlfleet.workers.sync.shards import ShardReceiver, SyncSettings

SETTINGS_FIELDS = ("trainers", "tp_size", "dtype", "bucket_bytes", "backend", "timeout")


def receiver_for(join: dict[str, Any], tp_rank: int, vocab_size: int, device: str | torch.device) -> ShardReceiver:
    """`join` is plain data (it crosses gRPC and vLLM's collective_rpc)."""
    settings = SyncSettings(**{name: join[name] for name in SETTINGS_FIELDS})
    shapes = {name: tuple(shape) for name, shape in join["shapes"]}
    address = settings.address(join["host"], join["port"], join["epoch"])
    return ShardReceiver(settings, address, tp_rank, shapes, vocab_size, device)
