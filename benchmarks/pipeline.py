"""`rlfleet bench pipeline`: a pipeline-parallel trainer against FSDP2 alone over as many ranks, and one rank.

Each layout trains the same random-weight Llama (`--model-config`, SmolLM2's tokenizer) on the same batch of
arithmetic prompts with random completions, every rank a real `Trainer` in a process of its own over gloo (NCCL on
`--device cuda`), as in a job: `--ranks` ranks of FSDP2; `--ranks` ranks in `--stages` pipeline stages (FSDP2 within
each); one rank. Per layout: the median step time on rank 0, and per rank the peak memory of the steps (CPU: peak RSS
since the steps began, on top of what the loaded model held; CUDA: the allocator's peak) and the bytes of state it
holds (float32 weights, gradients and AdamW's two moments), the largest over the ranks. With `--rank-memory-gb`, a
column says whether each layout's largest rank fits that limit (what one rank's memory allows).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

from rlfleet.benchmarks.trainer import LlamaShape, arithmetic_batch, llama_shape, peak, random_llama, reset_peak

# About 255M parameters (1 GiB of float32 weights, 4 GiB with gradients and AdamW's moments): a model that, on this
# machine's 24 GiB, one rank holds but two ranks' halves hold in far less.
DEFAULT_SHAPE = LlamaShape(hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=2816, vocab=49152)


def layouts(ranks: int, stages: int) -> dict[str, dict]:
    """Each layout's `roles.trainer`."""
    return {f"fsdp x{ranks}": {"replicas": ranks},
            f"pipeline {stages} stages x{ranks // stages}": {"replicas": ranks, "pipelineParallel": stages},
            "one rank": {"replicas": 1}}


def _job(model_dir: str, trainer: dict, args: dict) -> dict:
    return {"metadata": {"name": "bench"}, "spec": {
        "model": {"type": "hf", "path": model_dir, "dtype": args["dtype"]},
        "algorithm": {"promptsPerStep": args["prompts"], "groupSize": args["group"], "learningRate": 1e-6},
        "roles": {"trainer": {**trainer, "resources": {"gpu": 1} if args["device"] == "cuda" else {}}},
        "training": {"microBatchTokens": args["micro_batch_tokens"]} if args["micro_batch_tokens"] else {},
    }}


def _rank(rank: int, job_json: dict, model_dir: str, port: int, args: dict, out_dir: str) -> None:
    """One trainer rank: `warmup` + `steps` steps of the batch; writes its times (rank 0), peak and state bytes."""
    import torch

    from rlfleet.workers.cli import exit_now
    from rlfleet.workers.plan import Endpoints, WorkerContext
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.worker import Trainer
    from rlfleet.workers.world import local_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(args["threads"])
    job = parse_job(job_json)
    ctx = WorkerContext(job=job, role="trainer", rank=rank, endpoints=Endpoints(""), grpc_port=0, metrics_port=0,
                        run_dir=out_dir, token="bench" * 8)
    trainer = Trainer(ctx, Path(model_dir))
    if rank > 0:
        baseline = reset_peak(trainer.device)
        trainer.follow()
    else:
        samples = arithmetic_batch(Path(model_dir), args["prompts"], args["group"], args["max_new_tokens"],
                                   trainer.lm.config.vocab_size)
        for step in range(args["warmup"]):
            trainer.train(samples, step)
        baseline, times = reset_peak(trainer.device), []
        for step in range(args["steps"]):
            start = time.perf_counter()
            trainer.train(samples, args["warmup"] + step)
            times.append(time.perf_counter() - start)
        Path(out_dir, "times.json").write_text(json.dumps(times))
    state = 4 * 4 * sum(local_shard(p).numel() for p in trainer.lm.parameters())  # weight, gradient, two moments
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"peak": peak(trainer.device) - baseline,
                                                              "state": state}))
    trainer.stop()
    exit_now(0)


def _measure(name: str, trainer: dict, model_dir: str, args: dict) -> dict:
    from rlfleet.workers.plan import free_port

    world = trainer["replicas"]
    out_dir = tempfile.mkdtemp(prefix="bench-pipeline-")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_rank, args=(rank, _job(model_dir, trainer, args), model_dir, port, args,
                                                 out_dir)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        return {"layout": name, "ranks": world, "error": f"exit codes {[proc.exitcode for proc in procs]}"}
    per_rank = [json.loads(Path(out_dir, f"rank-{rank}.json").read_text()) for rank in range(world)]
    return {"layout": name, "ranks": world, "seconds": statistics.median(json.loads(Path(out_dir, "times.json")
                                                                                     .read_text())),
            "peak_bytes": max(r["peak"] for r in per_rank), "state_bytes": max(r["state"] for r in per_rank),
            "peaks": [r["peak"] for r in per_rank]}


def markdown(rows: list[dict], title: str, limit_gb: float | None) -> str:
    lines = [title, "", "| layout | ranks | step | vs FSDP | largest rank's state | its peak in the steps |"
             + (f" fits {limit_gb:g} GiB |" if limit_gb else ""),
             "|---|---|---|---|---|---|" + ("---|" if limit_gb else "")]
    fsdp = next((row["seconds"] for row in rows if row["layout"].startswith("fsdp") and "seconds" in row), None)
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['layout']} | {row['ranks']} | {row['error']} | | | |")
            continue
        ratio = f"{row['seconds'] / fsdp:.2f}x" if fsdp else ""
        used = row["state_bytes"] + row["peak_bytes"]
        fits = (" yes |" if used <= limit_gb * 2**30 else " no |") if limit_gb else ""
        lines.append(f"| {row['layout']} | {row['ranks']} | {row['seconds']:.2f} s | {ratio} | "
                     f"{row['state_bytes'] / 2**30:.2f} GiB | {row['peak_bytes'] / 2**30:.2f} GiB |{fits}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", type=llama_shape, default=DEFAULT_SHAPE,
                        metavar=",".join(LlamaShape._fields).upper(), help="the random-weight Llama to train")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks of the FSDP and pipeline layouts")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (dividing --ranks)")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts in the batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="completion lengths are drawn from 1..this")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="training.microBatchTokens")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the median is shown)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="one GPU per rank on cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model.dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: the cores "
                                                                  "over --ranks, for every layout)")
    parser.add_argument("--rank-memory-gb", type=float, default=None, help="one rank's memory limit to check")
    parser.add_argument("--skip-one-rank", action="store_true", help="leave out the one-rank layout")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rlfleet.workers.models import default_cache_dir

    if args.ranks % args.stages:
        raise SystemExit(f"--stages {args.stages} must divide --ranks {args.ranks}")
    settings = vars(args) | {"threads": args.threads or max(1, (os.cpu_count() or 1) // args.ranks)}
    model_dir = str(random_llama(args.model_config, args.device, default_cache_dir()))
    chosen = {name: trainer for name, trainer in layouts(args.ranks, args.stages).items()
              if not (args.skip_one_rank and trainer["replicas"] == 1)}
    rows = [_measure(name, trainer, model_dir, settings) for name, trainer in chosen.items()]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(markdown(rows, f"{','.join(map(str, args.model_config))}, {args.prompts} prompts x {args.group} "
                         f"completions of 1..{args.max_new_tokens} tokens, {args.device}, {args.dtype}, "
                         f"{settings['threads']} threads a rank, median of {args.steps} steps after {args.warmup}; "
                         f"load average at the end {load}", args.rank_memory_gb))
    print(json.dumps({"rows": rows}))
    return 0
