"""Sync plan: which rows and columns of each HF parameter go from which trainer rank to which generator rank.

Trainers hold FSDP2 `Shard(0)` pieces (`torch.chunk` rows of dim 0); a vLLM tensor-parallel rank reads
one rectangular region of each HF-shaped tensor through the parameter's `weight_loader`. A route is the
list of intersections between one trainer's rows and one generator rank's regions, so every element
travels once, straight from its owner to the rank that reads it: no gather, no parameter server.
Pure torch: the same plan is computed independently on both ends, so it must be deterministic.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

import torch

from rlfleet.workers.sync.buckets import DTYPES, BucketLayout

Range = tuple[int, int]
Region = tuple[Range, Range]

# vLLM pads the vocabulary of embed_tokens/lm_head to a multiple of this before splitting it (pad_vocab_size).
VOCAB_PADDING = 64

ROWS, COLS, VOCAB = "rows", "cols", "vocab"
# How a Llama-family parameter is cut across TP ranks, keyed by "<module>.<param>"; anything else is replicated.
# ColumnParallel (q/k/v/gate/up, incl. biases) splits dim 0; RowParallel (o/down) splits dim 1 and keeps its
# bias whole; vocab-parallel embeddings split padded dim 0.
SPLITS: dict[str, str] = {
    **{f"{m}.{p}": ROWS for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") for p in ("weight", "bias")},
    "o_proj.weight": COLS,
    "down_proj.weight": COLS,
    "embed_tokens.weight": VOCAB,
    "lm_head.weight": VOCAB,
}
# LoRA factors of a weight W [out, in] (its update is B A, B [out, r], A [r, in]), pushed as
# `<module>.lora_A.weight` and `<module>.lora_B.weight`: B is cut like W's rows, A like W's columns, else whole.
LORA_A, LORA_B = "lora_A", "lora_B"
ADAPTER_SPLITS = {LORA_B: ROWS, LORA_A: COLS}
# vLLM parameter -> the HF parameters stacked (dim 0, in this order) inside each rank's shard.
FUSED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_HEADS = ("q_proj", "k_proj", "v_proj")


def trainer_rows(rows: int, world_size: int, rank: int) -> Range:
    """Rows [start, stop) of dim 0 that trainer `rank` holds: `torch.chunk` semantics, as FSDP2's Shard(0).

    Chunks have ceil(rows / world_size) rows, so the last ranks may hold fewer rows or none.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"trainer rank {rank} outside world of {world_size}")
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def stage_layers(layers: int, stages: int) -> list[range]:
    """The decoder layers of each pipeline stage: contiguous runs, as even as they can be (the first stages hold one
    more when the count does not divide)."""
    if not 1 <= stages <= max(layers, 1):
        raise ValueError(f"{stages} pipeline stages need at least as many decoder layers; the model has {layers}: "
                         "lower roles.trainer.pipelineParallel")
    per, extra = divmod(layers, stages)
    ends = list(itertools.accumulate((per + (stage < extra) for stage in range(stages)), initial=0))
    return [range(start, stop) for start, stop in zip(ends, ends[1:])]


def layer_count(names: Iterable[str]) -> int:
    """Decoder layers named among these parameters (`...layers.<i>.`)."""
    return 1 + max((int(m.group(1)) for m in map(_LAYER.search, names) if m), default=-1)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class TrainerLayout:
    """Which rows of each parameter each trainer rank holds. Without a pipeline (`stages` 1) every rank holds
    `trainer_rows` of every parameter. With one, rank r runs stage r // (ranks / stages), which holds its decoder
    layers (`stage_layers`), the first stage the embedding too and the last every other parameter (final norm,
    output layer); the stage's ranks hold `trainer_rows` of its parameters among themselves (FSDP2 over them)."""

    ranks: int
    stages: int = 1
    layers: int = 0
    """Decoder layers of the model (with a pipeline)."""

    def stage_of(self, name: str) -> int:
        if self.stages == 1:
            return 0
        match = _LAYER.search(name)
        if match is None:
            return 0 if "embed_tokens" in name else self.stages - 1
        index = int(match.group(1))
        return next(stage for stage, run in enumerate(stage_layers(self.layers, self.stages)) if index in run)

    def rows(self, name: str, rows: int, rank: int) -> Range:
        """Rows [start, stop) of parameter `name` that `rank` holds; empty if its stage does not hold it."""
        if self.ranks % self.stages:
            raise ValueError(f"{self.stages} pipeline stages do not divide {self.ranks} trainer ranks")
        per = self.ranks // self.stages
        stage, index = divmod(rank, per)
        if stage != self.stage_of(name):
            return 0, 0
        return trainer_rows(rows, per, index)


