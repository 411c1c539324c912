"""Rank 0's links to the generator replicas: join their sync groups, push versions, rejoin after failures.

Every method that runs a trainer command is called from the controller's main thread only: the
commands are collective over the trainer ranks and must not interleave.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from rlfleet.v1 import generator_pb2
from rlfleet.workers import wire
from rlfleet.workers.controller.rollouts import GeneratorDown, Stopped
from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.sync.shards import SyncSettings, global_shapes

log = logging.getLogger(__name__)
# How long a health probe of a generator that went away may take.
PROBE_SECONDS = 0.5


class VersionGate:
    """The newest policy version one generator holds; its producer waits here to respect maxStaleness."""

    def __init__(self, version: int):
        self.version = version
        self.down = False
        self._cond = threading.Condition()
        self._stopped = False

    def advance(self, version: int) -> None:
        with self._cond:
            self.version = max(self.version, version)
            self.down = False
            self._cond.notify_all()

    def set_down(self) -> None:
        with self._cond:
            self.down = True
            self._cond.notify_all()

    def wait_up(self) -> bool:
        """Until the generator is up (True); Stopped when the loop ends."""
        with self._cond:
            self._cond.wait_for(lambda: not self.down or self._stopped)
            if self._stopped:
                raise Stopped()
            return True

    def wait_for(self, version: int) -> None:
        """Until the generator holds `version` or newer; GeneratorDown if it goes down first, Stopped
        when the loop ends."""
        with self._cond:
            self._cond.wait_for(lambda: self.version >= version or self.down or self._stopped)
            if self._stopped:
                raise Stopped()
            if self.down:
                raise GeneratorDown("down while waiting for new weights")

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


class GeneratorLinks:
    def __init__(self, ctx: WorkerContext, trainer: Any, stubs: list[Any], version: int):
        self.ctx = ctx
        self.job_id = ctx.job.metadata.name
        self.trainer = trainer
        self.stubs = stubs
        self.settings = SyncSettings.from_job(ctx.job)
        self.shapes = global_shapes(trainer.model)
        self.version = version
        self.gates = [VersionGate(version) for _ in stubs]
        self.epochs = [0] * len(stubs)
        self.down: set[int] = set()
        self.timings: dict[str, float] = {}
        self._replies: list[grpc.Future] = []
        self._lock = threading.Lock()

    def join_all(self) -> None:
        for replica in range(len(self.stubs)):
            self._join(replica)
        if self.version > 0:  # resumed: generators start from the base weights
            self.publish(self.version)
            self.wait()

    def publish(self, version: int, replicas: list[int] | None = None) -> dict[str, float]:
        """Push `version` to the live replicas (or the given ones); returns once packed (the sends
        overlap what comes next) with the timings of the previous push."""
        previous = self.wait()
        targets = [g for g in range(len(self.stubs)) if g not in self.down] if replicas is None else replicas
        start = time.perf_counter()
        request = generator_pb2.UpdateWeightsRequest(job_id=self.job_id, policy_version=version)
        self._replies, self.timings = [], {}
        for replica in targets:
            reply = self.stubs[replica].UpdateWeights.future(request, timeout=self.settings.timeout)
            reply.add_done_callback(lambda f, g=replica: self._replied(g, version, f, start))
            self._replies.append(reply)
        packed = self.trainer.command("publish", targets)
        with self._lock:
            self.timings["sync_pack_seconds"] = packed
        self.version = version
        return previous

    def wait(self) -> dict[str, float]:
        """Until every replica answered the last push (or failed); returns that push's timings."""
        for reply in self._replies:
            try:
                reply.result()
            except grpc.RpcError:
                pass  # reported by _replied
        self._replies = []
        with self._lock:
            return dict(self.timings)

    def mark_down(self, replica: int, reason: Any) -> None:
        with self._lock:
            if replica not in self.down:
                log.error("generator replica %d is down (%s); going on with the others", replica, reason)
            self.down.add(replica)
        self.gates[replica].set_down()

    def rejoin_returned(self) -> None:
        """Replicas that are down but answer health checks again rejoin and get the current weights."""
        for replica in sorted(self.down):
            if not self._healthy(replica):
                continue
            log.info("generator replica %d is back: rejoining at version %d", replica, self.version)
            self.wait()
            self._join(replica)
            self.publish(self.version, [replica])
            self.wait()
            with self._lock:
                self.down.discard(replica)

    def stop(self) -> None:
        for gate in self.gates:
            gate.stop()

    def _join(self, replica: int) -> None:
        self.epochs[replica] += 1
        host, port = self.ctx.endpoints.sync[replica].rsplit(":", 1)
        request = generator_pb2.JoinSyncGroupRequest(
            job_id=self.job_id, store_host=host, store_port=int(port), trainers=self.settings.trainers,
            backend=self.settings.backend, timeout_seconds=self.settings.timeout, dtype=self.settings.dtype,
            bucket_bytes=self.settings.bucket_bytes, epoch=self.epochs[replica],
            params=[generator_pb2.ParamShape(name=n, shape=list(s)) for n, s in self.shapes.items()],
        )
        joined = self.stubs[replica].JoinSyncGroup.future(request, timeout=self.settings.timeout)
        self.trainer.command("connect", replica, host, int(port), self.epochs[replica])
        joined.result()

    def _replied(self, replica: int, version: int, reply: grpc.Future, start: float) -> None:
        try:
            answer = reply.result()
        except grpc.RpcError as error:
            self.mark_down(replica, f"weight push failed: {error.code().name}")
            return
        with self._lock:
            self.timings["sync_seconds"] = max(self.timings.get("sync_seconds", 0.0), time.perf_counter() - start)
            self.timings["sync_receive_seconds"] = max(self.timings.get("sync_receive_seconds", 0.0),
                                                       answer.receive_seconds)
            self.timings["sync_load_seconds"] = max(self.timings.get("sync_load_seconds", 0.0), answer.load_seconds)
        self.gates[replica].advance(version)

    def _healthy(self, replica: int) -> bool:
        try:
            wire.wait_ready(self.ctx.endpoints.generators[replica], PROBE_SECONDS)
            return True
        except Exception:  # noqa: BLE001 - anything short of SERVING means not back yet
            return False
