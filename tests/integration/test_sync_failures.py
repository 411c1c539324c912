"""Weight sync survives a generator that dies mid-sync: reported within the deadline, the others go on,
and the restarted generator rejoins with the current weights before it generates."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import grpc
import pytest
import torch

from rlfleet.v1 import generator_pb2, generator_pb2_grpc, weight_sync_pb2, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.auth import new_token, sync_key
from rlfleet.workers.controller.receivers import WeightReceivers
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.local import spawn, stop
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port
from rlfleet.workers.sync.receiving import ShardReceiver
from rlfleet.workers.sync.shards import SyncSettings, global_shapes

from conftest import make_job
from support import RankZero, run_token, start_workers

pytestmark = pytest.mark.integration
DEADLINE = 5.0


def _receivers(ctx, rank_zero) -> WeightReceivers:
    return WeightReceivers(ctx, rank_zero, ReplicaStates(len(ctx.endpoints.of("generator")), 0), PolicyVersion(0))


def _publish(receivers: WeightReceivers, version: int) -> None:
    """What the controller does after a step: the policy moves to `version`, and the receivers push it."""
    receivers.policy.trained(version - 1)
    receivers.publish()


def _rank_zero_side(job, endpoints, run_dir) -> tuple[WorkerContext, list]:
    """Trainer rank 0's context, and stubs of the generators started in run_dir."""
    ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=endpoints, grpc_port=0, metrics_port=0,
                        run_dir=str(run_dir), token=run_token(run_dir))
    return ctx, [generator_pb2_grpc.GeneratorStub(wire.channel(a, ctx.token)) for a in endpoints.of("generator")]


def _rejoin_while(waiting, receivers: WeightReceivers, seconds: float = 60.0) -> None:
    """Call rejoin_returned, as the controller does between steps, while `waiting()` holds (its health probes
    run in the background, so one call may only start one)."""
    deadline = time.monotonic() + seconds
    while waiting():
        assert time.monotonic() < deadline, "no rejoin within the time limit"
        receivers.rejoin_returned()
        time.sleep(0.05)


def _version(stub) -> int:
    return stub.Status(generator_pb2.GeneratorStatusRequest(job_id="t"), timeout=10).policy_version


def _two_generators(tmp_path, model_cache, model=None, **sync):
    """A job of two torch generators, rank 0's model, and the generators started in tmp_path."""
    from transformers import AutoModelForCausalLM

    job = make_job(**({"model": model} if model else {}), roles={"generator": {"engine": "torch", "replicas": 2}},
                   weightSync={"backend": "gloo", "timeoutSeconds": DEADLINE, **sync})
    weights = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32)
    return job, weights, *start_workers(job, tmp_path, {"generator"})


def test_dead_generator_is_reported_others_continue_and_it_rejoins(tmp_path, model_cache):
    job, model, children, endpoints, ports = _two_generators(tmp_path, model_cache)
    try:
        ctx, stubs = _rank_zero_side(job, endpoints, tmp_path)
        receivers = _receivers(ctx, RankZero(model, job, ctx.token))
        receivers.join_all()
        _publish(receivers, 1)
        receivers.wait()
        assert [_version(s) for s in stubs] == [1, 1]

        os.killpg(children[1].process.pid, signal.SIGKILL)
        started = time.monotonic()
        _publish(receivers, 2)
        receivers.wait()
        _publish(receivers, 3)  # waits for the failed send to the dead replica: bounded by the deadline
        receivers.wait()
        assert time.monotonic() - started < 2 * DEADLINE + 5
        assert receivers.replicas.down() == [1]
        assert _version(stubs[0]) == 3, "the live replica must keep receiving"

        children[1] = spawn(children[1].worker, tmp_path)
        wire.wait_ready(endpoints.of("generator")[1], 120)
        _rejoin_while(lambda: receivers.replicas.down(), receivers)
        assert _version(stubs[1]) == 3, "a rejoined replica gets the current version before it generates"
        _publish(receivers, 4)
        receivers.wait()
        assert [_version(s) for s in stubs] == [4, 4]
    finally:
        stop(children)


