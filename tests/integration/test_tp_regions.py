"""Tensor-parallel receivers hold only their regions, and what vLLM's loaders read from them is exact.

Two trainer ranks holding float32 master shards push to one TP=2 replica over gloo. Each receiver must
allocate only the region of each parameter its rank reads (a whole model per GPU otherwise), and
narrowing its HF-shaped loader tensors as vLLM's weight loaders do must give the weights, cast to the
wire dtype. The real vLLM loaders are exercised by test_weight_push's TP=2 case.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rlfleet.workers.auth import new_token, sync_key
from rlfleet.workers.plan import free_port
from rlfleet.workers.sync.plan import GeneratorLayout, trainer_rows
from rlfleet.workers.sync.shards import SyncSettings

pytestmark = pytest.mark.integration
# Llama-shaped, small: row-split q/k/v/gate/up, column-split o/down, a vocabulary that vLLM pads to 128
# (TP rank 1 of 2 then reads only 36 real rows), a replicated norm.
SHAPES = {
    "model.embed_tokens.weight": (100, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.k_proj.weight": (64, 64),
    "model.layers.0.self_attn.v_proj.weight": (64, 64),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.gate_proj.weight": (256, 64),
    "model.layers.0.mlp.up_proj.weight": (256, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 256),
    "model.layers.0.input_layernorm.weight": (64,),
    "lm_head.weight": (100, 64),
}
VOCAB = 100
# Lowered so that blocks of this small model travel direct too (straight into the receivers' regions).
DIRECT_MIN_BYTES = 8 << 10


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _publisher(rank: int, settings: SyncSettings, port: int) -> None:
    import rlfleet.workers.sync.plan as plan
    from rlfleet.workers.sync.shards import ShardPublisher

    plan.DIRECT_MIN_BYTES = DIRECT_MIN_BYTES
    shards = {n: t[slice(*trainer_rows(t.shape[0], settings.trainers, rank))].clone() for n, t in _weights().items()}
    publisher = ShardPublisher(rank, settings, SHAPES, VOCAB)
    assert any(out.packer.direct for out in publisher.outgoing), "no direct block: the test would miss them"
    assert publisher.connect(0, "127.0.0.1", port, 1) is None
    publisher.publish(shards, [0])
    assert not publisher.wait()["failed"]
    publisher.close()


def _receiver(tp_rank: int, settings: SyncSettings, port: int, out: str) -> None:
    import rlfleet.workers.sync.plan as plan
    from rlfleet.workers.sync.receiving import LoaderView, ShardReceiver

    plan.DIRECT_MIN_BYTES = DIRECT_MIN_BYTES
    layout = GeneratorLayout(settings.tp_size, VOCAB)
    receiver = ShardReceiver(settings, settings.address("127.0.0.1", port, 1), tp_rank, SHAPES, VOCAB, "cpu")
    receiver.receive()
    read = {}
    for name, tensor in receiver.weights():
        assert tensor.shape == SHAPES[name], "loaders are handed HF-shaped tensors"
        (row0, row1), (col0, col1) = layout.region(name, SHAPES[name], tp_rank)
        if isinstance(tensor, LoaderView):  # what vLLM's loader does: narrow(dim, rank's start, rank's size)
            cut = (row0, row1 - row0) if tensor.cut_dim == 0 else (col0, col1 - col0)
            tensor = tensor.narrow(tensor.cut_dim, *cut)
        read[name] = tensor.clone()
    torch.save({"held": sum(t.numel() for t in receiver.targets.values()), "read": read}, out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp_receivers_hold_only_their_regions_and_loaders_read_exact_weights(dtype, tmp_path):
    settings = SyncSettings(trainers=2, tp_size=2, dtype=dtype, bucket_bytes=32 << 10, backend="gloo", timeout=60,
                            key=sync_key(new_token()))
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_publisher, args=(r, settings, port)) for r in range(2)]
    procs += [context.Process(target=_receiver, args=(r, settings, port, str(tmp_path / f"{r}.pt"))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    full, layout = _weights(), GeneratorLayout(2, VOCAB)
    for tp_rank in range(2):
        got = torch.load(tmp_path / f"{tp_rank}.pt")
        regions = 0
        for name, shape in SHAPES.items():
            (row0, row1), (col0, col1) = layout.region(name, shape, tp_rank)
            regions += (row1 - row0) * (col1 - col0)
            expected = full[name].view(shape[0], -1)[row0:row1, col0:col1].to(getattr(torch, dtype))
            assert torch.equal(got["read"][name].reshape(expected.shape), expected), name
        assert got["held"] == regions < sum(t.numel() for t in full.values())
