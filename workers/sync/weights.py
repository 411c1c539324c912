"""Full-tensor weight push from a trainer to one generator replica over its own sync group."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from rlfleet.workers.sync.buckets import BucketLayout, Slot
from rlfleet.workers.sync.group import broadcast, open_group

SENDER_RANK = 0


@dataclass(frozen=True)
class GroupAddress:
    """Where a generator replica's sync group meets; the trainer (rank 0) hosts the store."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout: float


def layout_to_dict(layout: BucketLayout) -> dict[str, Any]:
    """Plain data, so it crosses gRPC and vLLM's collective_rpc unchanged."""
    return {"dtype": layout.dtype, "bucket_numels": list(layout.bucket_numels), "slots": [asdict(s) for s in layout.slots]}


def layout_from_dict(data: dict[str, Any]) -> BucketLayout:
    slots = tuple(Slot(s["name"], tuple(s["shape"]), s["bucket"], s["offset"], s["numel"]) for s in data["slots"])
    return BucketLayout(slots, tuple(data["bucket_numels"]), data["dtype"])


class WeightSender:
    """Trainer side: broadcasts already packed buckets to one generator replica."""

    def __init__(self, address: GroupAddress):
        self.address = address
        self.group = open_group(address.host, address.port, SENDER_RANK, address.world_size, address.backend, address.timeout)

    def send(self, buckets: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for bucket in buckets:
            broadcast(self.group, bucket, SENDER_RANK, self.address.timeout)
        return time.perf_counter() - start


class WeightReceiver:
    """Generator side: joins the group once, then receives into the same buckets every version."""

    def __init__(self, address: GroupAddress, rank: int, layout: BucketLayout, device: str | torch.device):
        self.address = address
        self.layout = layout
        self.buckets = layout.allocate(device)
        self.group = open_group(address.host, address.port, rank, address.world_size, address.backend, address.timeout)

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Blocks until every bucket arrived; yields (HF name, view) pairs for the model's loader."""
        for bucket in self.buckets:
            broadcast(self.group, bucket, SENDER_RANK, self.address.timeout)
        return self.layout.unpack(self.buckets)
