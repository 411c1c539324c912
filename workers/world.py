"""The torch.distributed world of a ranked executor (the trainer, the critic): its device, its process group, its
FSDP2 sharding, and the commands rank 0 runs on every rank.

Rank 0 decides (the controller in the trainer, the gRPC service in the critic); every rank executes the same command
at the same time, because training, checkpoint gathering and weight pushes are collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Long enough for rank 0 to wait out a slow generation batch between two commands.
DIST_TIMEOUT = timedelta(minutes=30)


def rank_device(gpus: int, environ: Mapping[str, str]) -> torch.device:
    """The GPU of this process among its pod's (LOCAL_RANK, as torchrun sets it; 0 when absent), or the CPU."""
    return torch.device("cuda", int(environ.get("LOCAL_RANK", 0))) if gpus else torch.device("cpu")


def init_world(device: torch.device, rank: int, world_size: int, key: str) -> None:
    """NCCL on GPUs, gloo on CPUs (MASTER_ADDR/PORT from the environment); NCCL's object broadcasts use the
    current device, so set it first. The rendezvous keys live under `key` (auth.sync_key of the job's token), as a
    weight-sync group's do: a process without the token cannot take a rank in the store rank 0 hosts."""
    if not key:
        raise ValueError("a ranked world needs the job's sync key (auth.sync_key of its token)")
    # As torch's env:// rendezvous builds it, keyed.
    store = dist.PrefixStore(f"{key}/world/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=rank == 0,
        timeout=DIST_TIMEOUT, multi_tenant=True))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=DIST_TIMEOUT,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=DIST_TIMEOUT)


def shard(model: nn.Module, layers: Iterable[nn.Module]) -> None:
    """FSDP2: each decoder layer is its own unit (gathered only while it runs), then the rest."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


class Commands:
    """Rank 0 runs a named handler on every rank; the other ranks follow until rank 0 stops them."""

    def __init__(self, rank: int, world_size: int, handlers: Mapping[str, Callable[..., Any]]):
        self.rank, self.world_size, self.handlers = rank, world_size, handlers

    def command(self, name: str, *args: Any) -> Any:
        """Rank 0: run `name` on every rank (each rank runs its part) and return rank 0's result."""
        if self.world_size > 1:
            dist.broadcast_object_list([(name, args)], src=0)
        return self.handlers[name](*args)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it says stop."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            name, args = box[0]
            self.handlers[name](*args)

    def stop(self) -> None:
        """Rank 0: release the followers."""
        if self.rank == 0 and self.world_size > 1:
            dist.broadcast_object_list([None], src=0)
