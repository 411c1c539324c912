"""`rlfleet bench trainer`: one trainer step, today's reference path and the fast path side by side.

Each path, in each `--dtype`, runs in a fresh process (so each has its own peak memory) on the same batch:
`--prompts` prompts of the arithmetic task asked through the model's chat template, `--group` completions each,
completion lengths drawn (seeded) from 1..`--max-new-tokens`. Per path: the median step time, tokens per second
(prompt + completion tokens of the batch, no padding), the FLOPs the step executed (torch's FlopCounterMode, one
extra step), the FLOP/s they make against a plain matmul of the row's dtype measured in the same run on the same
device and threads (an MFU-style ratio), and the peak memory of the step (CPU: the process's peak RSS since the
step began; CUDA: the allocator's peak).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import random
import statistics
import time
from pathlib import Path

PATHS = {
    "today": {"passes": "reference"},
    "new": {"passes": "fast"},
    "new+lora": {"passes": "fast", "lora": True},
    "new+checkpointing": {"passes": "fast", "checkpointing": True},
}
MATMUL_SIZE = 2048


def _batch(model_dir: Path, prompts: int, group: int, max_new_tokens: int, vocab: int) -> list:
    from transformers import AutoTokenizer

    from rlfleet.workers.data.tasks import ArithmeticTask, render_prompt
    from rlfleet.workers.data.config import ArithmeticData

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = ArithmeticTask(ArithmeticData(max_operand=99, operations=["+", "-", "*"], template="chat"))
    rng, stream, samples = random.Random(0), task.train(0), []
    for _ in range(prompts):
        ids = render_prompt(next(stream), tokenizer, "chat")
        for _ in range(group):
            length = rng.randint(1, max_new_tokens)
            samples.append(_Sample(ids, [rng.randrange(vocab) for _ in range(length)],
                                   [-2.0 * rng.random() for _ in range(length)], rng.choice([-0.5, 0.5])))
    return samples


class _Sample:
    """A rollout as the trainer takes it (policy.Sample): one advantage for every token, no reference."""

    def __init__(self, prompt_ids, completion_ids, gen_logprobs, advantage):
        self.prompt_ids, self.completion_ids, self.gen_logprobs, self.advantage = (
            prompt_ids, completion_ids, gen_logprobs, advantage)
        self.ref_logprobs, self.token_advantages = [], []


def _path(name: str, args: dict, out) -> None:
    """Child process: load, warm up, time `steps` steps, count one step's FLOPs; put a result dict on `out`."""
    import torch
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from rlfleet.workers.trainer.config import Lora, Training
    from rlfleet.workers.trainer.policy import Passes, train_step
    from rlfleet.workers.trainer.shared_prompts import attention_for
    from rlfleet.workers.trainer.worker import prepare

    torch.set_num_threads(args["threads"])
    device, dtype = torch.device(args["device"]), getattr(torch, args["dtype"])
    path = PATHS[name]
    lm = AutoModelForCausalLM.from_pretrained(args["model_dir"], dtype=torch.float32,
                                              attn_implementation=attention_for(device, dtype)).to(device).train()
    # As a one-rank trainer runs it: FSDP2 over a world of one, computing in `dtype` from float32 master weights.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    training = Training(lora=Lora() if path.get("lora") else None, compile=args["compile"],
                        activation_checkpointing=bool(path.get("checkpointing")))
    model = prepare(lm, training, dtype, world_size=1)
    passes = Passes() if path["passes"] == "reference" else Passes(
        args["micro_batch_tokens"] or training.micro_batch_tokens, args["chunk_tokens"] or training.logprob_chunk_tokens)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-7, fused=True)
    samples = _batch(Path(args["model_dir"]), args["prompts"], args["group"], args["max_new_tokens"],
                     lm.config.vocab_size)

    def step() -> dict:
        return train_step(lm, optimizer, samples, temperature=0.8, top_p=1.0, grad_clip=1.0,
                          pad_id=lm.config.pad_token_id or 0, passes=passes)

    try:
        for _ in range(args["warmup"]):
            step()
    except torch.OutOfMemoryError:
        out.put({"path": name, "error": "out of memory"})
        return
    baseline = _reset_peak(device)
    times = []
    for _ in range(args["steps"]):
        _sync(device)
        start = time.perf_counter()
        loss = step()["loss"]
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = _peak(device) - baseline
    counter = FlopCounterMode(display=False)
    # The math attention kernel: FlopCounterMode cannot size the fused kernels' grouped-query (GQA) calls.
    with counter, sdpa_kernel(SDPBackend.MATH):
        step()
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    out.put({"path": name, "seconds": statistics.median(times), "tokens": tokens, "flops": counter.get_total_flops(),
             "peak_bytes": peak, "loss": loss})


