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
from typing import Any, Iterator

import torch

from rlfleet.workers.spec import RLJob
from rlfleet.workers.sync.buckets import DTYPES
from rlfleet.workers.sync.group import (
    GroupAddress,
    SyncGroup,
    deadline_after,
    open_group,
    recv,
    resolve_backend,
    send,
    wait_all,
)
from rlfleet.workers.sync.plan import GeneratorLayout, Route, RouteBuckets, as_2d, plan_routes, trainer_rows

log = logging.getLogger(__name__)


def local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter (FSDP2 DTensors hold Shard(0) pieces; plain ones are whole)."""
    return {name: getattr(p, "to_local", lambda p=p: p)() for name, p in model.named_parameters()}


def global_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def direct_widths(settings: SyncSettings, shapes: dict[str, tuple[int, ...]]) -> dict[str, int] | None:
    """Blocks may travel straight from the trainer's float32 shards only if the wire dtype is float32 too;
    otherwise every block is cast while packed."""
    return {name: as_2d(shape)[1] for name, shape in shapes.items()} if settings.dtype == "float32" else None


@dataclass
class SyncSettings:
    """What both sides must agree on, from the job."""

    trainers: int
    tp_size: int
    dtype: str
    bucket_bytes: int
    backend: str
    timeout: float

    def address(self, host: str, port: int, epoch: int) -> GroupAddress:
        return GroupAddress(host, port, self.trainers + self.tp_size, self.backend, self.timeout, epoch)

    @classmethod
    def from_job(cls, job: RLJob) -> SyncSettings:
        spec = job.spec
        return cls(
            trainers=spec.roles.trainer.replicas,
            tp_size=spec.roles.generator.tensor_parallel_size,
            dtype=spec.model.dtype,
            bucket_bytes=spec.weight_sync.bucket_mb << 20,
            backend=resolve_backend(spec.weight_sync.backend, spec.roles.generator.resources.gpu > 0),
            timeout=spec.weight_sync.timeout_seconds,
        )


@dataclass
class Outgoing:
    """One route's buckets on the sending trainer rank."""

    route: Route
    packer: RouteBuckets
    buckets: list[torch.Tensor] = field(default_factory=list)


class ShardPublisher:
    """Trainer side: packs once per version, then sends to every live replica in a background thread."""

    def __init__(self, rank: int, settings: SyncSettings, shapes: dict[str, tuple[int, ...]], vocab_size: int):
        self.rank = rank
        self.settings = settings
        layout = GeneratorLayout(settings.tp_size, vocab_size)
        routes = [r for r in plan_routes(shapes, settings.trainers, layout) if r.src == rank]
        dtype, widths = DTYPES[settings.dtype], direct_widths(settings, shapes)
        self.outgoing = [Outgoing(r, RouteBuckets(r, dtype, settings.bucket_bytes, widths)) for r in routes]
        for out in self.outgoing:
            out.buckets = out.packer.allocate()
        self.first_rows = {name: trainer_rows(shape[0], settings.trainers, rank)[0] for name, shape in shapes.items()}
        self.groups: dict[int, SyncGroup] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self.pending: Future | None = None
        self.last: dict[str, Any] = {"send_seconds": 0.0, "failed": {}}

    def connect(self, replica: int, host: str, port: int, epoch: int) -> None:
        """Join replica's group for this epoch (blocks until its generator joins too)."""
        self.wait()
        self.groups[replica] = open_group(self.settings.address(host, port, epoch), self.rank)

    def publish(self, shards: dict[str, torch.Tensor], replicas: list[int]) -> float:
        """Pack the small blocks now, bucket by bucket, starting each bucket's sends as soon as it is
        packed; large blocks are sent straight from the shards. The sends finish in the background:
        the caller must `wait()` before it changes its weights. Returns the pack seconds."""
        self.wait()
        live = [g for g in replicas if g in self.groups]
        works: dict[int, list] = {g: [] for g in live}
        failed: dict[int, str] = {}
        start = time.perf_counter()
        for out in self.outgoing:
            for tag, bucket in enumerate(out.buckets):
                out.packer.pack_bucket(tag, shards, self.first_rows.__getitem__, bucket)
                self._send(bucket, out.route.dst, tag, live, works, failed)
            for tag, view in enumerate(out.packer.source_views(shards, self.first_rows.__getitem__), len(out.buckets)):
                self._send(view, out.route.dst, tag, live, works, failed)
        packed = time.perf_counter() - start
        self.pending = self.pool.submit(self._finish, works, failed, start)
        return packed

    def wait(self) -> dict[str, Any]:
        """Block until the last publish finished; returns its seconds and the replicas that failed."""
        if self.pending is not None:
            self.last, self.pending = self.pending.result(), None
        return self.last

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
            try:
                wait_all(pending, deadline_after(self.groups[replica]), f"send to replica {replica}")
            except Exception as error:  # noqa: BLE001 - reported, and the replica must rejoin
                failed[replica] = str(error)
        for replica, reason in failed.items():
            log.error("weight sync to generator replica %d failed: %s", replica, reason)
            self.groups.pop(replica, None)
        return {"send_seconds": time.perf_counter() - start, "failed": failed}


