"""Collective methods across a ranked world (workers.world): rank 0's call of a collective method runs on every rank
with its arguments, rank 0's stop releases the followers, and a follower refuses a broadcast naming a method that
is not collective. Two ranks over gloo, each in its own process."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import torch
import torch.distributed as dist

from rlfleet.workers.plan import free_port
from rlfleet.workers.world import collective, follow_rank0, init_world, release_followers


class Counter:
    def __init__(self, rank: int):
        self.rank, self.world_size = rank, 2
        self.ran: list[list[int]] = []

    @collective
    def add(self, value: int, times: int = 1) -> int:
        self.ran.append([value, times])
        return value * times

    def forget(self) -> None:
        """Not collective: rank 0 may call it, no follower runs it."""
        self.ran.clear()


def _rank(rank: int, port: int, out: str, rogue: bool) -> None:
    from rlfleet.workers.cli import exit_now

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_world(torch.device("cpu"), rank, 2, "test-key")
    counter = Counter(rank)
    if rank > 0:
        try:
            follow_rank0(counter)
            seen = {"ran": counter.ran}
        except RuntimeError as error:
            seen = {"ran": counter.ran, "refused": str(error)}
        Path(out, "follower.json").write_text(json.dumps(seen))
        exit_now(0)
    results = [counter.add(3), counter.add(4, times=2)]
    if rogue:  # what a broadcast of anything but a collective method looks like
        dist.broadcast_object_list([("forget", (), {})], src=0)
    else:
        release_followers(0, 2)
    Path(out, "leader.json").write_text(json.dumps({"ran": counter.ran, "results": results}))
    exit_now(0)


def _run(tmp_path: Path, rogue: bool) -> tuple[dict, dict]:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, str(tmp_path), rogue)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0]
    return (json.loads((tmp_path / "leader.json").read_text()), json.loads((tmp_path / "follower.json").read_text()))


def test_a_collective_call_runs_on_every_rank_and_stop_releases_the_followers(tmp_path):
    leader, follower = _run(tmp_path, rogue=False)
    assert leader == {"ran": [[3, 1], [4, 2]], "results": [3, 8]}
    assert follower == {"ran": [[3, 1], [4, 2]]}  # each call once, keyword arguments too, then released


def test_a_follower_refuses_a_method_that_is_not_collective(tmp_path):
    _, follower = _run(tmp_path, rogue=True)
    assert follower["ran"] == [[3, 1], [4, 2]], "the follower ran the method it should have refused"
    assert "Counter.forget, which is not a collective method" in follower["refused"]
