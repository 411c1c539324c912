"""Flat transfer buckets: layout, bit-exact pack/unpack round trips, capacity, and buffer reuse."""

from __future__ import annotations

import pytest
import torch

from rlfleet.workers.sync.buckets import DTYPES, BucketLayout, Slot

SHAPES = [
    ("embed", (97, 64)),
    ("layer0.q", (64, 64)),
    ("layer0.norm", (64,)),
    ("scale", ()),
    ("empty", (0, 3)),
    ("layer0.mlp", (64, 3, 5)),
    ("bias", (7,)),
    ("lm_head", (97, 64)),
]
# Integer views of the same width: comparing bits also compares NaN payloads and -0.0.
BITS = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16}


def random_tensors(shapes, dtype: str, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes:
        tensor = torch.randn(shape, generator=generator).to(DTYPES[dtype])
        flat = tensor.view(-1)
        if flat.numel() >= 4:
            flat[:4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")])
        tensors[name] = tensor
    return tensors


def capacity(dtype: str, bucket_bytes: int) -> int:
    return bucket_bytes // torch.empty((), dtype=DTYPES[dtype]).element_size()


def bits(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    return tensor.contiguous().view(BITS[dtype])


def test_hand_worked_layout():
    layout = BucketLayout.plan([("a", (3,)), ("b", (2, 2)), ("c", (10,)), ("d", (1,))], "float32", bucket_bytes=32)
    # Capacity 8 elements: a and b share bucket 0; c (10) is larger than a bucket and gets its own; d starts a third.
    assert layout.bucket_numels == (7, 10, 1)
    assert layout.slots == (
        Slot("a", (3,), 0, 0, 3),
        Slot("b", (2, 2), 0, 3, 4),
        Slot("c", (10,), 1, 0, 10),
        Slot("d", (1,), 2, 0, 1),
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [1, 64, 4096, 40_000, 1 << 20])
def test_layout_respects_capacity_and_packs_back_to_back(dtype, bucket_bytes):
    layout = BucketLayout.plan(SHAPES, dtype, bucket_bytes)
    cap = max(1, capacity(dtype, bucket_bytes))
    assert [s.name for s in layout.slots] == [name for name, _ in SHAPES]
    assert sum(layout.bucket_numels) == sum(torch.Size(shape).numel() for _, shape in SHAPES)
    for index, numel in enumerate(layout.bucket_numels):
        inside = [s for s in layout.slots if s.bucket == index]
        assert inside, f"bucket {index} is empty"
        # Back to back, in order, filling the bucket exactly.
        offset = 0
        for slot in inside:
            assert slot.offset == offset
            offset += slot.numel
        assert offset == numel
        # Over capacity only when it holds a single tensor larger than a bucket (plus empty ones).
        if numel > cap:
            assert len([s for s in inside if s.numel]) == 1
    for before, after in zip(layout.slots, layout.slots[1:]):
        if after.bucket != before.bucket:
            # A new bucket starts only when the next tensor did not fit in the previous one.
            assert after.bucket == before.bucket + 1
            assert layout.bucket_numels[before.bucket] + after.numel > cap


def test_bucket_count_by_size():
    assert len(BucketLayout.plan(SHAPES, "float32", 1 << 20).bucket_numels) == 1
    # 16 KiB = 4096 floats: embed (6208) alone, q (4096) fills one, the small ones share, lm_head alone.
    small = BucketLayout.plan(SHAPES, "float32", 16 << 10)
    assert small.bucket_numels == (97 * 64, 64 * 64, 64 + 1 + 0 + 64 * 15 + 7, 97 * 64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [1, 64, 4096, 40_000, 1 << 20])
def test_pack_unpack_round_trips_bit_exactly(dtype, bucket_bytes):
    tensors = random_tensors(SHAPES, dtype, seed=bucket_bytes)
    layout = BucketLayout.plan([(n, tuple(t.shape)) for n, t in tensors.items()], dtype, bucket_bytes)
    buckets = layout.allocate()
    assert [b.numel() for b in buckets] == list(layout.bucket_numels)
    assert all(b.dtype == DTYPES[dtype] for b in buckets)
    layout.pack(tensors, buckets)
    unpacked = dict(layout.unpack(buckets))
    assert list(unpacked) == list(tensors)
    for name, tensor in tensors.items():
        assert unpacked[name].shape == tensor.shape
        assert unpacked[name].dtype == tensor.dtype
        assert torch.equal(bits(unpacked[name], dtype), bits(tensor, dtype)), name


def test_buckets_are_reused_and_unpack_does_not_copy():
    layout = BucketLayout.plan(SHAPES, "float32", 4096)
    buckets = layout.allocate()
    pointers = [b.data_ptr() for b in buckets]
    layout.pack(random_tensors(SHAPES, "float32", seed=1), buckets)
    second = random_tensors(SHAPES, "float32", seed=2)
    layout.pack(second, buckets)
    assert [b.data_ptr() for b in buckets] == pointers
    for (name, view), slot in zip(layout.unpack(buckets), layout.slots):
        assert torch.equal(bits(view, "float32"), bits(second[name], "float32")), name
        if slot.numel:
            bucket = buckets[slot.bucket]
            assert view.data_ptr() == bucket.data_ptr() + slot.offset * bucket.element_size()


def test_pack_casts_to_the_layout_dtype():
    tensors = {"w": torch.randn(5, 3, generator=torch.Generator().manual_seed(0))}
    layout = BucketLayout.plan([("w", (5, 3))], "bfloat16", 64)
    buckets = layout.allocate()
    layout.pack(tensors, buckets)
    (name, view), = layout.unpack(buckets)
    assert view.dtype == torch.bfloat16
    assert torch.equal(view, tensors["w"].to(torch.bfloat16))
