"""A weight-sync group, and a trainer world, admit only processes that hold the job's token; a sync group listens
only where it is reached.

The trainer's side hosts the group's TCPStore (which checks nobody); a process that knows its host and port but
not the token tries to join as the generator rank and take the weights, by the store's key names from before keys
were derived from the token, and by those of another token. Likewise for rank 1 of the trainers' own world.
"""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rlfleet.workers.auth import new_token, sync_key
from rlfleet.workers.cli import exit_now
from rlfleet.workers.plan import free_port
from rlfleet.workers.sync.group import GroupAddress, broadcast, open_group
from rlfleet.workers.world import init_world

from conftest import make_job
from sockets import is_loopback, listening
from support import start_workers, stop

pytestmark = pytest.mark.integration
WEIGHTS = torch.arange(16, dtype=torch.float32)
# The trainer waits this long for its generator; the intruder gives up well before.
TRAINER_SECONDS = 60.0
INTRUDER_SECONDS = 5.0


def _address(port: int, token: str, timeout: float) -> GroupAddress:
    return GroupAddress("127.0.0.1", port, 2, "gloo", timeout, key=sync_key(token))


def _trainer(port: int, token: str, sent) -> None:
    """Rank 0: hosts the store, sends its weights to whoever joined as rank 1."""
    group = open_group(_address(port, token, TRAINER_SECONDS), 0)
    broadcast(group, WEIGHTS.clone(), 0)
    sent.set()


def _generator(port: int, token: str) -> None:
    group = open_group(_address(port, token, TRAINER_SECONDS), 1)
    received = torch.zeros_like(WEIGHTS)
    broadcast(group, received, 0)
    assert torch.equal(received, WEIGHTS)


def _intrude(port: int, prefix: str) -> torch.Tensor:
    """What a process without the token does: the store's address and a guess at its keys, then rank 1's receive."""
    timeout = timedelta(seconds=INTRUDER_SECONDS)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    got = torch.zeros_like(WEIGHTS)
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, timeout)
        group.broadcast([got], dist.BroadcastOptions()).wait(timeout)
    except RuntimeError:  # DistStoreError and gloo's timeouts: nobody meets it under those keys
        pass
    return got


@pytest.mark.parametrize("prefix", ["epoch0/", f"{sync_key(new_token())}/epoch0/"], ids=["no-token", "other-token"])
def test_a_process_without_the_token_cannot_take_the_weights(prefix):
    token, port = new_token(), free_port()
    context = multiprocessing.get_context("spawn")
    sent = context.Event()
    trainer = context.Process(target=_trainer, args=(port, token, sent))
    generator = context.Process(target=_generator, args=(port, token))
    trainer.start()
    try:
        _wait_for_port(port)
        got = _intrude(port, prefix)
        assert not torch.equal(got, WEIGHTS), "a process without the job's token received the weights"
        assert not sent.is_set()
        generator.start()  # the token's holder still joins
        generator.join(TRAINER_SECONDS)
        trainer.join(TRAINER_SECONDS)
        assert generator.exitcode == 0 and trainer.exitcode == 0 and sent.is_set()
    finally:
        _stop([trainer, generator])


def _world_rank(rank: int, port: int, token: str, sent) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_world(torch.device("cpu"), rank, 2, sync_key(token))
    weights = WEIGHTS.clone() if rank == 0 else torch.zeros_like(WEIGHTS)
    dist.broadcast(weights, 0)
    assert torch.equal(weights, WEIGHTS)
    sent.set()
    exit_now(0)  # as a worker ends: the interpreter's teardown can abort a process that holds a world


def _world_intruder(port: int, got) -> None:
    """torch's own rendezvous (env://, as the world used before its keys were the token's) as rank 1."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                                timeout=timedelta(seconds=INTRUDER_SECONDS))
        weights = torch.zeros_like(WEIGHTS)
        dist.broadcast(weights, 0)
        got.put(weights.tolist())
    except RuntimeError:
        got.put(None)


def test_a_process_without_the_token_cannot_take_a_trainer_rank():
    token, port = new_token(), free_port()
    context = multiprocessing.get_context("spawn")
    sent, received, got = context.Event(), context.Event(), context.Queue()
    rank0 = context.Process(target=_world_rank, args=(0, port, token, sent))
    intruder = context.Process(target=_world_intruder, args=(port, got))
    rank1 = context.Process(target=_world_rank, args=(1, port, token, received))
    rank0.start()
    try:
        _wait_for_port(port)
        intruder.start()
        assert got.get(timeout=TRAINER_SECONDS) != WEIGHTS.tolist(), "a process without the token took rank 1"
        rank1.start()  # the token's holder still joins
        rank1.join(TRAINER_SECONDS)
        rank0.join(TRAINER_SECONDS)
        assert rank1.exitcode == 0 and rank0.exitcode == 0 and sent.is_set() and received.is_set()
    finally:
        _stop([rank0, intruder, rank1])


def test_a_loopback_group_listens_on_loopback_only():
    token, port = new_token(), free_port()
    before = listening()
    generator = multiprocessing.get_context("spawn").Process(target=_generator, args=(port, token))
    generator.start()
    try:
        group = open_group(_address(port, token, TRAINER_SECONDS), 0)
        opened = listening() - before
        broadcast(group, WEIGHTS.clone(), 0)
        generator.join(TRAINER_SECONDS)
        assert generator.exitcode == 0
    finally:
        _stop([generator])
    assert any(p == port for _, p in opened), "the store's socket was not seen: this test could not fail"
    assert len(opened) >= 2, "no gloo listener was seen: this test could not fail"
    assert all(is_loopback(host) for host, _ in opened), f"listening beyond loopback: {sorted(opened)}"


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:
            proc.join()


def _wait_for_port(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TRAINER_SECONDS))
    del store


def test_rlfleet_run_workers_listen_on_loopback_only(tmp_path):
    """`rlfleet run`'s peers all call 127.0.0.1, so its workers' gRPC and metrics servers listen there alone."""
    children, _, _ = start_workers(make_job(), tmp_path, {"scorer"})
    try:
        worker = children[0].worker
        opened = listening(children[0].process.pid)
        assert {worker.ports["grpc"], worker.ports["metrics"]} <= {port for _, port in opened}, opened
        assert all(is_loopback(host) for host, _ in opened), f"listening beyond loopback: {sorted(opened)}"
    finally:
        stop(children)
