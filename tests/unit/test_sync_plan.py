"""Sync plan: trainer Shard(0) rows -> vLLM TP regions, routed, packed into buckets and unpacked bit-exactly."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from rlfleet.workers.sync.plan import (
    FUSED,
    Block,
    GeneratorLayout,
    Route,
    RouteBuckets,
    as_2d,
    fused_parts,
    plan_routes,
    trainer_rows,
)

SEEDS = [0, 1, 2]
TRAINERS = [1, 2, 3, 4]
TP_SIZES = [1, 2, 4]


def llama_shapes(seed: int) -> tuple[dict[str, tuple[int, ...]], int, int]:
    """A tiny random Llama-like model (q/k/v biases as in Qwen2): shapes, vocab and head_dim."""
    rng = random.Random(seed)
    head_dim = rng.choice([1, 2, 3])
    heads, kv_heads = rng.choice([(4, 4), (8, 4), (8, 8)])
    hidden, inter = heads * head_dim, 4 * rng.randint(1, 5)
    # Never a multiple of 64: with TP 4, 70 and 5 leave the last ranks nothing, 100 leaves rank 3 a few rows.
    vocab = (70, 100, 5)[seed % 3]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(2):
        p = f"model.layers.{layer}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        for m, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            shapes[f"{p}.self_attn.{m}.weight"] = (rows * head_dim, hidden)
            if layer == 0:
                shapes[f"{p}.self_attn.{m}.bias"] = (rows * head_dim,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes, vocab, head_dim


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Never exactly zero, so a zero in a target means "not written"."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        magnitude = torch.rand(shape, generator=generator) + 0.5
        sign = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        out[name] = magnitude * sign
    return out


def local_shard(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """What FSDP2 keeps on `rank`: its torch.chunk piece, as a clone (no view into the full tensor)."""
    chunks = torch.chunk(full, world, dim=0)
    return (chunks[rank] if rank < len(chunks) else full[:0]).clone()


def region_mask(layout: GeneratorLayout, name: str, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    (r0, r1), (c0, c1) = layout.region(name, shape, rank)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask.view(shape[0], -1)[r0:r1, c0:c1] = True
    return mask


def transfer(shapes, weights, trainers, layout, bucket_bytes, dtype=torch.float32):
    """Pack every route on its trainer from local shards only; unpack on its generator rank into zeros."""
    shards = [{n: local_shard(w, trainers, src) for n, w in weights.items()} for src in range(trainers)]
    targets = [{n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()} for _ in range(layout.tp_size)]
    routes = plan_routes(shapes, trainers, layout)
    for route in routes:
        buckets = RouteBuckets(route, dtype, bucket_bytes)
        wire = buckets.allocate()
        buckets.pack(shards[route.src], lambda n, src=route.src: trainer_rows(shapes[n][0], trainers, src)[0], wire)
        received = [b.clone() for b in wire]  # the generator's own buffers
        buckets.unpack(received, targets[route.dst])
    return routes, targets


@pytest.mark.parametrize("rows", range(0, 13))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_trainer_rows_match_torch_chunk(rows, world):
    chunks = torch.chunk(torch.arange(rows), world)
    for rank in range(world):
        start, stop = trainer_rows(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, stop)) == expected


def test_regions_by_hand():
    layout = GeneratorLayout(tp_size=4, vocab_size=70)
    # Padded to 128, 32 rows per rank: rank 2 reads the last 6 real rows, rank 3 only padding (nothing).
    assert [layout.region("model.embed_tokens.weight", (70, 8), r)[0] for r in range(4)] == [(0, 32), (32, 64), (64, 70), (70, 70)]
    assert layout.region("lm_head.weight", (70, 8), 1) == ((32, 64), (0, 8))
    assert layout.region("model.layers.3.self_attn.k_proj.weight", (8, 12), 3) == ((6, 8), (0, 12))
    assert layout.region("model.layers.3.self_attn.q_proj.bias", (8,), 1) == ((2, 4), (0, 1))
    assert layout.region("model.layers.0.mlp.down_proj.weight", (12, 16), 2) == ((0, 12), (8, 12))
    assert layout.region("model.layers.0.self_attn.o_proj.weight", (12, 8), 0) == ((0, 12), (0, 2))
    assert layout.region("model.layers.0.input_layernorm.weight", (12,), 3) == ((0, 12), (0, 1))
    assert layout.region("model.norm.weight", (12,), 1) == ((0, 12), (0, 1))
    two = GeneratorLayout(tp_size=2, vocab_size=100)
    # vLLM's embed shard is [vocab_padded / tp, hidden] = [64, hidden]; rank 1 holds 36 real rows.
    assert [two.region("model.embed_tokens.weight", (100, 8), r)[0] for r in range(2)] == [(0, 64), (64, 100)]


@pytest.mark.parametrize(
    "layout, name, shape",
    [
        (GeneratorLayout(4, 70), "model.layers.0.self_attn.q_proj.weight", (6, 8)),
        (GeneratorLayout(4, 70), "model.layers.0.mlp.up_proj.weight", (10, 8)),
        (GeneratorLayout(4, 70), "model.layers.0.self_attn.o_proj.weight", (8, 6)),
        (GeneratorLayout(2, 70), "model.layers.0.mlp.down_proj.weight", (8, 7)),
        (GeneratorLayout(4, 70), "model.embed_tokens.weight", (71, 8)),
        # 2 kv heads of dim 4 on 4 ranks: rows divide, heads do not (vLLM would replicate kv heads).
        (GeneratorLayout(4, 70, head_dim=4), "model.layers.0.self_attn.k_proj.weight", (8, 16)),
        (GeneratorLayout(3, 70), "model.embed_tokens.weight", (70, 8)),  # padded 128 rows on 3 ranks
    ],
)
def test_indivisible_splits_raise(layout, name, shape):
    with pytest.raises(ValueError, match="divisible|vocab_size|head_dim"):
        layout.region(name, shape, 0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("trainers", TRAINERS)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_routes_cover_each_region_exactly_once(seed, trainers, tp):
    shapes, vocab, head_dim = llama_shapes(seed)
    layout = GeneratorLayout(tp, vocab, head_dim)
    routes = plan_routes(shapes, trainers, layout)
    assert routes == plan_routes(shapes, trainers, layout), "the plan must be deterministic"
    assert [(r.src, r.dst) for r in routes] == sorted({(r.src, r.dst) for r in routes})
    order = list(shapes)
    for route in routes:
        assert route.blocks, "routes without blocks are omitted"
        assert [order.index(b.name) for b in route.blocks] == sorted(order.index(b.name) for b in route.blocks)
        for block in route.blocks:
            assert block.numel > 0
            start, stop = trainer_rows(shapes[block.name][0], trainers, route.src)
            assert start <= block.rows[0] < block.rows[1] <= stop, "a trainer sends only rows it owns"
    for dst in range(tp):
        for name, shape in shapes.items():
            count = torch.zeros(shape, dtype=torch.int64)
            for route in routes:
                for block in route.blocks:
                    if route.dst == dst and block.name == name:
                        count.view(shape[0], -1)[block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]] += 1
            assert torch.equal(count, region_mask(layout, name, shape, dst).long()), (dst, name)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("trainers", TRAINERS)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_round_trip_is_bit_exact_and_writes_only_the_region(seed, trainers, tp):
    shapes, vocab, head_dim = llama_shapes(seed)
    layout = GeneratorLayout(tp, vocab, head_dim)
    weights = random_weights(shapes, seed)
    _, targets = transfer(shapes, weights, trainers, layout, bucket_bytes=[64, 1000, 1 << 20][seed])
    for dst, name in itertools.product(range(tp), shapes):
        mask = region_mask(layout, name, shapes[name], dst)
        got = targets[dst][name]
        assert torch.equal(got[mask], weights[name][mask]), (dst, name)
        assert not got[~mask].any(), f"rank {dst} wrote outside its region of {name}"


def test_sweep_includes_trainers_without_rows_and_empty_vocab_ranks():
    """Guards the sweep above: it must exercise ranks that own nothing."""
    empty_trainer = empty_vocab = False
    for seed, trainers, tp in itertools.product(SEEDS, TRAINERS, TP_SIZES):
        shapes, vocab, head_dim = llama_shapes(seed)
        layout = GeneratorLayout(tp, vocab, head_dim)
        for name, shape in shapes.items():
            empty_trainer |= any(trainer_rows(shape[0], trainers, r) == (shape[0], shape[0]) for r in range(trainers))
        empty_vocab |= any(layout.region("lm_head.weight", (vocab, 1), r)[0][0] == vocab for r in range(tp))
    assert empty_trainer and empty_vocab


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("trainers", [1, 3])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_fused_shards_rebuild_from_received_tensors(seed, trainers, tp):
    shapes, vocab, head_dim = llama_shapes(seed)
    layout = GeneratorLayout(tp, vocab, head_dim)
    weights = random_weights(shapes, seed)
    _, targets = transfer(shapes, weights, trainers, layout, bucket_bytes=256)
    for rank in range(tp):
        parts = fused_parts(layout, shapes, rank)
        # Two layers of qkv and gate_up weights, plus layer 0's qkv bias.
        assert sorted(parts) == sorted(
            [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)]
            + [f"model.layers.{i}.mlp.gate_up_proj.weight" for i in range(2)]
            + ["model.layers.0.self_attn.qkv_proj.bias"]
        )
        for fused, pieces in parts.items():
            prefix, module, param = fused.rsplit(".", 2)
            sources = [f"{prefix}.{m}.{param}" for m in FUSED[module]]
            assert [source for source, _ in pieces] == sources
            rebuilt = torch.cat([targets[rank][source][r0:r1] for source, (r0, r1) in pieces])
            # Reference: what vLLM's fused loader would hold, each HF part cut evenly by TP rank.
            reference = torch.cat([torch.chunk(weights[source], tp)[rank] for source in sources])
            assert torch.equal(rebuilt, reference), (rank, fused)


def test_fused_parts_need_every_source():
    shapes = {"m.layers.0.mlp.gate_proj.weight": (4, 2)}
    with pytest.raises(ValueError, match="up_proj"):
        fused_parts(GeneratorLayout(2, 64), shapes, 0)


def test_pack_reads_only_the_local_shard():
    full = torch.arange(40.0).view(10, 4)
    route = Route(src=1, dst=0, blocks=(Block("w", (3, 5), (1, 3)),))
    buckets = RouteBuckets(route, torch.float32, 1024)
    wire = buckets.allocate()
    shard = full[3:6].clone()  # trainer 1 of 4 owns rows [3, 6)
    buckets.pack({"w": shard}, {"w": 3}, wire)
    assert torch.equal(wire[0], full[3:5, 1:3].reshape(-1))
    # Rows the trainer does not own: a clear error, not a silent clamp or a read of someone else's memory.
    for row0 in (4, 0):
        with pytest.raises(ValueError, match="not in this trainer's shard"):
            buckets.pack({"w": shard}, {"w": row0}, wire)


def test_buckets_are_reused_and_sizes_respected():
    shapes, vocab, head_dim = llama_shapes(1)
    layout = GeneratorLayout(2, vocab, head_dim)
    bucket_bytes = 96
    for route in plan_routes(shapes, 2, layout):
        buckets = RouteBuckets(route, torch.float32, bucket_bytes)
        wire = buckets.allocate()
        pointers = [b.data_ptr() for b in wire]
        assert buckets.total_bytes() == sum(b.numel() * b.element_size() for b in wire)
        assert buckets.total_bytes() == 4 * sum(block.numel for block in route.blocks)
        for index, bucket in enumerate(wire):
            slots = [s for s in buckets.layout.slots if s.bucket == index]
            if bucket.numel() * 4 > bucket_bytes:
                assert len(slots) == 1, "only a single oversized block may exceed the bucket size"
        rows0 = {n: trainer_rows(s[0], 2, route.src)[0] for n, s in shapes.items()}
        for seed in (5, 6):
            weights = random_weights(shapes, seed)
            shards = {n: local_shard(w, 2, route.src) for n, w in weights.items()}
            buckets.pack(shards, rows0, wire)
            assert [b.data_ptr() for b in wire] == pointers
            targets = {n: torch.zeros(s) for n, s in shapes.items()}
            buckets.unpack(wire, targets)
            for block in route.blocks:
                got = targets[block.name].view(shapes[block.name][0], -1)[slice(*block.rows), slice(*block.cols)]
                want = weights[block.name].view(shapes[block.name][0], -1)[slice(*block.rows), slice(*block.cols)]
                assert torch.equal(got, want), (seed, block)


def test_bfloat16_buckets_round_trip_and_other_dtypes_are_refused():
    shapes, vocab, head_dim = llama_shapes(2)
    layout = GeneratorLayout(4, vocab, head_dim)
    weights = {n: w.to(torch.bfloat16) for n, w in random_weights(shapes, 3).items()}
    routes, targets = transfer(shapes, weights, 3, layout, bucket_bytes=128, dtype=torch.bfloat16)
    for dst, name in itertools.product(range(4), shapes):
        mask = region_mask(layout, name, shapes[name], dst)
        assert torch.equal(targets[dst][name][mask], weights[name][mask])
    with pytest.raises(ValueError, match="unsupported bucket dtype"):
        RouteBuckets(routes[0], torch.int64, 128)


def test_large_whole_row_blocks_travel_as_views_without_copies():
    shapes = {"a.q_proj.weight": (2048, 512), "a.o_proj.weight": (512, 1024), "norm.weight": (512,)}
    widths = {name: as_2d(shape)[1] for name, shape in shapes.items()}
    layout = GeneratorLayout(2, 1000)
    full = {name: torch.randn(shape) for name, shape in shapes.items()}
    for route in plan_routes(shapes, 2, layout):
        packer = RouteBuckets(route, torch.float32, 1 << 20, widths)
        names = {b.name for b in packer.direct}
        assert names == {b.name for b in route.blocks} & {"a.q_proj.weight"}, "only big whole-row blocks go direct"
        locals_ = {n: t[slice(*trainer_rows(t.shape[0], 2, route.src))].clone() for n, t in full.items()}
        row0 = {n: trainer_rows(s[0], 2, route.src)[0] for n, s in shapes.items()}
        sources = packer.source_views(locals_, row0.__getitem__)
        assert all(v.data_ptr() >= locals_["a.q_proj.weight"].data_ptr() for v in sources), "views, not copies"
        targets = {n: torch.zeros(s) for n, s in shapes.items()}
        for source, target in zip(sources, packer.target_views(targets)):
            target.copy_(source)  # what the wire does
        buckets = packer.allocate()
        packer.pack(locals_, row0, buckets)
        packer.unpack(buckets, targets)
        for block in route.blocks:
            region = (slice(*block.rows), slice(*block.cols))
            got = targets[block.name].view(-1, widths[block.name])[region]
            assert torch.equal(got, full[block.name].view(-1, widths[block.name])[region]), block


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("trainers", [1, 3])
@pytest.mark.parametrize("tp", [2, 4])
def test_round_trip_into_region_only_targets(seed, trainers, tp, monkeypatch):
    """A TP receiver holds only its regions: each block lands at its place relative to the region's origin,
    through buckets and direct views alike, bit-exactly."""
    import rlfleet.workers.sync.plan as plan

    monkeypatch.setattr(plan, "DIRECT_MIN_BYTES", 16)  # direct blocks at this size too
    shapes, vocab, head_dim = llama_shapes(seed)
    layout = GeneratorLayout(tp, vocab, head_dim)
    weights = random_weights(shapes, seed)
    widths = {name: as_2d(shape)[1] for name, shape in shapes.items()}
    direct = 0
    for route in plan_routes(shapes, trainers, layout):
        regions = {name: layout.region(name, shape, route.dst) for name, shape in shapes.items()}
        origins = {name: (rows[0], cols[0]) for name, (rows, cols) in regions.items()}
        targets = {name: torch.zeros(rows[1] - rows[0], cols[1] - cols[0]) for name, (rows, cols) in regions.items()}
        packer = RouteBuckets(route, torch.float32, 256, widths)
        shards = {n: local_shard(w, trainers, route.src) for n, w in weights.items()}
        row0 = {n: trainer_rows(s[0], trainers, route.src)[0] for n, s in shapes.items()}
        for source, target in zip(packer.source_views(shards, row0.__getitem__), packer.target_views(targets, origins)):
            target.copy_(source)
        buckets = packer.allocate()
        packer.pack(shards, row0, buckets)
        packer.unpack(buckets, targets, origins)
        direct += len(packer.direct)
        for block in route.blocks:
            (r0, _), (c0, _) = regions[block.name]
            got = targets[block.name][block.rows[0] - r0 : block.rows[1] - r0, block.cols[0] - c0 : block.cols[1] - c0]
            full = weights[block.name].view(shapes[block.name][0], -1)
            assert torch.equal(got, full[slice(*block.rows), slice(*block.cols)]), block
    assert direct, "no direct block: the views' origins went untested"


@pytest.mark.parametrize("tp_size, refused", [(1, False), (2, False), (4, True), (8, True)])
def test_a_model_layout_checks_its_kv_heads_at_once(tp_size, refused):
    """8 query heads and 2 kv heads of 64: a split that vLLM would make by replicating kv heads is refused from the
    config, not at the first push."""
    config = {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512, "vocab_size": 100}
    if refused:
        with pytest.raises(ValueError, match="k_proj.weight: 128 rows is not a multiple of head_dim 64"):
            GeneratorLayout.of_model(config, tp_size)
    else:
        assert GeneratorLayout.of_model(config, tp_size).head_dim == 64


@pytest.mark.parametrize("tp", [2, 4])
def test_a_checkpoints_own_fused_weights_reach_every_rank_whole(tp):
    """Phi-3's checkpoint holds qkv_proj and gate_up_proj already fused, under vLLM's own names. vLLM's loader
    splits such a weight into its q, k, v (gate, up) parts and cuts each by rank, so a rank needs rows from every
    part: no one row range serves it. Each rank gets the whole tensor, and nothing rebuilds it from parts."""
    shapes = {"model.layers.0.self_attn.qkv_proj.weight": (16, 8), "model.layers.0.mlp.gate_up_proj.weight": (32, 8),
              "model.layers.0.self_attn.o_proj.weight": (8, 8)}
    layout = GeneratorLayout(tp, 64, head_dim=2)
    for rank in range(tp):
        for name in ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
            assert layout.region(name, shapes[name], rank) == ((0, shapes[name][0]), (0, 8)), (name, rank)
        assert fused_parts(layout, shapes, rank) == {}
