"""Generator side: one receiver per tensor-parallel worker, holding only the region of each parameter
that its rank reads.

A TP rank needs, of every HF tensor, one rectangle (sync/plan.py's regions); allocating whole HF
tensors on every rank would commit a full model per GPU. vLLM's weight loaders, though, take HF-shaped
tensors and cut their part out with `narrow`: `LoaderView` is HF-shaped and answers that `narrow` with
the region it holds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from rlfleet.workers.sync.buckets import DTYPES
from rlfleet.workers.sync.checksum import VERIFIED, compare
from rlfleet.workers.sync.group import GroupAddress, deadline_after, open_group, recv, wait_all, wire_device
from rlfleet.workers.models import weight_files
from rlfleet.workers.sync.plan import (
    LORA_A,
    LORA_B,
    GeneratorLayout,
    Region,
    RouteBuckets,
    adapted_weight,
    as_2d,
    plan_routes,
)
from rlfleet.workers.sync.shards import SyncSettings, row_widths

log = logging.getLogger(__name__)
SETTINGS_FIELDS = ("trainers", "tp_size", "dtype", "bucket_bytes", "backend", "timeout", "verify", "key", "stages")


def receiver_for(join: dict[str, Any], tp_rank: int, vocab_size: int, device: str | torch.device,
                 model_dir: str | Path, dtype: torch.dtype) -> ShardReceiver | AdapterReceiver:
    """`join` is plain data (it crosses gRPC and vLLM's collective_rpc). Pushes of LoRA factors merge them into
    the base weights read from `model_dir`, the directory the engine loaded, staged in the engine's `dtype`."""
    settings = SyncSettings(**{name: join[name] for name in SETTINGS_FIELDS})
    shapes = {name: tuple(shape) for name, shape in join["shapes"]}
    address = settings.address(join["host"], join["port"], join["epoch"])
    receiver = ShardReceiver(settings, address, tp_rank, shapes, vocab_size, device)
    if not any(adapted_weight(name)[1] for name in shapes):
        return receiver
    layout = GeneratorLayout(settings.tp_size, vocab_size)
    weights = sorted({adapted_weight(name)[0] for name in shapes})
    return AdapterReceiver(receiver, *base_regions(Path(model_dir), weights, layout, tp_rank, device), layout, tp_rank,
                           dtype)


def region_shape(shape: tuple[int, ...], region: Region) -> tuple[tuple[int, ...], int | None, int]:
    """(shape of the region's tensor, the dimension it is cut on or None if whole, where the cut starts).

    Regions cut rows (dim 0) or, for 2-D weights split by columns, dim 1; never both (sync/plan.py).
    """
    (row0, row1), (col0, col1) = region
    rows_whole, cols_whole = (row0, row1) == (0, shape[0]), (col0, col1) == (0, as_2d(shape)[1])
    if rows_whole and cols_whole:
        return shape, None, 0
    if cols_whole:
        return (row1 - row0, *shape[1:]), 0, row0
    if rows_whole and len(shape) == 2:
        return (shape[0], col1 - col0), 1, col0
    raise ValueError(f"region {region} of a {shape} tensor cuts more than one dimension")


class LoaderView(Tensor):
    """HF-shaped to vLLM's weight loaders, holding only one region: `narrow` on the cut dimension
    returns (part of) that region; any other use raises instead of reading memory never received."""

    @staticmethod
    def __new__(cls, region: Tensor, shape: tuple[int, ...], dim: int, start: int) -> LoaderView:
        view = Tensor._make_wrapper_subclass(cls, shape, dtype=region.dtype, device=region.device)
        view.region, view.cut_dim, view.cut_start = region, dim, start
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (Tensor.narrow, torch.narrow):
            return _narrow(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on a received region: weight loaders may only narrow() it on its cut dimension")


def _narrow(view: LoaderView, dim: int, start: int, length: int) -> Tensor:
    if length == 0:  # a rank past the real vocabulary reads nothing
        return view.region.narrow(view.cut_dim, 0, 0)
    dim %= len(view.shape)
    offset = start - view.cut_start
    if dim != view.cut_dim or offset < 0 or offset + length > view.region.shape[dim]:
        raise ValueError(f"narrow(dim={dim}, start={start}, length={length}) reads outside the received region "
                         f"(dim {view.cut_dim}, from {view.cut_start}, {view.region.shape[view.cut_dim]} long)")
    return view.region.narrow(dim, offset, length)


class Staged:
    """HF-named staging tensors, each the region of its HF tensor that this rank reads, for the model to load."""

    def __init__(self, targets: dict[str, Tensor], shapes: dict[str, tuple[int, ...]],
                 cuts: dict[str, tuple[tuple[int, ...], int | None, int]]):
        self.targets, self.shapes, self.cuts = targets, shapes, cuts

    def weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF names and HF-shaped tensors for the model's weight loaders (LoaderViews where cut)."""
        for name, target in self.targets.items():
            _, dim, start = self.cuts[name]
            yield name, target if dim is None else LoaderView(target, self.shapes[name], dim, start)

    def swap_into(self, params: dict[str, Tensor]) -> None:
        """Load by exchanging storage with whole parameters of the same shape and dtype (O(1) each): the
        model gets the new weights, the staging tensors the old ones, which the next receive overwrites."""
        with torch.no_grad():
            for name, staged in self.targets.items():
                param = params[name]
                if param.shape != staged.shape or param.dtype != staged.dtype:
                    raise ValueError(f"{name}: cannot swap {tuple(staged.shape)} {staged.dtype} into "
                                     f"{tuple(param.shape)} {param.dtype}")
                param.data, self.targets[name] = staged, param.data


class ShardReceiver(Staged):
    """Receives this TP rank's region of every parameter into staging tensors on `device`."""

    def __init__(self, settings: SyncSettings, address: GroupAddress, tp_rank: int,
                 shapes: dict[str, tuple[int, ...]], vocab_size: int, device: str | torch.device):
        layout = GeneratorLayout(settings.tp_size, vocab_size)
        routes = [r for r in plan_routes(shapes, settings.trainers, layout, settings.stages) if r.dst == tp_rank]
        dtype, widths = DTYPES[settings.dtype], row_widths(shapes)
        self.wire = wire_device(settings.backend, device)
        self.incoming = [(r, RouteBuckets(r, dtype, settings.bucket_bytes, widths)) for r in routes]
        self.buckets = [packer.allocate(self.wire) for _, packer in self.incoming]
        received = {block.name for route in routes for block in route.blocks}
        shapes = {name: shape for name, shape in shapes.items() if name in received}
        regions = {name: layout.region(name, shape, tp_rank) for name, shape in shapes.items()}
        cuts = {name: region_shape(shapes[name], region) for name, region in regions.items()}
        self.origins = {name: (rows[0], cols[0]) for name, (rows, cols) in regions.items()}
        super().__init__({name: torch.empty(cut[0], dtype=dtype, device=device) for name, cut in cuts.items()},
                         shapes, cuts)
        # Direct blocks land straight in the targets when those are on the wire's device; otherwise in
        # wire-side copies, allocated once, then copied over.
        self.landing = [[torch.empty_like(v, device=self.wire) if v.device != self.wire else None for v in views]
                        for views in self._direct_targets()]
        self.sums = [torch.empty(len(buckets) + len(views), dtype=torch.int64, device=self.wire)
                     for buckets, views in zip(self.buckets, self.landing)] if settings.verify else []
        self.group = open_group(address, settings.trainers + tp_rank)

    def receive(self) -> None:
        """Post every receive in the sender's order (per route: buckets, then direct blocks), then unpack
        each bucket as it lands."""
        posted = []
        for (route, _), buckets, views, landing in zip(self.incoming, self.buckets, self._direct_targets(),
                                                       self.landing):
            packed = [recv(self.group, bucket, route.src, tag) for tag, bucket in enumerate(buckets)]
            direct = [recv(self.group, copy if copy is not None else view, route.src, tag)
                      for tag, (view, copy) in enumerate(zip(views, landing), len(buckets))]
            posted.append((packed, direct))
        # Each route's checksums (one per bucket and direct block) come last, tagged after those.
        checks = [recv(self.group, sums, route.src, len(sums)) for (route, _), sums in zip(self.incoming, self.sums)]
        deadline = deadline_after(self.group)
        for ((_, packer), buckets, (packed, _)) in zip(self.incoming, self.buckets, posted):
            for tag, (bucket, work) in enumerate(zip(buckets, packed)):
                wait_all(self.group, [work], deadline, "receive")
                packer.unpack_bucket(tag, bucket, self.targets, self.origins)
        for views, landing, (_, direct) in zip(self._direct_targets(), self.landing, posted):
            wait_all(self.group, direct, deadline, "receive")
            for view, copy in zip(views, landing):
                if copy is not None:
                    view.copy_(copy)
        if self.sums:
            self._verify(checks, deadline)

    def _verify(self, checks: list, deadline: float) -> None:
        """Compare each route's checksums with what arrived (buckets, then direct blocks, as sent)."""
        wait_all(self.group, checks, deadline, "receive checksums")
        for ((route, _), buckets, views, landing, sums) in zip(self.incoming, self.buckets, self._direct_targets(),
                                                              self.landing, self.sums):
            arrived = buckets + [copy if copy is not None else view for view, copy in zip(views, landing)]
            compare(sums, arrived, f"the push from trainer rank {route.src}")
        log.info("push %s (%d routes)", VERIFIED, len(self.sums))

    def _direct_targets(self) -> list[list[Tensor]]:
        return [packer.target_views(self.targets, self.origins) for _, packer in self.incoming]


class AdapterReceiver(Staged):
    """A push of LoRA factors (A, and B already scaled by alpha / rank): receives them, then stages
    W = W_base + B A for every adapted weight, this rank's region of it, for the model to load.

    W_base is read once from the model directory, never from the live model (which holds the last merge):
    every version is the base plus that version's adapters, on a first join as on a rejoin. It is kept as
    stored and the sum is taken in float32, rounded once to the model's `dtype`, as a checkpoint merged by peft
    (`rlfleet merge`, `rlfleet eval`) is when an engine loads it: a sum in bfloat16 of the base already rounded
    loses the part of a small update below half a unit in the last place, so the generators served, and the
    held-out evaluation scored, another policy than the checkpoint's.
    """

    def __init__(self, factors: ShardReceiver, base: dict[str, Tensor], shapes: dict[str, tuple[int, ...]],
                 layout: GeneratorLayout, tp_rank: int, dtype: torch.dtype):
        self.factors, self.base = factors, base
        cuts = {name: region_shape(shape, layout.region(name, shape, tp_rank)) for name, shape in shapes.items()}
        super().__init__({name: torch.empty_like(region, dtype=dtype) for name, region in base.items()}, shapes, cuts)

    def receive(self) -> None:
        self.factors.receive()
        stems = {name: name.rpartition(".") for name in self.targets}
        with torch.no_grad():
            for name, target in self.targets.items():
                stem, _, param = stems[name]
                down, up = (self.factors.targets[f"{stem}.{factor}.{param}"].float() for factor in (LORA_A, LORA_B))
                target.copy_(torch.addmm(self.base[name].float(), up, down))


def base_regions(model_dir: Path, names: list[str], layout: GeneratorLayout, tp_rank: int,
                 device: str | torch.device) -> tuple[dict[str, Tensor], dict[str, tuple[int, ...]]]:
    """This rank's region of each named 2-D weight, read from the model directory's safetensors in the dtype
    stored there, and the weights' full shapes."""
    from safetensors import safe_open

    wanted, regions, shapes = set(names), {}, {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in wanted & set(handle.keys()):
                piece = handle.get_slice(name)
                shapes[name] = tuple(piece.get_shape())
                (row0, row1), (col0, col1) = layout.region(name, shapes[name], tp_rank)
                regions[name] = piece[row0:row1, col0:col1].to(device=device)
    missing = wanted - set(regions)
    if missing:
        raise ValueError(f"{model_dir}: no base weight for the adapters of {sorted(missing)[:3]}")
    return regions, shapes
