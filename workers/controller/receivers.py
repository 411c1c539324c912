"""The replicas that receive the policy's weights (generators; the reference executor) as trainer rank 0 keeps them
in step with the policy: it joins their sync groups, pushes versions, probes the replicas that are down and rejoins
those that came back.

Every method that calls the trainer (connect, publish) is called from the controller's main thread only: those
calls are collective over the trainer ranks and must not interleave. Which replica is up and which
version it holds is kept by the ReplicaStates (the generators' Dispatch composes theirs); the receivers only
report to it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc

from rlfleet.v1 import generator_pb2_grpc, weight_sync_pb2, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import sync_key
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.plan import Endpoints, WorkerContext
from rlfleet.workers.sync.shards import SyncSettings

log = logging.getLogger(__name__)
# Health probes of down replicas run in the background, so a generous deadline holds up nothing: a replica
# that was just restarted on a busy node may take seconds to answer its first call.
PROBE_SECONDS = 5.0
# A down replica is probed at most this often; failed rejoins back off up to the longest pause.
PROBE_EVERY_SECONDS = 2.0
MAX_PROBE_PAUSE_SECONDS = 60.0


def generator_stub(address: str, ctx: WorkerContext) -> Any:
    return generator_pb2_grpc.GeneratorStub(wire.channel(address, ctx.token, ctx.leader_epoch))


def weight_sync_stub(address: str, ctx: WorkerContext) -> Any:
    return weight_sync_pb2_grpc.WeightSyncStub(wire.channel(address, ctx.token, ctx.leader_epoch))


class WeightReceivers:
    """The replicas of one receiving `role` (generator or reference), whose servers answer the WeightSync service."""

    def __init__(self, ctx: WorkerContext, trainer: Any, replicas: ReplicaStates, policy: PolicyVersion,
                 role: str = "generator"):
        self.ctx = ctx
        self.role = role
        self.endpoints = ctx.endpoints
        self.job_id = ctx.job.metadata.name
        self.trainer = trainer
        self.stubs: list[Any] = [weight_sync_stub(address, ctx) if address else None
                                 for address in ctx.endpoints.of(role)]
        """Each replica's, by index; None in the gaps between generator pools' blocks."""
        self.replicas = replicas
        self.settings = SyncSettings.from_job(ctx.job, role, sync_key(ctx.token))
        self.shapes = trainer.push_shapes
        self.policy = policy
        """The trainer's policy version: what a push or a rejoin sends is labelled with it."""
        self.first_epoch = ctx.leader_epoch or 0
        """Each replica's sync-group epochs count up from the leader's epoch (leadership.EPOCH_STRIDE: why)."""
        self.epochs = [self.first_epoch] * len(self.stubs)
        self.timings: dict[str, float] = {}
        self._replies: list[grpc.Future] = []
        self._next_probe = [0.0] * len(self.stubs)
        self._failed_rejoins = [0] * len(self.stubs)
        self._push_errors: dict[int, str] = {}
        self._probes: dict[int, Future] = {}
        self._joining: dict[int, grpc.Future] = {}
        """The JoinSyncGroup calls in flight of returning replicas, each of its replica's latest epoch."""
        self._outwaited: set[int] = set()
        """Returning replicas that gave up waiting for the trainers in their group: joined at once next time."""
        self._prober = ThreadPoolExecutor(max_workers=max(1, len(self.stubs)), thread_name_prefix="health-probe")
        self._lock = threading.Lock()

    def join_all(self, push: bool = True) -> None:
        """Join every replica that is up to a new epoch of its sync group and push the trainer's weights, at version 0
        too: a generator may still hold the weights of a trainer that restarted, and must never report a version it
        does not hold. As a leader starts, every replica is up; after a trainer restart (controller/recovery.py), the
        push that failed is waited for first, and the replicas it marked down rejoin as any that came back."""
        self.wait()
        for replica in self.replicas.up():
            error = self._connect(replica, self._ask_to_join(replica))
            if error:
                self.mark_down(replica, f"joining its sync group failed: {error}")
        if push:
            self.publish()
            self.wait()

    def publish(self, replicas: list[int] | None = None) -> dict[str, float]:
        """Push the trainer's weights, of the policy's version now, to the live replicas (or the given ones); returns
        once packed (the sends overlap what comes next) with the timings of the previous push."""
        previous = self.wait()
        version = self.policy.value
        targets = self.replicas.up() if replicas is None else replicas
        start = time.perf_counter()
        request = weight_sync_pb2.UpdateWeightsRequest(job_id=self.job_id, policy_version=version)
        self._replies, self.timings = [], {}
        for replica in targets:
            # Never retried: a push is one collective send, so a failed one marks the replica down, and it rejoins
            # in a new epoch (its staged weights dropped) before it gets weights again.
            # wait_for_ready: a replica that just came back may still be reconnecting (bounded by the timeout).
            reply = self.stubs[replica].UpdateWeights.future(request, timeout=self.settings.timeout,
                                                             wait_for_ready=True)
            reply.add_done_callback(lambda f, g=replica: self._replied(g, version, f, start))
            self._replies.append(reply)
        packed = self.trainer.publish(self.role, targets)
        with self._lock:
            self.timings["sync_pack_seconds"] = packed
        return previous

    def wait(self) -> dict[str, float]:
        """Until every replica answered the last push (or failed); returns that push's timings."""
        for reply in self._replies:
            try:
                reply.result()
            except grpc.RpcError as error:
                wire.raise_if_fenced(error, f"UpdateWeights of the {self.role}s")  # a deposed controller stops
                # anything else: reported by _replied
        self._replies = []
        with self._lock:
            return dict(self.timings)

    def resize(self, endpoints: Endpoints) -> list[int]:
        """Follow the job's generators: an added replica joins like one that came back (once it answers: probed in
        the background, joined, sent the current weights, then up); a removed one leaves the rotation, and the
        batch it held goes back to the others with its tokens. Returns the replicas new to this run."""
        listed, had = endpoints.of(self.role), set(self.replicas.members())
        members = {replica for replica, address in enumerate(listed) if address}
        self.endpoints = endpoints
        grow = max(0, len(listed) - len(self.stubs))
        self.stubs += [None] * grow
        self.epochs += [self.first_epoch] * grow
        self._next_probe += [0.0] * grow
        self._failed_rejoins += [0] * grow
        new = sorted(replica for replica in members if self.stubs[replica] is None)
        self.replicas.resize(members)  # first: readers of the stubs ask the replica states about every replica listed
        for replica in new:
            self.stubs[replica] = weight_sync_stub(listed[replica], self.ctx)
        for replica in sorted(members - had):
            log.info("%s replica %d added to the job: it joins once it answers", self.role, replica)
        for replica in sorted(had - members):
            self._probes.pop(replica, None)
            self._joining.pop(replica, None)
            self._outwaited.discard(replica)
            log.info("%s replica %d removed from the job", self.role, replica)
        return new

    def mark_down(self, replica: int, reason: Any) -> None:
        if self.replicas.set_down(replica):
            log.error("%s replica %d is down (%s); going on with the others", self.role, replica, reason)

    def rejoin_returned(self) -> list[int]:
        """Replicas that are down but answer health checks again are asked to join a new epoch of their sync
        group; once one waits in it, the trainers join too and push it their weights, of the policy's version now
        (a moving reference's last push may be older). Never waits for a probe or for a
        replica's way into its group (both go on in the background: this runs between training steps); a rejoin
        that fails (a replica that never joins fails by the sync deadline) is retried later, with a growing pause,
        never fatal. Returns the replicas that rejoined."""
        rejoined = []
        for replica in self.replicas.down():
            if replica not in self._joining and self._answered(replica):
                self._joining[replica] = self._ask_to_join(replica)
            if replica in self._joining and self._rejoin_if_waiting(replica):
                rejoined.append(replica)
        return rejoined

    def _rejoin_if_waiting(self, replica: int) -> bool:
        """Rejoin once the replica waits in its group (or its join already failed); whether it rejoined."""
        joined = self._joining[replica]
        if not joined.done() and replica not in self._outwaited and not self._waiting(replica):
            return False  # still on its way in: looked at again at the next call
        del self._joining[replica]
        if joined.done() and joined.exception() is not None and self._waiting(replica):
            # It waited in its group and gave up before a step ended (steps longer than the sync deadline): its
            # next join has the trainers wait in the rendezvous at once, as they used to, holding one step.
            self._outwaited.add(replica)
        rejoined = self._rejoin_now(replica, joined)
        if rejoined:
            self._outwaited.discard(replica)
        return rejoined

    def _waiting(self, replica: int) -> bool:
        """Whether the replica's ranks wait in the rendezvous of its latest epoch: trainer rank 0 hosts its store
        (first call: starts it), so the trainer is asked."""
        return self.trainer.arrived(self.role, replica, *self._store_address(replica), self.epochs[replica])

    def _answered(self, replica: int) -> bool:
        """Whether the replica's latest background probe found it serving; starts the next probe when due."""
        probe = self._probes.get(replica)
        if probe is None:
            if time.monotonic() >= self._next_probe[replica]:
                self._probes[replica] = self._prober.submit(self._healthy, replica)
            return False
        if not probe.done():
            return False
        del self._probes[replica]
        self._next_probe[replica] = max(self._next_probe[replica], time.monotonic() + PROBE_EVERY_SECONDS)
        return probe.result()

    def _rejoin_now(self, replica: int, joined: grpc.Future) -> bool:
        version = self.policy.value
        log.info("%s replica %d is back: rejoining at version %d", self.role, replica, version)
        error = self._rejoin(replica, joined)
        if error is None:
            self._failed_rejoins[replica] = 0
            self.replicas.set_up(replica, version)
            log.info("%s replica %d rejoined at version %d", self.role, replica, version)
            return True
        self._failed_rejoins[replica] += 1
        pause = min(MAX_PROBE_PAUSE_SECONDS, PROBE_EVERY_SECONDS * 2 ** self._failed_rejoins[replica])
        self._next_probe[replica] = time.monotonic() + pause
        log.warning("%s replica %d could not rejoin (%s); trying again in %.0f s", self.role, replica, error, pause)
        return False

    def stop(self) -> None:
        self.replicas.stop()
        self._prober.shutdown(wait=False, cancel_futures=True)
        for joined in self._joining.values():
            joined.cancel()

    def _rejoin(self, replica: int, joined: grpc.Future) -> str | None:
        """Join the trainers to the epoch the replica was asked to join and push it the trainer's weights; why
        not, or None."""
        self.wait()
        error = self._connect(replica, joined)
        if error:
            return error
        self._push_errors.pop(replica, None)
        self.publish([replica])
        self.wait()
        return self._push_errors.pop(replica, None)

    def _settings_of(self, replica: int) -> SyncSettings:
        """The replica's sync plan: its generator pool's tensor parallelism and devices."""
        return SyncSettings.from_job(self.ctx.job, self.role, self.settings.key, replica)

    def _store_address(self, replica: int) -> tuple[str, int]:
        host, port = self.endpoints.sync_of(self.role)[replica].rsplit(":", 1)
        return host, int(port)

    def _ask_to_join(self, replica: int) -> grpc.Future:
        """Ask the replica to join epoch + 1 of its sync group (it waits there for the trainers, up to the
        deadline); its reply comes once the trainers joined too."""
        self.epochs[replica] += 1
        host, port = self._store_address(replica)
        settings = self._settings_of(replica)
        request = weight_sync_pb2.JoinSyncGroupRequest(
            job_id=self.job_id, store_host=host, store_port=port, trainers=settings.trainers,
            backend=settings.backend, timeout_seconds=settings.timeout, dtype=settings.dtype,
            bucket_bytes=settings.bucket_bytes, epoch=self.epochs[replica], verify=settings.verify,
            pipeline_stages=settings.stages,
            params=[weight_sync_pb2.ParamShape(name=n, shape=list(s)) for n, s in self.shapes.items()],
        )
        return self.stubs[replica].JoinSyncGroup.future(request, timeout=self.settings.timeout, wait_for_ready=True)

    def _connect(self, replica: int, joined: grpc.Future) -> str | None:
        """The trainers' side of the join the replica was asked for; why either side failed, or None. Trainers
        never wait in a group their replica already left."""
        gone = joined.done() and joined.exception() is not None
        error = None if gone else self.trainer.connect(self.role, replica, *self._store_address(replica),
                                                       self.epochs[replica])
        try:
            joined.result()
        except grpc.RpcError as failed:
            # Refused shapes or credentials mean another model or job answers: retrying cannot help.
            wire.raise_if_misconfigured(failed, f"JoinSyncGroup of {self.role} replica {replica}",
                                        grpc.StatusCode.INVALID_ARGUMENT)
            return error or f"JoinSyncGroup: {failed.code().name}"
        return error

    def _replied(self, replica: int, version: int, reply: grpc.Future, start: float) -> None:
        try:
            answer = reply.result()
        except grpc.RpcError as error:
            self._push_errors[replica] = f"weight push failed: {error.code().name}"
            self.mark_down(replica, self._push_errors[replica])
            return
        with self._lock:
            self.timings["sync_seconds"] = max(self.timings.get("sync_seconds", 0.0), time.perf_counter() - start)
            self.timings["sync_receive_seconds"] = max(self.timings.get("sync_receive_seconds", 0.0),
                                                       answer.receive_seconds)
            self.timings["sync_load_seconds"] = max(self.timings.get("sync_load_seconds", 0.0), answer.load_seconds)
        self.replicas.advance(replica, version)

    def _healthy(self, replica: int) -> bool:
        try:
            wire.wait_ready(self.endpoints.of(self.role)[replica], PROBE_SECONDS)
            return True
        except Exception:  # noqa: BLE001 - anything short of SERVING means not back yet
            return False
