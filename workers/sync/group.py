"""Weight-sync process groups: one small group per generator replica, each with its own TCPStore.

No global world: a generator that dies or restarts only breaks its own group, and it rejoins under
a fresh key prefix (epoch) of the same store (DESIGN §2).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
# One store per (host, port) per process: the trainer hosts each replica's store for the whole run.
_STORES: dict[tuple[str, int], dist.TCPStore] = {}


def resolve_backend(backend: str, has_gpu: bool) -> str:
    """auto -> nccl on GPUs, gloo on CPUs."""
    if backend == "auto":
        return "nccl" if has_gpu else "gloo"
    return backend


@dataclass(frozen=True)
class GroupAddress:
    """Where a generator replica's sync group meets; trainer rank 0 hosts the store."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout: float
    epoch: int = 0


@dataclass(frozen=True)
class SyncGroup:
    group: dist.ProcessGroup
    address: GroupAddress
    rank: int


def open_group(address: GroupAddress, rank: int) -> SyncGroup:
    """Blocks until every rank has joined this epoch's group (or the timeout passes)."""
    deadline = timedelta(seconds=address.timeout)
    store = dist.PrefixStore(f"epoch{address.epoch}/", _store(address, rank == 0))
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = deadline
        group = dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, address.world_size, deadline)
    log.info("sync group %s:%d epoch %d joined as rank %d/%d (%s)", address.host, address.port, address.epoch,
             rank, address.world_size, address.backend)
    return SyncGroup(group, address, rank)


def _store(address: GroupAddress, is_master: bool) -> dist.TCPStore:
    key = (address.host, address.port)
    if key not in _STORES:
        _STORES[key] = dist.TCPStore(address.host, address.port, is_master=is_master,
                                     timeout=timedelta(seconds=address.timeout), wait_for_workers=False)
    return _STORES[key]


def broadcast(sync: SyncGroup, tensor: torch.Tensor, root: int) -> None:
    """Broadcast with a deadline: a vanished peer raises instead of hanging."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.timeout = timedelta(seconds=sync.address.timeout)
    wait_all([sync.group.broadcast([tensor], options)], deadline_after(sync), "broadcast")


def send(sync: SyncGroup, tensor: torch.Tensor, dst: int, tag: int):
    """Start a point-to-point send; finish it with wait_all."""
    return sync.group.send([tensor], dst, tag)


def recv(sync: SyncGroup, tensor: torch.Tensor, src: int, tag: int):
    return sync.group.recv([tensor], src, tag)


def wait_all(works: list, deadline: float, what: str) -> None:
    """Wait for every work by one deadline (time.monotonic), not one timeout per work."""
    for work in works:
        left = max(0.001, deadline - time.monotonic())
        if not work.wait(timedelta(seconds=left)):
            raise TimeoutError(f"weight-sync {what} did not finish by its deadline")


def deadline_after(sync: SyncGroup) -> float:
    return time.monotonic() + sync.address.timeout
