"""DDMA: every trainer rank sends its own shards straight to the generator ranks that need them.

Both sides compute the same routes (sync/plan.py) from the parameter shapes and the two layouts, pack
into flat buckets allocated once, and move them with point-to-point sends over one sync group per
generator replica (gloo here, NCCL on GPUs). A replica that fails is reported and skipped; the
others go on, and it can rejoin later under a new epoch.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlfleet.workers.models.precision import weights_dtype
from rlfleet.workers.plan import replica_job, role_spec
from rlfleet.workers.spec import RLJob
from rlfleet.workers.sync.buckets import DTYPES
from rlfleet.workers.sync.checksum import checksums
from rlfleet.workers.sync.group import (
    GroupAddress,
    arrived,
    SyncGroup,
    deadline_after,
    open_group,
    resolve_backend,
    send,
    wait_all,
    wire_device,
)
from rlfleet.workers.sync.plan import (GeneratorLayout, Route, RouteBuckets, TrainerLayout, as_2d, layer_count,
                                       plan_routes)

log = logging.getLogger(__name__)


def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter (FSDP2 DTensors hold Shard(0) pieces; plain ones are whole)."""
    return {name: getattr(p, "to_local", lambda p=p: p)() for name, p in model.named_parameters()}


def global_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def row_widths(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Columns of each parameter seen as [rows, cols]: what makes a block whole rows, hence direct."""
    return {name: as_2d(shape)[1] for name, shape in shapes.items()}


def travels_as_is(tensor: torch.Tensor, wire: torch.device, dtype: torch.dtype) -> bool:
    """Whether a view of a shard can be sent without a copy: only from the wire's device, in its dtype."""
    return tensor.device == wire and tensor.dtype == dtype


@dataclass
class SyncSettings:
    """What both sides must agree on, from the job."""

    trainers: int
    tp_size: int
    dtype: str
    """The wire dtype: the generators' weights dtype (model.dtype), float32 for LoRA factors (receiving.py:
    AdapterReceiver); trainers cast while packing."""
    bucket_bytes: int
    backend: str
    timeout: float
    verify: bool = False
    """Trainers send each route's checksums after its data (sync/checksum.py)."""
    key: str = ""
    """The job's sync key (auth.sync_key of its token), which each side derives itself: never sent over gRPC."""
    stages: int = 1
    """The trainers' pipeline stages (plan.TrainerLayout): which ranks hold each parameter."""

    def address(self, host: str, port: int, epoch: int) -> GroupAddress:
        return GroupAddress(host, port, self.trainers + self.tp_size, self.backend, self.timeout, epoch, self.key)

    @classmethod
    def from_job(cls, job: RLJob, role: str = "generator", key: str = "", replica: int = 0) -> SyncSettings:
        """Between the trainers and replica `replica` of `role`: a generator (its pool's tensor-parallel size and
        devices) or the reference executor (one worker a replica). `key` is needed to join a group, not to describe
        one."""
        spec = job.spec
        receiver = role_spec(replica_job(job, role, replica), role)
        return cls(
            trainers=spec.roles.trainer.world_size,
            tp_size=receiver.tensor_parallel_size if role == "generator" else 1,
            # LoRA factors are few bytes: in float32 the generators' merge equals a merged checkpoint's.
            dtype="float32" if spec.training.lora else weights_dtype(job),
            bucket_bytes=spec.weight_sync.bucket_mb << 20,
            backend=resolve_backend(spec.weight_sync.backend, receiver.resources.gpu > 0),
            timeout=spec.weight_sync.timeout_seconds,
            verify=spec.weight_sync.verify,
            key=key,
            stages=spec.roles.trainer.pipeline_parallel,
        )


@dataclass
class Outgoing:
    """One route's buckets on the sending trainer rank, and a copy of each direct block that cannot
    travel as a view of the shard (other device or dtype than the wire), made on first need."""

    route: Route
    packer: RouteBuckets
    buckets: list[torch.Tensor] = field(default_factory=list)
    copies: dict[int, torch.Tensor] = field(default_factory=dict)
    sums: torch.Tensor | None = None
    """The checksums of the push in flight (kept alive until sent)."""


class RolePublishers:
    """Trainer side, for one receiving role: a ShardPublisher per sync plan its replicas need (generator pools of
    different tensor parallelism or devices), each replica sent by its own plan's. Publishers are made on a
    replica's first connect, which every trainer rank runs in the same order (a collective call)."""

    def __init__(self, job: RLJob, role: str, key: str, make: Callable[[SyncSettings], ShardPublisher]):
        self.job, self.role, self.key, self.make = job, role, key, make
        self.publishers: dict[tuple[int, str], ShardPublisher] = {}
        self._plans: dict[int, tuple[int, str]] = {}
        """Each replica's plan, resolved from the job once, not on every push."""

    def plan_of(self, replica: int) -> tuple[int, str]:
        """The replica's plan (tensor-parallel size, backend), its publisher made if it is the plan's first."""
        if replica not in self._plans:
            settings = SyncSettings.from_job(self.job, self.role, self.key, replica)
            plan = self._plans[replica] = (settings.tp_size, settings.backend)
            if plan not in self.publishers:
                self.publishers[plan] = self.make(settings)
        return self._plans[replica]

    def of(self, replica: int) -> ShardPublisher:
        return self.publishers[self.plan_of(replica)]

    def connect(self, replica: int, host: str, port: int, epoch: int) -> str | None:
        return self.of(replica).connect(replica, host, port, epoch)

    def arrived(self, replica: int, host: str, port: int, epoch: int) -> bool:
        """Whether the replica's ranks wait in the rendezvous of `epoch` (its store hosted here, at the first call).
        Never blocks, and makes no publisher: rank 0 alone calls it."""
        settings = SyncSettings.from_job(self.job, self.role, self.key, replica)
        address = settings.address(host, port, epoch)
        try:
            return arrived(address, range(settings.trainers, address.world_size))
        except RuntimeError:  # the store cannot be hosted: the trainers' join says why, and the rejoin is retried
            return True

    def publish(self, shards: dict[str, torch.Tensor], replicas: list[int]) -> float:
        """Each plan's replicas from its publisher; returns the pack seconds of them all."""
        by_plan: dict[tuple[int, str], list[int]] = {}
        for replica in replicas:
            by_plan.setdefault(self.plan_of(replica), []).append(replica)
        return sum(self.publishers[plan].publish(shards, members) for plan, members in by_plan.items())

    def release_shards(self) -> float:
        return sum(publisher.release_shards() for publisher in self.publishers.values())

    def close(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()


class ShardPublisher:
    """Trainer side: packs once per version, then sends to every live replica in a background thread.

    A generator must only ever get one whole version, so nothing may change the shards a push still reads
    (DESIGN §2). Large blocks of whole rows travel as views of the live shards when the shards are on the
    wire's device in its dtype; the caller then calls `release_shards()` before its optimizer step, which
    waits for those sends. With `snapshot`, every such block is copied first instead (the shards are free
    once publish returns, for the price of a copy of them and the memory it takes).
    """

    def __init__(self, rank: int, settings: SyncSettings, shapes: dict[str, tuple[int, ...]], vocab_size: int,
                 device: str | torch.device = "cpu", snapshot: bool = False):
        self.rank = rank
        self.snapshot = snapshot
        self.settings = settings
        self.wire = wire_device(settings.backend, device)
        self.dtype = DTYPES[settings.dtype]
        layout = GeneratorLayout(settings.tp_size, vocab_size)
        routes = [r for r in plan_routes(shapes, settings.trainers, layout, settings.stages) if r.src == rank]
        widths = row_widths(shapes)
        self.outgoing = [Outgoing(r, RouteBuckets(r, self.dtype, settings.bucket_bytes, widths)) for r in routes]
        for out in self.outgoing:
            out.buckets = out.packer.allocate(self.wire)
        owners = TrainerLayout(settings.trainers, settings.stages, layer_count(shapes))
        self.first_rows = {name: owners.rows(name, shape[0], rank)[0] for name, shape in shapes.items()}
        self.groups: dict[int, SyncGroup] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self.pending: Future | None = None
        self.live = False
        """Whether the push in flight reads the live shards."""
        self.last: dict[str, Any] = {"send_seconds": 0.0, "failed": {}}

    def connect(self, replica: int, host: str, port: int, epoch: int) -> str | None:
        """Join replica's group for this epoch (blocks until its generator joins too, or the timeout).
        Returns why it failed, or None: a generator that vanishes mid-join must not end the trainer."""
        self.wait()
        self.groups.pop(replica, None)
        try:
            self.groups[replica] = open_group(self.settings.address(host, port, epoch), self.rank)
        except Exception as error:  # noqa: BLE001 - the controller retries the join later
            log.error("joining the sync group of replica %d (epoch %d) failed: %s", replica, epoch, error)
            return f"{type(error).__name__}: {error}"
        return None

    def publish(self, shards: dict[str, torch.Tensor], replicas: list[int]) -> float:
        """Pack the small blocks now, bucket by bucket, starting each bucket's sends as soon as it is
        packed; large blocks are sent straight from the shards when they can be. The sends finish in the
        background (`wait()`). Returns the pack seconds."""
        self.wait()
        live = [g for g in replicas if g in self.groups]
        works: dict[int, list] = {g: [] for g in live}
        failed: dict[int, str] = {}
        start = time.perf_counter()
        for out in self.outgoing:
            # Buckets first, then direct blocks: the receiver posts in this order (NCCL matches by order).
            for tag, bucket in enumerate(out.buckets):
                out.packer.pack_bucket(tag, shards, self.first_rows.__getitem__, bucket)
                self._send(bucket, out.route.dst, tag, live, works, failed)
            direct = self._direct(out, shards)
            for tag, tensor in enumerate(direct, len(out.buckets)):
                self._send(tensor, out.route.dst, tag, live, works, failed)
            if self.settings.verify:  # last: the receiver checks what arrived against it
                out.sums = checksums(out.buckets + direct)
                self._send(out.sums, out.route.dst, len(out.buckets) + len(direct), live, works, failed)
        packed = time.perf_counter() - start
        self.pending = self.pool.submit(self._finish, works, failed, start)
        return packed

    def release_shards(self) -> float:
        """Call before changing the weights: waits for the push in flight if it reads the live shards.
        Returns the seconds waited."""
        start = time.perf_counter()
        if self.live:
            self.wait()
        return time.perf_counter() - start

    def wait(self) -> dict[str, Any]:
        """Block until the last publish finished; returns its seconds and the replicas that failed."""
        if self.pending is not None:
            self.last, self.pending, self.live = self.pending.result(), None, False
        return self.last

    def _direct(self, out: Outgoing, shards: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each direct block as a view of the shard when it can travel as it is, else as a copy."""
        tensors = []
        for index, view in enumerate(out.packer.source_views(shards, self.first_rows.__getitem__)):
            if not self.snapshot and travels_as_is(view, self.wire, self.dtype):
                self.live = True
                tensors.append(view)
                continue
            if index not in out.copies:
                out.copies[index] = torch.empty(view.shape, dtype=self.dtype, device=self.wire)
            tensors.append(out.copies[index].copy_(view))
        return tensors

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, live: list[int], works: dict, failed: dict) -> None:
        for replica in [g for g in live if g not in failed]:
            try:
                works[replica].append(send(self.groups[replica], tensor, self.settings.trainers + dst, tag))
            except Exception as error:  # noqa: BLE001 - one replica's failure must not stop the others
                failed[replica] = str(error)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _finish(self, works: dict[int, list], failed: dict[int, str], start: float) -> dict[str, Any]:
        for replica, pending in works.items():
            if replica in failed:
                continue
            group = self.groups[replica]
            try:
                wait_all(group, pending, deadline_after(group), f"send to replica {replica}")
            except Exception as error:  # noqa: BLE001 - reported, and the replica must rejoin
                failed[replica] = str(error)
        for replica, reason in failed.items():
            log.error("weight sync to replica %d failed: %s", replica, reason)
            self.groups.pop(replica, None)
        return {"send_seconds": time.perf_counter() - start, "failed": failed}