class ShardReceiver:
    """Generator side (one per tensor-parallel worker): receives its region of every parameter."""

    def __init__(self, settings: SyncSettings, address: GroupAddress, tp_rank: int,
                 shapes: dict[str, tuple[int, ...]], vocab_size: int, device: str | torch.device):
        layout = GeneratorLayout(settings.tp_size, vocab_size)
        routes = [r for r in plan_routes(shapes, settings.trainers, layout) if r.dst == tp_rank]
        dtype, widths = DTYPES[settings.dtype], direct_widths(settings, shapes)
        self.incoming = [(r, RouteBuckets(r, dtype, settings.bucket_bytes, widths)) for r in routes]
        self.buckets = [packer.allocate(device) for _, packer in self.incoming]
        names = {block.name for route, _ in self.incoming for block in route.blocks}
        # HF-shaped, as vLLM's loaders expect; only this rank's region is ever written, and on CPU the
        # untouched pages of an allocation are never made resident.
        self.targets = {name: torch.empty(shapes[name], dtype=dtype, device=device) for name in shapes if name in names}
        self.direct = [packer.target_views(self.targets) for _, packer in self.incoming]
        self.group = open_group(address, settings.trainers + tp_rank)

    def receive(self) -> None:
        """Post every receive (large blocks straight into place), then unpack each bucket as it lands."""
        direct = [recv(self.group, view, route.src, tag)
                  for (route, _), buckets, views in zip(self.incoming, self.buckets, self.direct)
                  for tag, view in enumerate(views, len(buckets))]
        packed = [(packer, tag, bucket, recv(self.group, bucket, route.src, tag))
                  for (route, packer), buckets in zip(self.incoming, self.buckets)
                  for tag, bucket in enumerate(buckets)]
        deadline = deadline_after(self.group)
        for packer, tag, bucket, work in packed:
            wait_all([work], deadline, "receive")
            packer.unpack_bucket(tag, bucket, self.targets)
        wait_all(direct, deadline, "receive")

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.targets.items())

    def swap_into(self, params: dict[str, torch.Tensor]) -> None:
        """Load by exchanging storage with whole parameters of the same shape and dtype (O(1) each): the
        model gets the new weights, the staging tensors the old ones, which the next receive overwrites."""
        with torch.no_grad():
            for name, staged in self.targets.items():
                param = params[name]
                if param.shape != staged.shape or param.dtype != staged.dtype:
                    raise ValueError(f"{name}: cannot swap {tuple(staged.shape)} {staged.dtype} into "
                                     f"{tuple(param.shape)} {param.dtype}")
                param.data, self.targets[name] = staged, param.data
        self.direct = [packer.target_views(self.targets) for _, packer in self.incoming]
