"""`rlfleet bench weight-sync`: DDMA shard-to-shard sync vs a raw gloo broadcast of the same bytes.

Trainer ranks hold FSDP2-style Shard(0) pieces of a synthetic Llama-shaped model; generator ranks
(tensor-parallel workers of one replica, plain torch receivers) each need their TP region. Both
transfers run in the same processes, alternating, so the ratio is measured side by side.

The push is measured with both ways of never changing weights a push still reads (DESIGN §2),
alternating in the same processes: *wait* sends large blocks as views of the live shards and the
trainer waits for those sends before its next optimizer step (the shards are held until then);
*snapshot* copies them first, so the shards are free once publish returns, at the price of the copy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from rlfleet.workers.auth import new_token, sync_key
from rlfleet.workers.plan import free_port
from rlfleet.workers.sync.group import GroupAddress, broadcast, open_group
from rlfleet.workers.sync.plan import trainer_rows
from rlfleet.workers.sync.receiving import ShardReceiver
from rlfleet.workers.sync.shards import ShardPublisher, SyncSettings

HIDDEN, INTERMEDIATE, VOCAB = 1024, 2816, 8192
# ShardPublisher.snapshot per measured push: False = wait (live views), True = snapshot (copies).
STRATEGIES = (False, True)


def synthetic_shapes(size_mb: int) -> dict[str, tuple[int, ...]]:
    """Llama-shaped parameters adding up to about size_mb of float32."""
    per_layer = {"self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
                 "self_attn.v_proj.weight": (HIDDEN, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                 "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                 "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE), "input_layernorm.weight": (HIDDEN,)}
    layer_bytes = 4 * sum(_numel(s) for s in per_layer.values())
    ends_bytes = 4 * 2 * VOCAB * HIDDEN
    layers = max(1, round((size_mb * 2**20 - ends_bytes) / layer_bytes))
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for layer in range(layers):
        shapes |= {f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()}
    return shapes | {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.tensor(shape).prod())


def _trainer(rank: int, settings: SyncSettings, shapes, port: int, raw_port: int, repeats: int, results) -> None:
    torch.manual_seed(rank)
    shards = {n: torch.randn(trainer_rows(s[0], settings.trainers, rank)[1] - trainer_rows(s[0], settings.trainers, rank)[0], *s[1:])
              for n, s in shapes.items()}
    publisher = ShardPublisher(rank, settings, shapes, VOCAB)
    publisher.connect(0, "127.0.0.1", port, epoch=1)
    raw = _raw_group(settings, raw_port, 0) if rank == 0 else None
    flat = torch.empty(sum(_numel(s) for s in shapes.values())) if rank == 0 else None
    group = publisher.groups[0].group
    for _ in range(repeats):
        for snapshot in STRATEGIES:
            publisher.snapshot = snapshot
            group.barrier().wait()
            start = time.perf_counter()
            packed = publisher.publish(shards, [0])
            publisher.release_shards()  # what the trainer calls before its optimizer step
            held = time.perf_counter() - start
            publisher.wait()
            results.put(("pack", snapshot, packed, held))
            group.barrier().wait()
            if raw is not None:
                broadcast(raw, flat, 0)
    publisher.close()


def _receiver(tp_rank: int, settings: SyncSettings, shapes, port: int, raw_port: int, repeats: int, results) -> None:
    receiver = ShardReceiver(settings, settings.address("127.0.0.1", port, 1), tp_rank, shapes, VOCAB, "cpu")
    raw = _raw_group(settings, raw_port, 1 + tp_rank)
    flat = torch.empty(sum(_numel(s) for s in shapes.values()))
    # The torch engine's load: the staged tensors swap places with the model's parameters.
    params = {n: torch.nn.Parameter(torch.empty_like(t), requires_grad=False) for n, t in receiver.targets.items()}
    for _ in range(repeats):
        for snapshot in STRATEGIES:
            receiver.group.group.barrier().wait()
            start = time.perf_counter()
            receiver.receive()
            received = time.perf_counter()
            receiver.swap_into(params)
            loaded = time.perf_counter()
            receiver.group.group.barrier().wait()
            raw_start = time.perf_counter()
            broadcast(raw, flat, 0)
            results.put(("sync", snapshot, received - start, loaded - received, time.perf_counter() - raw_start))


def _raw_group(settings: SyncSettings, port: int, rank: int):
    return open_group(GroupAddress("127.0.0.1", port, 1 + settings.tp_size, "gloo", settings.timeout,
                                   key=settings.key), rank)


def run(size_mb: int, trainers: int, tp: int, bucket_mb: int, repeats: int,
        verify: bool = False) -> list[dict[str, float]]:
    """One row per strategy (wait, snapshot), measured alternately in the same processes."""
    shapes = synthetic_shapes(size_mb)
    settings = SyncSettings(trainers=trainers, tp_size=tp, dtype="float32", bucket_bytes=bucket_mb << 20,
                            backend="gloo", timeout=300.0, verify=verify, key=sync_key(new_token()))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port, raw_port = free_port(), free_port()
    args = (settings, shapes, port, raw_port, repeats, results)
    procs = [context.Process(target=_trainer, args=(r, *args)) for r in range(trainers)]
    procs += [context.Process(target=_receiver, args=(t, *args)) for t in range(tp)]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=600) for _ in range(repeats * len(STRATEGIES) * (trainers + tp))]
    for proc in procs:
        proc.join(timeout=60)
    size = 4 * sum(_numel(s) for s in shapes.values()) / 2**20
    return [_summary(rows, snapshot, tp, repeats) | {"size_mb": size, "trainers": trainers, "tp": tp,
                                                     "bucket_mb": bucket_mb}
            for snapshot in STRATEGIES]


def _summary(rows: list[tuple], snapshot: bool, tp: int, repeats: int) -> dict[str, float]:
    syncs = [r for r in rows if r[0] == "sync" and r[1] == snapshot]
    # Per repeat, the sync is done when the slowest generator rank holds its region (staged); loading
    # it into the engine happens at the generator's next safe point and is what it stalls for.
    by_repeat = [syncs[i * tp:(i + 1) * tp] for i in range(repeats)]
    sync = statistics.median(max(r[2] for r in rep) for rep in by_repeat)
    stall = statistics.median(max(r[3] for r in rep) for rep in by_repeat)
    raw = statistics.median(max(r[4] for r in rep) for rep in by_repeat)
    packs = [r for r in rows if r[0] == "pack" and r[1] == snapshot]
    return {"strategy": "snapshot" if snapshot else "wait", "sync_s": sync, "raw_broadcast_s": raw,
            "ratio": sync / raw, "stall_s": stall, "stall_fraction": stall / sync,
            "pack_s": statistics.median(r[2] for r in packs), "held_s": statistics.median(r[3] for r in packs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet bench weight-sync", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, nargs="+", default=[200], help="synthetic model sizes (MiB)")
    parser.add_argument("--trainers", type=int, default=2, help="trainer ranks (Shard(0) layout)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the generator replica")
    parser.add_argument("--bucket-mb", type=int, default=64, help="weightSync.bucketMB")
    parser.add_argument("--repeats", type=int, default=5, help="alternating repeats (median reported)")
    parser.add_argument("--verify", action="store_true", help="weightSync.verify: every push checked by content")
    args = parser.parse_args(argv)
    print("| model MiB | trainers | gen TP | bucket MiB | strategy | DDMA sync s | raw broadcast s | ratio | "
          "pack s | shards held s | generator stall s | stall / sync |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.size_mb:
        for r in run(size, args.trainers, args.tp, args.bucket_mb, args.repeats, args.verify):
            print(f"| {r['size_mb']:.0f} | {r['trainers']} | {r['tp']} | {r['bucket_mb']} | {r['strategy']} | "
                  f"{r['sync_s']:.3f} | {r['raw_broadcast_s']:.3f} | {r['ratio']:.2f} | {r['pack_s']:.3f} | "
                  f"{r['held_s']:.3f} | {r['stall_s']:.3f} | {r['stall_fraction']:.1%} |", flush=True)
    return 0
