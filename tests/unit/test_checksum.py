"""Push checksums: exact whatever the layout or the order of summation, and changed by any change of content."""

from __future__ import annotations

import pytest
import torch

from rlfleet.workers.sync.checksum import MIXED, WeightsDiffer, checksums, compare


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layout_and_order_do_not_change_a_checksum(dtype):
    tensor = torch.randn(64, 48).to(dtype)
    transposed_copy = tensor.t().contiguous().t()  # same values, other memory order
    assert torch.equal(checksums([tensor]), checksums([transposed_copy]))
    assert torch.equal(checksums([tensor.flatten()]), checksums([tensor.flatten().flip(0)]))


def test_one_changed_element_changes_the_checksum():
    tensor = torch.randn(1000)
    changed = tensor.clone()
    changed[517] = torch.nextafter(changed[517], torch.tensor(float("inf")))  # the smallest possible change
    assert not torch.equal(checksums([tensor]), checksums([changed]))


def test_a_sum_beyond_one_chunk_is_exact(monkeypatch):
    import rlfleet.workers.sync.checksum as checksum

    tensor = torch.randn(10_001)
    whole = checksums([tensor])
    monkeypatch.setattr(checksum, "CHUNK", 97)
    assert torch.equal(checksums([tensor]), whole)


def test_compare_names_what_differs():
    sent = [torch.ones(3), torch.zeros(2)]
    compare(checksums(sent), [torch.ones(3), torch.zeros(2)], "a push")
    with pytest.raises(WeightsDiffer, match=f"a push: 1 of 2 tensors {MIXED}"):
        compare(checksums(sent), [torch.ones(3), torch.ones(2)], "a push")