def adapted_weight(name: str) -> tuple[str, str | None]:
    """(`...q_proj.weight`, `lora_A`) for a LoRA factor's name; (name, None) for any other parameter."""
    head, _, param = name.rpartition(".")
    stem, _, factor = head.rpartition(".")
    if factor in ADAPTER_SPLITS:
        return f"{stem}.{param}", factor
    return name, None


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """Plans see every tensor as [rows, cols]: 1-D tensors as [rows, 1], trailing dims flattened."""
    if len(shape) == 0:
        raise ValueError("0-d parameters cannot be sharded on dim 0")
    cols = 1
    for size in shape[1:]:
        cols *= size
    return shape[0], cols


def _even(size: int, parts: int, index: int, what: str) -> Range:
    if size % parts:
        raise ValueError(f"{what}: {size} is not divisible by tp_size {parts}")
    per = size // parts
    return index * per, (index + 1) * per


@dataclass(frozen=True)
class GeneratorLayout:
    """vLLM tensor parallelism as seen from the HF checkpoint: which region each TP rank's loader reads.

    GQA with tp_size > num_kv_heads is not supported: vLLM then replicates kv heads across ranks, which
    this plan does not model. Given `head_dim`, it is detected (heads % tp_size != 0 raises); without it
    only row-count divisibility is checked, which catches it when kv rows are too few to split.
    """

    tp_size: int
    vocab_size: int
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.vocab_size < 1:
            raise ValueError(f"tp_size and vocab_size must be positive, got {self.tp_size}, {self.vocab_size}")

    @classmethod
    def of_model(cls, config: dict, tp_size: int) -> GeneratorLayout:
        """The layout of the model with this config.json, its query and kv heads checked against tp_size at once
        (not at the first push)."""
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        layout = cls(tp_size, config["vocab_size"], head_dim)
        for proj, count in (("q_proj", heads), ("k_proj", config.get("num_key_value_heads") or heads)):
            layout._check_heads(f"{proj}.weight", count * head_dim)
        return layout

    def region(self, name: str, shape: tuple[int, ...], tp_rank: int) -> Region:
        """(row range, col range) of the HF tensor `name` that TP rank `tp_rank` reads; ranges may be empty."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp rank {tp_rank} outside tp_size {self.tp_size}")
        rows, cols = as_2d(shape)
        weight, factor = adapted_weight(name)
        rule = SPLITS.get(".".join(weight.split(".")[-2:]))
        if factor is not None and rule != ADAPTER_SPLITS[factor]:
            rule = None  # the factor on the other side of a split weight is read whole by every rank
        if rule == ROWS:
            self._check_heads(weight, rows)
            return _even(rows, self.tp_size, tp_rank, name), (0, cols)
        if rule == COLS:
            if len(shape) != 2:
                raise ValueError(f"{name}: expected a 2-D weight to split on dim 1, got shape {shape}")
            return (0, rows), _even(cols, self.tp_size, tp_rank, name)
        if rule == VOCAB:
            return self._vocab_rows(name, rows, tp_rank), (0, cols)
        return (0, rows), (0, cols)

    def _vocab_rows(self, name: str, rows: int, tp_rank: int) -> Range:
        if rows != self.vocab_size:
            raise ValueError(f"{name}: {rows} rows but vocab_size is {self.vocab_size}")
        padded = -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        start, stop = _even(padded, self.tp_size, tp_rank, f"{name} (padded vocab)")
        # Rows past the real vocabulary are padding that exists only inside vLLM: high ranks may read nothing.
        return min(start, rows), min(stop, rows)

    def _check_heads(self, name: str, rows: int) -> None:
        if self.head_dim is None or name.split(".")[-2] not in _HEADS:
            return
        heads, rest = divmod(rows, self.head_dim)
        if rest or heads % self.tp_size:
            raise ValueError(
                f"{name}: {rows} rows is not a multiple of head_dim {self.head_dim} x tp_size {self.tp_size}"
                " (GQA with tp_size > num_kv_heads replicates kv heads, which the sync plan does not support)"
            )


def fused_parts(layout: GeneratorLayout, shapes: dict[str, tuple[int, ...]], tp_rank: int) -> dict[str, list[tuple[str, Range]]]:
    """vLLM fused parameter name -> ordered (HF source name, row range) pieces of its shard on `tp_rank`.

    The fused shard is the concatenation along dim 0 of those row slices of the received HF tensors.
    """
    fused: dict[str, list[tuple[str, Range]]] = {}
    for name in shapes:
        parts = name.rsplit(".", 2)
        if len(parts) != 3:
            continue
        prefix, module, param = parts
        for target, sources in FUSED.items():
            if module != sources[0]:
                continue
            names = [f"{prefix}.{source}.{param}" for source in sources]
            missing = [n for n in names if n not in shapes]
            if missing:
                raise ValueError(f"{prefix}.{target}.{param} needs {missing}, absent from the shapes")
            fused[f"{prefix}.{target}.{param}"] = [(n, layout.region(n, shapes[n], tp_rank)[0]) for n in names]
    return fused


@dataclass(frozen=True)
class Block:
    """A rectangle (rows x cols of the [rows, cols] view) of one HF parameter."""

    name: str
    rows: Range
    cols: Range

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])


@dataclass(frozen=True)
class Route:
    """Everything trainer rank `src` sends to generator TP rank `dst`, in plan order."""

    src: int
    dst: int
    blocks: tuple[Block, ...]


# Below this a block rides in a bucket: one message per small tensor would cost more than its copy.
DIRECT_MIN_BYTES = 1 << 20


def _whole_rows(block: Block, widths: dict[str, int]) -> bool:
    return block.cols == (0, widths[block.name])


def _intersect(a: Range, b: Range) -> Range | None:
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def plan_routes(shapes: dict[str, tuple[int, ...]], trainers: int, layout: GeneratorLayout,
                stages: int = 1) -> list[Route]:
    """Routes sorted by (src, dst); blocks in parameter order (one block per parameter and route at most). With
    pipeline `stages`, each parameter goes from the ranks of the stage that holds it (TrainerLayout)."""
    owners = TrainerLayout(trainers, stages, layer_count(shapes))
    blocks: dict[tuple[int, int], list[Block]] = {}
    for name, shape in shapes.items():
        rows, _ = as_2d(shape)
        regions = [layout.region(name, shape, dst) for dst in range(layout.tp_size)]
        for src in range(trainers):
            owned = owners.rows(name, rows, src)
            for dst, (region_rows, region_cols) in enumerate(regions):
                both = _intersect(owned, region_rows)
                if both is not None and region_cols[0] < region_cols[1]:
                    blocks.setdefault((src, dst), []).append(Block(name, both, region_cols))
    return [Route(src, dst, tuple(found)) for (src, dst), found in sorted(blocks.items())]


# Receivers may hold only a region of a parameter: origins[name] is the (row, col) of the HF tensor
# at which the receiver's tensor starts; (0, 0) when absent (the whole tensor).
Origins = dict[str, tuple[int, int]]


def _origin(origins: Origins | None, name: str) -> tuple[int, int]:
    return (0, 0) if origins is None else origins.get(name, (0, 0))


class RouteBuckets:
    """Flat, reused transfer buckets for one route: planned once, packed by src, unpacked by dst.

    With `widths` (columns of each parameter), large blocks of whole rows are *direct*: contiguous in
    both the trainer's shard and the receiver's tensor, so they travel as views of those, with no
    copy on either side; only the rest is packed into buckets.
    """

    def __init__(self, route: Route, dtype: torch.dtype, bucket_bytes: int,
                 widths: dict[str, int] | None = None) -> None:
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"unsupported bucket dtype {dtype}; use one of {sorted(DTYPES)}")
        self.route = route
        self.dtype = dtype
        size = torch.empty((), dtype=dtype).element_size()
        self.direct = [b for b in route.blocks if widths and _whole_rows(b, widths) and b.numel * size >= DIRECT_MIN_BYTES]
        packed = [b for b in route.blocks if b not in self.direct]
        shapes = [(b.name, (b.rows[1] - b.rows[0], b.cols[1] - b.cols[0])) for b in packed]
        self.layout = BucketLayout.plan(shapes, names[dtype], bucket_bytes)
        self._by_bucket: list[list] = [[] for _ in self.layout.bucket_numels]
        for block, slot in zip(packed, self.layout.slots):
            self._by_bucket[slot.bucket].append((block, slot))

    def source_views(self, local_shards: dict[str, torch.Tensor], src_row0: Callable[[str], int]) -> list[torch.Tensor]:
        """The direct blocks as contiguous views of the trainer's local shards (no copy)."""
        views = []
        for block in self.direct:
            shard = local_shards[block.name].detach()
            start, stop = block.rows[0] - src_row0(block.name), block.rows[1] - src_row0(block.name)
            if start < 0 or stop > shard.shape[0]:
                raise ValueError(f"{block.name}: rows {block.rows} not in this trainer's shard")
            views.append(shard.view(shard.shape[0], -1)[start:stop])
        return views

    def target_views(self, targets: dict[str, torch.Tensor], origins: Origins | None = None) -> list[torch.Tensor]:
        """Where the direct blocks land: contiguous row ranges of the receiver's tensors."""
        views = []
        for block in self.direct:
            target, (row0, _) = targets[block.name], _origin(origins, block.name)
            views.append(target.view(*as_2d(tuple(target.shape)))[block.rows[0] - row0 : block.rows[1] - row0])
        return views

    def allocate(self, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Allocate once and reuse for every version: fresh buffers cost page faults (ENVIRONMENT.md)."""
        return self.layout.allocate(device)

    def total_bytes(self) -> int:
        return sum(self.layout.bucket_numels) * torch.empty((), dtype=self.dtype).element_size()

    def pack(
        self,
        local_shards: dict[str, torch.Tensor],
        src_row0: dict[str, int] | Callable[[str], int],
        buckets: list[torch.Tensor],
    ) -> None:
        """Copy each block out of the trainer's local shard (first global row `src_row0[name]`) into its slot."""
        for index, bucket in enumerate(buckets):
            self.pack_bucket(index, local_shards, src_row0, bucket)

    def pack_bucket(
        self,
        index: int,
        local_shards: dict[str, torch.Tensor],
        src_row0: dict[str, int] | Callable[[str], int],
        bucket: torch.Tensor,
    ) -> None:
        """Pack only bucket `index`, so a sender can start sending it while it packs the next."""
        row0 = src_row0 if callable(src_row0) else src_row0.__getitem__
        with torch.no_grad():
            for block, slot in self._in_bucket(index):
                shard = local_shards[block.name].detach()
                start, stop = block.rows[0] - row0(block.name), block.rows[1] - row0(block.name)
                # Slicing clamps silently; a block outside the local rows is a planning bug, so say so.
                if start < 0 or stop > shard.shape[0]:
                    raise ValueError(f"{block.name}: rows {block.rows} not in this trainer's shard")
                source = shard.reshape(shard.shape[0], -1)[start:stop, block.cols[0] : block.cols[1]]
                slot.view(bucket).copy_(source)

    def unpack(self, buckets: list[torch.Tensor], targets: dict[str, torch.Tensor],
               origins: Origins | None = None) -> None:
        """Copy each block into its (rows, cols) place of its target; nothing else is written."""
        for index, bucket in enumerate(buckets):
            self.unpack_bucket(index, bucket, targets, origins)

    def unpack_bucket(self, index: int, bucket: torch.Tensor, targets: dict[str, torch.Tensor],
                      origins: Origins | None = None) -> None:
        """Unpack only bucket `index`, so a receiver can unpack it while the next one arrives."""
        with torch.no_grad():
            for block, slot in self._in_bucket(index):
                target, (row0, col0) = targets[block.name], _origin(origins, block.name)
                rows, cols = as_2d(tuple(target.shape))
                # view (not reshape): a non-contiguous target would silently receive into a copy.
                place = target.view(rows, cols)[block.rows[0] - row0 : block.rows[1] - row0,
                                                block.cols[0] - col0 : block.cols[1] - col0]
                place.copy_(slot.view(bucket))

    def _in_bucket(self, index: int) -> list:
        return self._by_bucket[index]