# Big enough that the sends to a stopped receiver fill the loopback socket buffers and block (a small model would
# fit in them and only the gRPC deadline would notice): 8.4 M float32 parameters, 34 MB.
BIG = {"type": "tiny", "hiddenSize": 512, "numHeads": 4, "intermediateSize": 2048}


def test_stopped_generator_fails_the_push_by_the_deadline_and_rejoins_when_it_answers(tmp_path, model_cache):
    """SIGSTOP: the process keeps its sockets open but reads nothing and answers nothing (a hung node). The
    trainer's sends to it, and the push's gRPC call, must fail by weightSync.timeoutSeconds rather than hang;
    once it runs again it rejoins like a restarted one."""
    job, model, children, endpoints, _ = _two_generators(tmp_path, model_cache, model=BIG, bucketMB=4)
    stopped = children[1].process.pid
    try:
        ctx, stubs = _rank_zero_side(job, endpoints, tmp_path)
        rank_zero = RankZero(model, job, ctx.token)
        receivers = _receivers(ctx, rank_zero)
        receivers.join_all()
        _publish(receivers, 1)
        receivers.wait()
        assert [_version(s) for s in stubs] == [1, 1]

        os.killpg(stopped, signal.SIGSTOP)
        started = time.monotonic()
        _publish(receivers, 2)
        receivers.wait()  # the push's gRPC call to the stopped replica: DEADLINE_EXCEEDED
        sent = rank_zero.publisher.wait()  # the trainer's sends to it
        waited = time.monotonic() - started
        assert receivers.replicas.down() == [1]
        # Gloo's own timeout (the wait's deadline) or wait_all's, whichever fires first.
        assert list(sent["failed"]) == [1] and re.search("timed out|deadline", sent["failed"][1], re.I), sent
        assert DEADLINE - 1 < waited < DEADLINE + 5, f"the push took {waited:.1f} s with a {DEADLINE} s deadline"
        _publish(receivers, 3)  # skips the stopped replica: no wait at all
        receivers.wait()
        assert time.monotonic() - started < waited + 5
        assert _version(stubs[0]) == 3, "the live replica must keep receiving"

        os.killpg(stopped, signal.SIGCONT)
        wire.wait_ready(endpoints.of("generator")[1], 60)
        _rejoin_while(lambda: receivers.replicas.down(), receivers)
        assert _version(stubs[1]) == 3, "a replica that answers again gets the current version before it generates"
        _publish(receivers, 4)
        receivers.wait()
        assert [_version(s) for s in stubs] == [4, 4]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(stopped, signal.SIGCONT)  # a stopped process ignores SIGTERM until continued
        stop(children)


def _first_trainer_pushes(job_json: dict, endpoints_json: str, token: str, weights: str, version: int) -> None:
    """A trainer incarnation that pushes `version` of the weights in `weights`, then dies (its own process,
    with its own sync stores, as a restarted trainer has)."""
    from rlfleet.workers.plan import Endpoints
    from rlfleet.workers.spec import parse_job

    job = parse_job(job_json)
    model = torch.load(weights, weights_only=False)
    ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=Endpoints.from_json(endpoints_json), grpc_port=0,
                        metrics_port=0, run_dir=".", token=token)
    receivers = _receivers(ctx, RankZero(model, job, ctx.token))
    receivers.join_all()
    _publish(receivers, version)
    receivers.wait()


def _greedy(stub) -> list[int]:
    reply = stub.Generate(generator_pb2.GenerateRequest(
        job_id="t", max_tokens=8, temperature=0.0, top_p=1.0, seed=0,
        sequences=[generator_pb2.Sequence(sample_id="a", prompt_ids=[5, 6, 7])]), timeout=60)
    return list(reply.segments[0].token_ids)


