"""Trainer side of weight sync: pack the new weights once, push them to every generator replica."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from rlfleet.v1 import generator_pb2
from rlfleet.workers.sync.buckets import BucketLayout
from rlfleet.workers.sync.weights import GroupAddress, WeightSender

log = logging.getLogger(__name__)
GENERATOR_RANK = 1
GROUP_SIZE = 2


class WeightPublisher:
    """Owns the reused buckets and one sync group per generator replica.

    `publish` packs synchronously (the trainer may change its weights right after) and transfers in a
    background thread, so the next training step overlaps the transfer.
    """

    def __init__(self, model: torch.nn.Module, job_id: str, stubs: list[Any], sync_addresses: list[str], *,
                 backend: str, timeout: float, bucket_bytes: int, dtype: str):
        self.job_id = job_id
        self.stubs = stubs
        self.timeout = timeout
        shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
        self.layout = BucketLayout.plan(shapes, dtype, bucket_bytes)
        self.buckets = self.layout.allocate()
        self.senders = [self._connect(stub, address, backend) for stub, address in zip(stubs, sync_addresses)]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self.pending = None
        self.last_timings: dict[str, float] = {}
        self.on_published: Callable[[int], None] | None = None

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.wait()
        start = time.perf_counter()
        self.layout.pack(dict(model.named_parameters()), self.buckets)
        pack_seconds = time.perf_counter() - start
        self.pending = self.pool.submit(self._transfer, version, pack_seconds)

    def wait(self) -> dict[str, float]:
        """Block until the last publish reached every generator; re-raises its error."""
        if self.pending is not None:
            self.last_timings = self.pending.result()
            self.pending = None
        return self.last_timings

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _transfer(self, version: int, pack_seconds: float) -> dict[str, float]:
        timings = {"sync_pack_seconds": pack_seconds, "sync_transfer_seconds": 0.0, "sync_load_seconds": 0.0}
        for stub, sender in zip(self.stubs, self.senders):
            request = generator_pb2.UpdateWeightsRequest(job_id=self.job_id, policy_version=version)
            reply = stub.UpdateWeights.future(request, timeout=self.timeout)
            timings["sync_transfer_seconds"] += sender.send(self.buckets)
            timings["sync_load_seconds"] += reply.result().load_seconds
        if self.on_published is not None:
            self.on_published(version)
        return timings

    def _connect(self, stub: Any, address: str, backend: str) -> WeightSender:
        host, port = address.rsplit(":", 1)
        request = generator_pb2.JoinSyncGroupRequest(
            job_id=self.job_id, store_host=host, store_port=int(port), rank=GENERATOR_RANK,
            world_size=GROUP_SIZE, backend=backend, timeout_seconds=self.timeout, dtype=self.layout.dtype,
            bucket_numels=list(self.layout.bucket_numels),
            tensors=[generator_pb2.TensorSpec(name=s.name, shape=list(s.shape), bucket=s.bucket, offset=s.offset,
                                              numel=s.numel) for s in self.layout.slots],
        )
        joined = stub.JoinSyncGroup.future(request, timeout=self.timeout)
        sender = WeightSender(GroupAddress(host, int(port), GROUP_SIZE, backend, self.timeout))
        joined.result()
        log.info("sync group with generator at %s ready (%d buckets)", address, len(self.buckets))
        return sender
