"""Weight-sync process groups: one small group per generator replica, each with its own TCPStore.

No global world: a generator that dies or restarts only breaks its own group (DESIGN §2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def resolve_backend(backend: str, has_gpu: bool) -> str:
    """auto -> nccl on GPUs, gloo on CPUs."""
    if backend == "auto":
        return "nccl" if has_gpu else "gloo"
    return backend


@dataclass(frozen=True)
class SyncGroup:
    group: dist.ProcessGroup
    store: dist.TCPStore
    """Kept with the group: the store must outlive it."""


def open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout: float) -> SyncGroup:
    """Rank 0 hosts the store; every rank blocks here until all have joined (or the timeout passes)."""
    deadline = timedelta(seconds=timeout)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=deadline, wait_for_workers=False)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = deadline
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, deadline)
    log.info("sync group %s:%d joined as rank %d/%d (%s)", host, port, rank, world_size, backend)
    return SyncGroup(group, store)


def broadcast(sync: SyncGroup, tensor: torch.Tensor, root: int, timeout: float) -> None:
    """Broadcast with a deadline: a vanished peer raises instead of hanging."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.timeout = timedelta(seconds=timeout)
    work = sync.group.broadcast([tensor], options)
    if not work.wait(timedelta(seconds=timeout)):
        raise TimeoutError(f"weight-sync broadcast did not finish within {timeout} s")
