"""Weight-sync process groups: one small group per generator replica, each with its own TCPStore.

No global world: a generator that dies or restarts only breaks its own group, and it rejoins under
a fresh key prefix (epoch) of the same store (DESIGN §2).

A store has no authentication of its own, so every key lives under the job's sync key (auth.sync_key, from
the token): a process that reaches the port without the token can neither find a group's keys nor join it.
The store listens only on its host's address (loopback in a local run), not on every interface.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
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
LOOPBACK = "127.0.0.1"
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
    key: str = ""
    """The job's sync key (auth.sync_key): the prefix of every key of the group in its store."""


@dataclass(frozen=True)
class SyncGroup:
    group: dist.ProcessGroup
    address: GroupAddress
    rank: int


def open_group(address: GroupAddress, rank: int) -> SyncGroup:
    """Blocks until every rank has joined this epoch's group (or the timeout passes)."""
    if not address.key:
        raise ValueError("a weight-sync group needs the job's sync key (auth.sync_key of its token)")
    deadline = timedelta(seconds=address.timeout)
    store = _epoch_store(address, rank == 0)
    store.set(f"{ARRIVED}{rank}", "1")  # for arrived(): this rank now waits for the others
    if address.backend == "nccl":
        os.environ[NCCL_ERROR_HANDLING[0]] = NCCL_ERROR_HANDLING[1]
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = deadline
        group = dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, address.world_size, _gloo_options(address.host, deadline))
    log.info("sync group %s:%d epoch %d joined as rank %d/%d (%s)", address.host, address.port, address.epoch,
             rank, address.world_size, address.backend)
    return SyncGroup(group, address, rank)


def arrived(address: GroupAddress, ranks: range) -> bool:
    """Trainer rank 0, which hosts the store: whether these ranks wait in this epoch's rendezvous (never blocks).
    Joining after them takes no longer than the rendezvous itself."""
    return _epoch_store(address, True).check([f"{ARRIVED}{rank}" for rank in ranks])


def _epoch_store(address: GroupAddress, is_master: bool) -> dist.PrefixStore:
    return dist.PrefixStore(f"{address.key}/epoch{address.epoch}/", _store(address, is_master))


def _store(address: GroupAddress, is_master: bool) -> dist.TCPStore:
    """The host's store lives as long as its process; a client connects afresh on every join, since the
    host may have restarted since the last one (a trainer pod restarts while its generators live on)."""
    key = (address.host, address.port)
    if is_master and key in _STORES:
        return _STORES[key]
    listening = _listen(address.host, address.port).detach() if is_master else None
    store = dist.TCPStore(address.host, address.port, is_master=is_master,
                          timeout=timedelta(seconds=address.timeout), wait_for_workers=False,
                          master_listen_fd=listening)
    if is_master:
        _STORES[key] = store
    return store


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on the address `host` resolves to: the address its clients reach it by (the pod's, or
    loopback), never every interface, which is where TCPStore listens when it opens the port itself."""
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted trainer takes its port back at once
    try:
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback (a local run's addresses)."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def _gloo_options(store_host: str, deadline: timedelta) -> dist.ProcessGroupGloo._Options:
    """Gloo listens on one address per rank: loopback when the group meets on loopback (a local run, whatever
    the machine's name resolves to), else the address this host's name resolves to (a pod's own)."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = deadline
    device = (dist.ProcessGroupGloo.create_device(hostname=LOOPBACK) if _is_loopback(store_host)
              else dist.ProcessGroupGloo.create_default_device())
    options._devices = [device]
    return options


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