def _matmul(args: dict, out) -> None:
    """Child process: FLOP/s of a plain square matmul in the benchmark's dtype, threads and device."""
    import torch

    torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    dtype = getattr(torch, args["dtype"])
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    repeats, times = 10, []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        _sync(device)
        times.append((time.perf_counter() - start) / repeats)
    out.put({"path": "matmul", "flops_per_second": 2 * MATMUL_SIZE**3 / statistics.median(times)})


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> int:
    """Start a new peak; returns what is in use now."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    return _status_kib("VmHWM") * 1024


def _peak(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _in_child(target, *args) -> dict:
    """`target(*args, queue)` in a fresh process; its result, or why there is none (a child that ran out of
    memory, say, which is a result of its own: the reference path's logits may not fit)."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=target, args=(*args, out))
    process.start()
    while True:
        try:
            result = out.get(timeout=1.0)
            break
        except queue.Empty:
            if not process.is_alive():
                result = {"path": args[0], "error": f"exited with code {process.exitcode}"}
                break
    process.join()
    return result


def markdown(rows: list[dict], matmuls: dict[str, float], settings: str) -> str:
    """The table; `matmuls` the plain matmul's FLOP/s by dtype. Speed-ups are over the first row that ran."""
    rates = ", ".join(f"{dtype} {rate / 1e9:,.1f}" for dtype, rate in matmuls.items())
    lines = [f"Settings: {settings}", "", f"Plain {MATMUL_SIZE}x{MATMUL_SIZE} matmul, GFLOP/s: {rates}", "",
             "| path | dtype | step s | tokens/s | GFLOP per step | achieved GFLOP/s | vs matmul | peak memory MiB | "
             "loss |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['path']} | {row['dtype']} | {row['error']} | | | | | | |")
            continue
        rate = row["flops"] / row["seconds"]
        lines.append(f"| {row['path']} | {row['dtype']} | {row['seconds']:.3f} | {row['tokens'] / row['seconds']:,.0f} | "
                     f"{row['flops'] / 1e9:,.1f} | {rate / 1e9:,.1f} | {rate / matmuls[row['dtype']]:.0%} | "
                     f"{row['peak_bytes'] / 2**20:,.0f} | {row['loss']:.6f} |")
    ran = [row for row in rows if "error" not in row]
    if len(ran) > 1:
        first = ran[0]
        lines += [""] + [f"Speed-up of {r['path']} {r['dtype']} over {first['path']} {first['dtype']}: "
                         f"{first['seconds'] / r['seconds']:.2f}x" for r in ran[1:]]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2", help="model to train")
    parser.add_argument("--model-dir", default=None, help="an HF model directory to train instead of --model")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["today", "new"], help="paths to time")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts in the batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="completion lengths are drawn from 1..this")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per path (the median is shown)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                        help="dtypes the step computes in (from float32 master weights, as the trainer), each path "
                             "in each, and of the matmul")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of each process")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (training.compile)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="fast path (default: the spec's)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="fast path (default: the spec's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.models.config import SmolLM2Model, TinyModel

    spec = SmolLM2Model() if args.model == "smollm2" else TinyModel(hidden_size=128, num_heads=4)
    settings = vars(args) | {"model_dir": args.model_dir or str(materialize(spec, default_cache_dir()))}
    matmuls = {dtype: _in_child(_matmul, settings | {"dtype": dtype})["flops_per_second"] for dtype in args.dtype}
    rows = [_in_child(_path, name, settings | {"dtype": dtype}) | {"dtype": dtype}
            for dtype in args.dtype for name in args.paths]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(markdown(rows, matmuls, f"{args.model_dir or args.model}, {args.prompts} prompts x {args.group} completions "
                                  f"of 1...{args.max_new_tokens} tokens, {args.device}, {args.threads} threads, "
                                  f"{'compiled layers, ' if args.compile else ''}"
                                  f"median of {args.steps} steps after {args.warmup}; load average at the end {load}"))
    print(json.dumps({"matmul_flops_per_second": matmuls, "rows": rows}))
    return 0
