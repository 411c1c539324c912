"""Checksums that prove a push arrived as it was sent (`weightSync.verify`).

One int64 per tensor: the sum of its elements' bit patterns, read as integers of the same width. Integer
addition (wrapping at 2^64) does not depend on order, so sender and receiver agree exactly whatever their
memory layout, device or thread count; a tensor that changed while it travelled, as when the trainer's
optimizer step overwrites weights a send still reads, almost surely does not.
"""

from __future__ import annotations

import torch
from torch import Tensor

INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements summed at once: bounds the int64 copy a sum may make of its input to 128 MB.
CHUNK = 1 << 24
# What receivers log for a push checked by content, and put in the error for one that differs.
VERIFIED, MIXED = "verified by content", "differs from what the trainers sent"


class WeightsDiffer(RuntimeError):
    """A push arrived with other content than the trainers sent: the version must not be loaded."""


def checksums(tensors: list[Tensor]) -> Tensor:
    """``[len(tensors)]`` int64 on the tensors' device (the first one's; CPU if none)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.stack([_bit_sum(t) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.int64, device=device)


def compare(sent: Tensor, received: list[Tensor], what: str) -> None:
    """Raise WeightsDiffer unless the received tensors have the checksums the sender computed."""
    differing = (checksums(received) != sent.to(device=received[0].device if received else sent.device)).nonzero()
    if len(differing):
        raise WeightsDiffer(f"{what}: {len(differing)} of {len(received)} tensors {MIXED}")


def _bit_sum(tensor: Tensor) -> Tensor:
    bits = tensor.detach().contiguous().view(-1).view(INTEGERS[tensor.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, bits.numel(), CHUNK):
        total += bits[start : start + CHUNK].sum(dtype=torch.int64)
    return total