def test_a_restarted_trainer_sets_every_generator_to_its_weights_even_at_version_0(tmp_path, model_cache):
    """The first trainer pushed version 3 and died before any checkpoint; the restarted one starts again
    from the base weights at version 0, and the generators must hold exactly that, not version 3."""
    import multiprocessing

    from transformers import AutoModelForCausalLM

    job = make_job(roles={"generator": {"engine": "torch"}}, weightSync={"backend": "gloo", "timeoutSeconds": 20})
    base = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(torch.randn_like(param))
    torch.save(trained, tmp_path / "trained.pt")
    children, endpoints, _ = start_workers(job, tmp_path, {"generator"})
    try:
        stub = generator_pb2_grpc.GeneratorStub(wire.channel(endpoints.of("generator")[0], run_token(tmp_path)))
        base_tokens = _greedy(stub)
        first = multiprocessing.get_context("spawn").Process(target=_first_trainer_pushes, args=(
            job.to_dict(), endpoints.to_json(), run_token(tmp_path), str(tmp_path / "trained.pt"), 3))
        first.start()
        first.join(120)
        assert first.exitcode == 0 and _version(stub) == 3 and _greedy(stub) != base_tokens

        ctx, _ = _rank_zero_side(job, endpoints, tmp_path)
        _receivers(ctx, RankZero(base, job, ctx.token)).join_all()
        assert _version(stub) == 0
        assert _greedy(stub) == base_tokens, "the generator kept the dead trainer's weights"
    finally:
        stop(children)


class FailsFirstConnect(RankZero):
    """Rank 0 whose first rejoin of replica 1 fails (the generator went away again mid-join)."""

    def __init__(self, model, job, token):
        super().__init__(model, job, token)
        self.joins = 0

    def connect(self, role, *args):
        if args[0] == 1:
            self.joins += 1
            if self.joins == 2:  # the first join is the start; the second, the rejoin
                return "sync group join timed out"
        return super().connect(role, *args)


def test_a_failed_rejoin_is_retried_not_fatal(tmp_path, model_cache, monkeypatch):
    import rlfleet.workers.controller.receivers as receivers_module

    monkeypatch.setattr(receivers_module, "PROBE_EVERY_SECONDS", 0.1)
    job, model, children, endpoints, _ = _two_generators(tmp_path, model_cache)
    try:
        ctx, stubs = _rank_zero_side(job, endpoints, tmp_path)
        receivers = _receivers(ctx, FailsFirstConnect(model, job, ctx.token))
        receivers.join_all()
        receivers.mark_down(1, "a Generate call failed")
        rank_zero = receivers.trainer
        _rejoin_while(lambda: rank_zero.joins < 2, receivers)  # fails: logged, the replica stays down, nothing raised
        assert receivers.replicas.down() == [1]
        # "the rejoin was not tried again" if this times out
        _rejoin_while(lambda: receivers.replicas.down(), receivers)
        _publish(receivers, 1)
        receivers.wait()
        assert [_version(s) for s in stubs] == [1, 1]
    finally:
        stop(children)


class HeldJoin(weight_sync_pb2_grpc.WeightSyncServicer):
    """A returning replica whose every join waits until `released`: then it joins like a generator does (or, for
    an epoch in `gone`, ends without joining: it went away mid-join) and receives pushes. `order` gets
    "JoinSyncGroup <epoch>" as each join comes in."""

    def __init__(self, job, model, token: str, order: list[str], gone: set[int]):
        self.settings = SyncSettings.from_job(job, key=sync_key(token))
        self.shapes, self.vocab_size = global_shapes(model), model.config.vocab_size
        self.order, self.gone, self.released = order, gone, threading.Event()
        self.receiver = None

    def JoinSyncGroup(self, request, context):
        self.order.append(f"JoinSyncGroup {request.epoch}")
        self.released.wait(60)
        if request.epoch in self.gone:
            context.abort(grpc.StatusCode.UNAVAILABLE, "went away mid-join")
        address = self.settings.address(request.store_host, request.store_port, request.epoch)
        self.receiver = ShardReceiver(self.settings, address, 0, self.shapes, self.vocab_size, "cpu")
        return weight_sync_pb2.JoinSyncGroupResponse(job_id=request.job_id, tensor_parallel_size=1)

    def UpdateWeights(self, request, context):
        self.receiver.receive()
        return weight_sync_pb2.UpdateWeightsResponse(job_id=request.job_id, policy_version=request.policy_version)


