"""Weight-sync process groups: one small group per generator replica, each with its own TCPStore.

No global world: a generator that dies or restarts only breaks its own group, and it rejoins under
a fresh key prefix (epoch) of the same store (DESIGN §2).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
# The stores this process hosts, by (host, port): trainer rank 0 hosts each replica's store for the whole run.
_STORES: dict[tuple[str, int], dist.TCPStore] = {}
# NCCL works complete on the GPU, not in the waiting thread: their deadline is a poll of is_completed().
NCCL_POLL_SECONDS = 0.005
# 2 = CleanUpOnly: when a sync work times out, NCCL's watchdog aborts that group's communicators and
# leaves the process alive (the default, 3, tears the whole process down). Each ProcessGroupNCCL reads
# it when it is built, so the trainer's own world, built earlier, keeps the default.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
# The key each rank sets in its epoch's store as it enters the rendezvous.
ARRIVED = "arrived/"


def resolve_backend(backend: str, has_gpu: bool) -> str:
    """auto -> nccl on GPUs, gloo on CPUs."""
    if backend == "auto":
        return "nccl" if has_gpu else "gloo"
    return backend


def wire_device(backend: str, device: str | torch.device) -> torch.device:
    """Where a tensor must live to travel: NCCL moves CUDA memory, gloo host memory (CUDA tensors are
    staged through host buffers)."""
    device = torch.device(device)
    if backend != "nccl":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"weight sync over NCCL needs CUDA tensors; this rank holds its weights on {device}")
    # "cuda" alone means the current device; tensors report theirs with an index, and devices are compared.
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


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
    store = _epoch_store(address, rank == 0)
    store.set(f"{ARRIVED}{rank}", "1")  # for arrived(): this rank now waits for the others
    if address.backend == "nccl":
        os.environ[NCCL_ERROR_HANDLING[0]] = NCCL_ERROR_HANDLING[1]
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = deadline
        group = dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, address.world_size, deadline)
    log.info("sync group %s:%d epoch %d joined as rank %d/%d (%s)", address.host, address.port, address.epoch,
             rank, address.world_size, address.backend)
    return SyncGroup(group, address, rank)


def arrived(address: GroupAddress, ranks: range) -> bool:
    """Trainer rank 0, which hosts the store: whether these ranks wait in this epoch's rendezvous (never blocks).
    Joining after them takes no longer than the rendezvous itself."""
    return _epoch_store(address, True).check([f"{ARRIVED}{rank}" for rank in ranks])


def _epoch_store(address: GroupAddress, is_master: bool) -> dist.PrefixStore:
    return dist.PrefixStore(f"epoch{address.epoch}/", _store(address, is_master))


def _store(address: GroupAddress, is_master: bool) -> dist.TCPStore:
    """The host's store lives as long as its process; a client connects afresh on every join, since the
    host may have restarted since the last one (a trainer pod restarts while its generators live on)."""
    key = (address.host, address.port)
    if is_master and key in _STORES:
        return _STORES[key]
    store = dist.TCPStore(address.host, address.port, is_master=is_master,
                          timeout=timedelta(seconds=address.timeout), wait_for_workers=False)
    if is_master:
        _STORES[key] = store
    return store


def broadcast(sync: SyncGroup, tensor: torch.Tensor, root: int) -> None:
    """Broadcast with a deadline: a vanished peer raises instead of hanging."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.timeout = timedelta(seconds=sync.address.timeout)
    wait_all(sync, [sync.group.broadcast([tensor], options)], deadline_after(sync), "broadcast")


def send(sync: SyncGroup, tensor: torch.Tensor, dst: int, tag: int):
    """Start a point-to-point send; finish it with wait_all. NCCL ignores tags: both sides must post
    their sends and receives to one peer in the same order."""
    return sync.group.send([tensor], dst, tag)


def recv(sync: SyncGroup, tensor: torch.Tensor, src: int, tag: int):
    return sync.group.recv([tensor], src, tag)


def wait_all(sync: SyncGroup, works: list, deadline: float, what: str) -> None:
    """Wait for every work by one deadline (time.monotonic), not one timeout per work."""
    for work in works:
        if sync.address.backend == "nccl":
            _wait_nccl(sync, work, deadline, what)
        elif not work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic()))):
            raise TimeoutError(f"weight-sync {what} did not finish by its deadline")


def _wait_nccl(sync: SyncGroup, work, deadline: float, what: str) -> None:
    # An NCCL work's wait() only orders the current CUDA stream after it and returns at once, so it
    # cannot time out: poll, and on the deadline abort the communicators (which ends the stuck kernels;
    # the group is dead, and the peer rejoins under a new epoch).
    while not work.is_completed():
        if time.monotonic() > deadline:
            sync.group.abort()
            raise TimeoutError(f"weight-sync {what} did not finish by its deadline (NCCL group aborted)")
        time.sleep(NCCL_POLL_SECONDS)
    work.wait()  # raises what NCCL's watchdog recorded, if it failed the work


def deadline_after(sync: SyncGroup) -> float:
    return time.monotonic() + sync.address.timeout
