"""Weight sync on the devices and dtypes a GPU job uses, decided and checked on CPU.

NCCL moves CUDA tensors and gloo host ones; trainer shards travel as views only from the wire's
device in the wire's dtype; tensor-parallel receivers hold only their region; NCCL waits, which do
not block, get their deadline by polling and aborting.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from rlfleet.workers.sync.group import GroupAddress, SyncGroup, wait_all, wire_device
from rlfleet.workers.sync.receiving import LoaderView, region_shape
from rlfleet.workers.sync.shards import ShardPublisher, SyncSettings, travels_as_is

# Whole-row blocks of 1 MiB (direct) and a small replicated tensor (packed).
SHAPES = {"model.layers.0.mlp.gate_proj.weight": (1024, 256), "model.norm.weight": (256,)}
VOCAB = 100


def test_wire_device_is_cuda_for_nccl_and_host_memory_for_gloo():
    assert wire_device("gloo", "cpu") == torch.device("cpu")
    assert wire_device("gloo", torch.device("cuda", 1)) == torch.device("cpu")  # staged through host buffers
    assert wire_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="NCCL needs CUDA tensors"):
        wire_device("nccl", "cpu")


def test_views_travel_as_is_only_from_the_wire_device_in_its_dtype():
    shard = torch.zeros(4, 4)
    assert travels_as_is(shard, torch.device("cpu"), torch.float32)
    assert not travels_as_is(shard, torch.device("cpu"), torch.bfloat16)  # cast while copying
    # A CUDA shard on a gloo (host) wire: meta stands in for the other device here.
    assert not travels_as_is(torch.zeros(4, 4, device="meta"), torch.device("cpu"), torch.float32)


def test_publisher_buckets_live_on_the_wire_device():
    settings = SyncSettings(trainers=1, tp_size=1, dtype="float32", bucket_bytes=1 << 20, backend="gloo", timeout=5)
    publisher = ShardPublisher(0, settings, SHAPES, VOCAB, device="meta")  # a non-host shard device on gloo
    assert {b.device for out in publisher.outgoing for b in out.buckets} == {torch.device("cpu")}
    with pytest.raises(ValueError, match="NCCL needs CUDA tensors"):
        ShardPublisher(0, SyncSettings(**{**settings.__dict__, "backend": "nccl"}), SHAPES, VOCAB, device="cpu")
    publisher.close()


class FakeWork:
    def __init__(self, done_after: float | None):
        self.done_at = None if done_after is None else time.monotonic() + done_after
        self.waits: list = []

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        return True  # like NCCL: returns at once, whatever the GPU is doing


class FakeGroup:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


def _nccl_group() -> SyncGroup:
    return SyncGroup(FakeGroup(), GroupAddress("127.0.0.1", 1, 2, "nccl", 0.3), 0)


def test_nccl_waits_poll_until_done():
    sync, work = _nccl_group(), FakeWork(done_after=0.1)
    wait_all(sync, [work], time.monotonic() + 5, "send")
    assert work.is_completed() and work.waits == [None] and not sync.group.aborted


def test_nccl_waits_abort_the_group_at_the_deadline():
    sync = _nccl_group()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="NCCL group aborted"):
        wait_all(sync, [FakeWork(done_after=None)], started + 0.3, "send")
    assert 0.3 <= time.monotonic() - started < 2 and sync.group.aborted


def test_gloo_waits_are_bounded_by_the_deadline():
    sync = SyncGroup(FakeGroup(), GroupAddress("127.0.0.1", 1, 2, "gloo", 0.3), 0)
    work = FakeWork(done_after=None)
    work.wait = lambda timeout: work.waits.append(timeout) or False  # gloo: False when it timed out
    with pytest.raises(TimeoutError):
        wait_all(sync, [work], time.monotonic() + 0.3, "send")
    assert timedelta(0) < work.waits[0] <= timedelta(seconds=0.3)


def test_region_shape_cuts_one_dimension():
    assert region_shape((100, 64), ((0, 100), (0, 64))) == ((100, 64), None, 0)
    assert region_shape((256, 64), ((128, 256), (0, 64))) == ((128, 64), 0, 128)
    assert region_shape((64, 256), ((0, 64), (128, 256))) == ((64, 128), 1, 128)
    assert region_shape((64,), ((0, 64), (0, 1))) == ((64,), None, 0)
    with pytest.raises(ValueError, match="more than one dimension"):
        region_shape((64, 256), ((0, 32), (128, 256)))


def test_loader_view_answers_narrow_with_its_region_and_refuses_anything_else():
    region = torch.arange(128 * 4, dtype=torch.float32).view(128, 4)
    view = LoaderView(region, (256, 4), dim=0, start=128)
    assert view.shape == (256, 4) and view.dtype == torch.float32 and isinstance(view, torch.Tensor)
    # What vLLM's column-parallel loader does on TP rank 1 of 2: narrow(output_dim, rank * shard, shard).
    assert view.narrow(0, 128, 128).data_ptr() == region.data_ptr()
    torch.testing.assert_close(torch.narrow(view, 0, 192, 64), region[64:])
    assert view.narrow(0, 300, 0).numel() == 0  # a rank past the real vocabulary reads nothing
    with pytest.raises(ValueError, match="outside the received region"):
        view.narrow(0, 0, 128)
    with pytest.raises(ValueError, match="outside the received region"):
        view.narrow(1, 0, 2)
    with pytest.raises(TypeError, match="may only narrow"):
        view.sum()