class RecordsConnects(RankZero):
    def __init__(self, model, job, token, order: list[str]):
        super().__init__(model, job, token)
        self.order = order

    def connect(self, role, *args):
        done = super().connect(role, *args)
        # once connected: the replica's JoinSyncGroup of that epoch came in before
        self.order.append(f"connect {args[-1]}")
        return done


@pytest.mark.parametrize("gone, rejoined", [(set(), ["connect 1"]), ({1}, ["JoinSyncGroup 2", "connect 2"])],
                         ids=["slow-join", "never-joins"])
def test_training_steps_go_on_while_a_returning_replica_joins(tmp_path, model_cache, monkeypatch, gone, rejoined):
    """The trainers join a returning replica's group only once it waits there: the steps before never wait for
    it; one that never joins fails by the deadline and is asked again, in a new epoch."""
    import rlfleet.workers.controller.receivers as receivers_module
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(receivers_module, "PROBE_EVERY_SECONDS", 0.1)
    job = make_job(roles={"generator": {"engine": "torch", "replicas": 1}},
                   weightSync={"backend": "gloo", "timeoutSeconds": DEADLINE})
    model = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32)
    order: list[str] = []
    replica, server, receivers = _held_replica(job, model, tmp_path, order, gone)
    try:
        receivers.mark_down(0, "it restarted")
        _rejoin_while(lambda: not order, receivers)  # until it is asked to join
        for step in range(3):  # the controller's steps, each after a look at the returning replicas
            receivers.rejoin_returned()
            order.append(f"step {step}")
        replica.released.set()
        _rejoin_while(lambda: receivers.replicas.down(), receivers)
        assert order == ["JoinSyncGroup 1", "step 0", "step 1", "step 2", *rejoined]
        _publish(receivers, 1)
        receivers.wait()
        assert receivers.replicas.version(0) == 1
    finally:
        receivers.stop()
        server.stop(None)


def test_a_replica_that_outwaits_every_step_still_rejoins(tmp_path, model_cache, monkeypatch):
    """Every step lasts longer than the sync deadline: a returning replica that waited in its group and gave up
    before a step ended is joined at once the next time (the trainers wait in the rendezvous, as it does)."""
    import rlfleet.workers.controller.receivers as receivers_module
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(receivers_module, "PROBE_EVERY_SECONDS", 0.1)
    job = make_job(roles={"generator": {"engine": "torch", "replicas": 1}},
                   weightSync={"backend": "gloo", "timeoutSeconds": DEADLINE})
    model = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32)
    order: list[str] = []
    replica, server, receivers = _held_replica(job, model, tmp_path, order, set())
    try:
        receivers.mark_down(0, "it restarted")
        _rejoin_while(lambda: not order, receivers)  # until it is asked to join
        # Held until the calls stop: a call that found it already waiting would join epoch 1 at once.
        replica.released.set()
        for _ in range(4):  # steps, each longer than the deadline, each after a look at the returning replicas
            time.sleep(DEADLINE + 1)
            if receivers.rejoin_returned():
                break
        assert not receivers.replicas.down(), f"the replica never rejoined: {order}"
        assert order[-2:] == ["JoinSyncGroup 2", "connect 2"]
    finally:
        receivers.stop()
        server.stop(None)


def _held_replica(job, model, tmp_path, order: list[str],
                  gone: set[int]) -> tuple[HeldJoin, grpc.Server, WeightReceivers]:
    """A HeldJoin replica served on loopback, and the WeightReceivers of a trainer whose connects go into `order`."""
    token = new_token()
    replica = HeldJoin(job, model, token, order, gone)
    port = free_port()
    server, _ = wire.serve(port, [lambda s: weight_sync_pb2_grpc.add_WeightSyncServicer_to_server(replica, s)],
                           ["rlfleet.v1.WeightSync"], host="127.0.0.1", token=token)
    endpoints = Endpoints("", servers={"generator": [f"127.0.0.1:{port}"]},
                          sync={"generator": [f"127.0.0.1:{free_port()}"]})
    ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=endpoints, grpc_port=0, metrics_port=0,
                        run_dir=str(tmp_path), token=token)
    receivers = _receivers(ctx, RecordsConnects(model, job, token, order))
    return replica, server, receivers
