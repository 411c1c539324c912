"""Flat transfer buckets: tensors packed back to back into a few preallocated, reused buffers.

One collective per bucket instead of one per tensor, and no allocation per sync (fresh buffers cost
page faults that halve gloo bandwidth here: ENVIRONMENT.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives: bucket index, element offset and count, and its shape."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    numel: int

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        """This slot's place in its bucket, shaped like the tensor (no copy)."""
        return bucket[self.offset : self.offset + self.numel].view(self.shape)


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[Slot, ...]
    bucket_numels: tuple[int, ...]
    dtype: str

    @classmethod
    def plan(cls, shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: str, bucket_bytes: int) -> BucketLayout:
        """Fill buckets in order; a tensor larger than a bucket gets a bucket of its own size."""
        capacity = max(1, bucket_bytes // torch.empty((), dtype=DTYPES[dtype]).element_size())
        slots: list[Slot] = []
        numels: list[int] = []
        for name, shape in shapes:
            numel = _numel(shape)
            if not numels or numels[-1] + numel > capacity:
                numels.append(0)
            slots.append(Slot(name, tuple(shape), len(numels) - 1, numels[-1], numel))
            numels[-1] += numel
        return cls(tuple(slots), tuple(numels), dtype)

    def allocate(self, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        return [torch.empty(n, dtype=DTYPES[self.dtype], device=device) for n in self.bucket_numels]

    def pack(self, tensors: dict[str, torch.Tensor], buckets: list[torch.Tensor]) -> None:
        """Copy every named tensor into its slot (casting to the layout's dtype)."""
        with torch.no_grad():
            for slot in self.slots:
                slot.view(buckets[slot.bucket]).copy_(tensors[slot.name].detach().reshape(slot.shape))

    def unpack(self, buckets: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Views into the buckets, shaped like the original tensors (no copy)."""
        for slot in self.slots:
            yield slot.name, slot.view(buckets[slot.bucket])


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
