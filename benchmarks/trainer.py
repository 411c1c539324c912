"""`rlfleet bench trainer`: one trainer step, today's reference path and the fast path side by side.

Each path, in each `--dtype`, runs in a fresh process (so each has its own peak memory) on the same batch:
`--prompts` prompts of the arithmetic task asked through the model's chat template, `--group` completions each,
completion lengths drawn (seeded) from 1..`--max-new-tokens`, every token sampled and trained. Per path: the median
step time, tokens per second (prompt + completion tokens of every sample, no padding), the FLOPs the step executed
(torch's FlopCounterMode, one extra step; unknown where that step ran out of memory) and the FLOP/s they make
against a plain matmul of the row's dtype measured in the same run on the same device and threads, the model's
FLOPs (`model_flops`: the work the step needs, no padding, no recomputation, each distinct prompt once) and the
MFU they make against that matmul, and the peak memory of the step (CPU: the process's peak RSS since the step
began; CUDA: the allocator's peak, over what the model and optimizer held before it), whole and per token.
A path that runs out of memory is a row saying so.
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
from typing import NamedTuple

PATHS = {
    "today": {"passes": "reference"},
    "new": {"passes": "fast"},
    "new+lora": {"passes": "fast", "lora": True},
    "new+checkpointing": {"passes": "fast", "checkpointing": True},
}
# The matmul whose rate is the peak, by device type: 8192 fills a GPU; on the 2-core CPU 2048 reached the rate of
# 4096 (within the noise of a shared machine) in an eighth of the time.
MATMUL_SIZES = {"cpu": 2048, "cuda": 8192}


class LlamaShape(NamedTuple):
    """A random-weight Llama with SmolLM2's tokenizer (`--model-config`), embeddings tied as SmolLM2's are."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


# The 1.07B model of issue 28 (Llama 3.2 1B's shape with SmolLM2's vocabulary): 6N with the output layer is
# 6 x 1.07e9 FLOPs per token.
LLAMA_1B = LlamaShape(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=49152)


def arithmetic_batch(model_dir: Path, prompts: int, group: int, max_new_tokens: int, vocab: int) -> list:
    from transformers import AutoTokenizer

    from rlfleet.workers.data.tasks import ArithmeticTask, render_prompt
    from rlfleet.workers.data.config import ArithmeticData
    from rlfleet.workers.trainer.sample import Sample

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = ArithmeticTask(ArithmeticData(max_operand=99, operations=["+", "-", "*"], template="chat"))
    rng, stream, samples = random.Random(0), task.train(0), []
    for _ in range(prompts):
        ids = render_prompt(next(stream), tokenizer, "chat")
        for _ in range(group):
            length = rng.randint(1, max_new_tokens)
            samples.append(Sample(ids, [rng.randrange(vocab) for _ in range(length)],
                                  [-2.0 * rng.random() for _ in range(length)], sampled=[True] * length,
                                  trained=[True] * length, ref_logprobs=[], advantage=rng.choice([-0.5, 0.5]),
                                  token_advantages=[]))
    return samples


def linear_flops(module) -> int:
    """FLOPs of one token through `module`'s linear layers, forward and backward: 2 per weight for the forward, 2
    for the input's gradient and 2 for the weight's gradient where it trains (6 per weight in a full fine-tune;
    a LoRA step's frozen weights take 4, its adapters 6)."""
    from torch import nn

    return sum(2 * m.weight.numel() * (3 if m.weight.requires_grad else 2)
               for m in module.modules() if isinstance(m, nn.Linear))


def model_flops(lm, samples) -> int:
    """The FLOPs a training step of `samples` needs, forward and backward: no padding, no recomputation.

    Matmuls: each distinct prompt's tokens run through the decoder once, and each sample's completion tokens but
    its last (a target only); the output layer (a matmul, even with tied embeddings; the input embedding is a
    lookup) runs once per trained completion token, from the position that predicts it. Attention's scores and
    weighted values: 4 x layers x heads x head_dim FLOPs per query per key it attends to (a position t attends to
    t + 1 keys), its backward twice its forward.
    """
    config = lm.config
    prompts = {tuple(s.prompt_ids) for s in samples}
    positions = sum(map(len, prompts)) + sum(max(0, len(s.completion_ids) - 1) for s in samples)
    predicted = sum(sum(s.trained) for s in samples)
    # Prompt positions 0..p-1 attend to 1..p keys; completion positions p..p+c-2 to p+1..p+c-1.
    keys = sum(len(p) * (len(p) + 1) // 2 for p in prompts) + sum(
        max(0, c - 1) * (2 * p + c) // 2 for p, c in ((len(s.prompt_ids), len(s.completion_ids)) for s in samples))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 3 * 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * keys
    return linear_flops(lm.model) * positions + linear_flops(lm.lm_head) * predicted + attention


def _path(name: str, args: dict, out) -> None:
    """`_timed_path` as a one-rank trainer runs it: FSDP2 over a world of one (trainer/worker.py prepare)."""
    import torch.distributed as dist

    backend = "nccl" if args["device"].startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        _timed_path(name, args, out)
    finally:
        dist.destroy_process_group()


def _timed_path(name: str, args: dict, out) -> None:
    """Child process: load, warm up, time `steps` steps, count one step's FLOPs; puts the timed result on `out`,
    then the count (a count that runs out of memory leaves the row without it)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from rlfleet.workers.models.forward import align_forward
    from rlfleet.workers.trainer.config import Lora, Training
    from rlfleet.workers.trainer.policy import Passes, train_step
    from rlfleet.workers.trainer.shared_prompts import ATTENTION
    from rlfleet.workers.trainer.worker import micro_batch_budget, prepare

    torch.set_num_threads(args["threads"])
    device, dtype = torch.device(args["device"]), getattr(torch, args["dtype"])
    path = PATHS[name]
    lm = AutoModelForCausalLM.from_pretrained(args["model_dir"], dtype=torch.float32,
                                              attn_implementation=ATTENTION).to(device).train()
    align_forward(lm, generators_on_gpu=device.type == "cuda")  # as the trainer of generators on this device
    training = Training(lora=Lora() if path.get("lora") else None, compile=args["compile"],
                        activation_checkpointing=bool(path.get("checkpointing")))
    model = prepare(lm, training, dtype, world_size=1)
    # Unset, the micro-batch budget comes from free memory, as the trainer's does.
    passes = Passes() if path["passes"] == "reference" else Passes(
        args["micro_batch_tokens"] or micro_batch_budget(lm, dtype, training, device),
        args["chunk_tokens"] or training.logprob_chunk_tokens)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-7, fused=True)
    samples = arithmetic_batch(Path(args["model_dir"]), args["prompts"], args["group"], args["max_new_tokens"],
                     lm.config.vocab_size)

    def step() -> dict:
        return train_step(lm, optimizer, samples, temperature=0.8, top_p=1.0, grad_clip=1.0,
                          pad_id=lm.config.pad_token_id or 0, passes=passes)

    baseline, times = reset_peak(device), []
    try:
        for _ in range(args["warmup"]):
            step()
        baseline = reset_peak(device)
        for _ in range(args["steps"]):
            _sync(device)
            start = time.perf_counter()
            loss = step()["loss"]
            _sync(device)
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        out.put({"error": f"out of memory at {(peak(device) - baseline) / 2**30:,.1f} GiB"})
        return
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    out.put({"seconds": statistics.median(times), "tokens": tokens, "model_flops": model_flops(lm, samples),
             "peak_bytes": peak(device) - baseline, "loss": loss})
    if args["profile"]:
        _profile(step, device, Path(args["profile"]) / f"{name}-{args['dtype']}")
    counter = FlopCounterMode(display=False)
    try:
        # The math attention kernel: FlopCounterMode cannot size the fused kernels' grouped-query (GQA) calls. It
        # materialises the scores, so a long batch may not fit where the timed steps did. (Custom attention ops
        # such as torch.nn.attention.varlen's register their own FLOP formulas and are counted as they run.)
        with counter, sdpa_kernel(SDPBackend.MATH):
            step()
    except torch.OutOfMemoryError:
        out.put({"flops": None, "flops_error": "out of memory"})
        return
    out.put({"flops": counter.get_total_flops()})


def _profile(step, device, stem: Path) -> None:
    """One more step under torch's profiler: its trace (Chrome's format, gzipped: chrome://tracing, Perfetto) and a
    table of the operators by their own device time (after `device_busy`'s line), at `stem`.json.gz and `stem`.txt."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        _sync(device)
    stem.parent.mkdir(parents=True, exist_ok=True)
    trace = stem.with_suffix(".json")
    prof.export_chrome_trace(str(trace))
    text = trace.read_bytes()
    Path(f"{stem}.json.gz").write_bytes(gzip.compress(text))
    trace.unlink()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=60)
    Path(f"{stem}.txt").write_text(device_busy(json.loads(text)["traceEvents"]) + "\n" + table)


DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_busy(events: list[dict]) -> str:
    """How much of a profiled step the device worked: the union of its kernels' and copies' intervals over the span
    from the first to the last (a step waiting on the host shows as a low share)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in DEVICE_EVENTS)
    if not spans:
        return "No device kernels in the trace (a CPU step)."
    busy, reached = 0.0, spans[0][0]
    for start, end in spans:
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    span = reached - spans[0][0]
    return f"Device busy {busy / 1e3:,.1f} ms of the {span / 1e3:,.1f} ms from its first kernel to its last " \
           f"({busy / span:.0%}), {len(spans)} kernels and copies."


def _matmul(args: dict, out) -> None:
    """Child process: FLOP/s of a plain square matmul in the benchmark's dtype, threads and device."""
    import torch

    torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    dtype, size = getattr(torch, args["dtype"]), MATMUL_SIZES[device.type]
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
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
    out.put({"flops_per_second": 2 * size**3 / statistics.median(times)})


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> int:
    """Start a new peak; returns what is in use now."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    return _status_kib("VmHWM") * 1024


def peak(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def in_child(target, *args) -> dict:
    """`target(*args, queue)` in a fresh process; the union of the dicts it put on the queue, or why there is none
    (a child that ran out of memory, say, which is a result of its own: the reference path's logits may not fit).
    A child killed after its first part (the kernel's OOM killer in the FLOP count) keeps that part."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=target, args=(*args, out))
    process.start()
    result = {}
    while True:
        try:
            result |= out.get(timeout=1.0)
        except queue.Empty:
            if not process.is_alive():
                break
    process.join()
    if not result:
        return {"error": f"exited with code {process.exitcode}"}
    if "seconds" in result and "flops" not in result:
        result |= {"flops": None, "flops_error": f"exited with code {process.exitcode}"}
    return result


def with_mfu(row: dict, matmul: float) -> dict:
    """The row with `mfu` (model FLOPs per second over the matmul's rate `matmul`) and `peak_bytes_per_token`."""
    if "error" in row:
        return row
    return row | {"mfu": row["model_flops"] / row["seconds"] / matmul,
                  "peak_bytes_per_token": row["peak_bytes"] / row["tokens"]}


def markdown(rows: list[dict], matmuls: dict[str, float], settings: str, size: int) -> str:
    """The table of rows (with_mfu's); `matmuls` the plain `size`-square matmul's FLOP/s by dtype. Speed-ups are
    over the first row that ran."""
    rates = ", ".join(f"{dtype} {rate / 1e9:,.1f}" for dtype, rate in matmuls.items())
    lines = [f"Settings: {settings}", "", f"Plain {size}x{size} matmul, GFLOP/s: {rates}", "",
             "| path | dtype | step s | tokens/s | executed GFLOP | executed GFLOP/s | vs matmul | executed / model | "
             "model GFLOP | MFU | peak memory MiB | peak KiB per token | loss |", "|" + "---|" * 13]
    notes = []
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['path']} | {row['dtype']} | {row['error']} |" + " |" * 10)
            continue
        lines.append(f"| {row['path']} | {row['dtype']} | {row['seconds']:.3f} | {row['tokens'] / row['seconds']:,.0f} "
                     f"| {_executed(row, matmuls[row['dtype']])} | {row['model_flops'] / 1e9:,.1f} "
                     f"| {row['mfu']:.0%} | "
                     f"{row['peak_bytes'] / 2**20:,.0f} | {row['peak_bytes_per_token'] / 2**10:,.1f} | "
                     f"{row['loss']:.6f} |")
        if row["flops"] is None:
            notes.append(f"Executed FLOPs of {row['path']} {row['dtype']} unknown: the count {row['flops_error']}.")
    ran = [row for row in rows if "error" not in row]
    if len(ran) > 1:
        first = ran[0]
        notes += [f"Speed-up of {r['path']} {r['dtype']} over {first['path']} {first['dtype']}: "
                  f"{first['seconds'] / r['seconds']:.2f}x" for r in ran[1:]]
    return "\n".join(lines + [""] * bool(notes) + notes)


def _executed(row: dict, matmul: float) -> str:
    """The executed FLOPs' cells: GFLOP, GFLOP/s, against the matmul, against the model FLOPs."""
    if row["flops"] is None:
        return "? | ? | ? | ?"
    rate = row["flops"] / row["seconds"]
    return (f"{row['flops'] / 1e9:,.1f} | {rate / 1e9:,.1f} | {rate / matmul:.0%} | "
            f"{row['flops'] / row['model_flops']:.2f}")


def llama_shape(text: str) -> LlamaShape:
    try:
        shape = LlamaShape(*(int(part) for part in text.split(",")))
    except (TypeError, ValueError):
        shape = None
    if shape is None or min(shape) < 1 or shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give {','.join(LlamaShape._fields).upper()}, six positive integers, HIDDEN a multiple of "
            f"HEADS and HEADS of KV_HEADS (llama1b is {','.join(map(str, LLAMA_1B))})")
    return shape


def _device(text: str) -> str:
    if text.split(":")[0] not in MATMUL_SIZES:
        raise argparse.ArgumentTypeError(f"{text!r}: give cpu, cuda or cuda:N")
    return text


def random_llama(shape: LlamaShape, device: str, cache_dir: Path) -> Path:
    """A HF directory of a random-weight Llama of `shape` with SmolLM2's tokenizer, built once per cache (in a child
    process on `device`, so that a GPU run needs no weights to travel and this process holds no GPU memory)."""
    from transformers import AutoTokenizer

    from rlfleet.workers.models import materialize
    from rlfleet.workers.models.config import SmolLM2Model

    tokenizer_dir = materialize(SmolLM2Model(), cache_dir)
    tokens = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    if shape.vocab < tokens:
        raise SystemExit(f"--model-config: VOCAB {shape.vocab} is below the {tokens} tokens of SmolLM2's tokenizer")
    target = cache_dir / ("bench-llama-" + "-".join(map(str, shape)))
    built = in_child(_build_llama, str(target), shape, device, str(tokenizer_dir))
    if "error" in built:
        raise SystemExit(f"building {target} on {device} failed: {built['error']}")
    return target


def _build_llama(target: str, shape: LlamaShape, device: str, tokenizer_dir: str, out) -> None:
    """Child process: random_llama's build (float32 weights, seeded)."""
    from rlfleet.workers.storage.cache import build_once

    build_once(Path(target), lambda directory: _write_llama(shape, device, Path(tokenizer_dir), directory))
    out.put({"model_dir": target})


def _write_llama(shape: LlamaShape, device: str, tokenizer_dir: Path, directory: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         intermediate_size=shape.intermediate, max_position_embeddings=65536,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, dtype="float32")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to("cpu").save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny", "llama1b"], default="smollm2",
                        help="model to train: llama1b is a random-weight 1.07B Llama (--model-config "
                             f"{','.join(map(str, LLAMA_1B))}), built once on --device")
    parser.add_argument("--model-config", type=llama_shape, default=None,
                        metavar=",".join(LlamaShape._fields).upper(),
                        help="train a random-weight Llama of this shape with SmolLM2's tokenizer instead of --model")
    parser.add_argument("--model-dir", default=None, help="an HF model directory to train instead of --model")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["today", "new"], help="paths to time")
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts in the batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="completion lengths are drawn from 1..this")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per path (the median is shown)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                        help="dtypes the step computes in (from float32 master weights, as the trainer), each path "
                             "in each, and of the matmul")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of each process")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (training.compile)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="fast path (default: from free memory, as the trainer)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="fast path (default: the spec's)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="profile one more step of each row: DIR/PATH-DTYPE.json.gz (a trace for Perfetto or "
                             "chrome://tracing) and .txt (how busy the GPU was, operators by their own time)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    size = MATMUL_SIZES[args.device.split(":")[0]]
    settings = vars(args) | {"model_dir": str(model_dir(args))}
    matmuls = {dtype: in_child(_matmul, settings | {"dtype": dtype})["flops_per_second"] for dtype in args.dtype}
    rows = [with_mfu({"path": name, "dtype": dtype} | in_child(_path, name, settings | {"dtype": dtype}),
                     matmuls[dtype]) for dtype in args.dtype for name in args.paths]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    model = args.model_dir or (",".join(map(str, args.model_config)) if args.model_config else args.model)
    print(markdown(rows, matmuls, f"{model}, {args.prompts} prompts x {args.group} completions "
                                  f"of 1...{args.max_new_tokens} tokens, {args.device}, {args.threads} threads, "
                                  f"{'compiled layers, ' if args.compile else ''}median of {args.steps} steps after "
                                  f"{args.warmup}; load average at the end {load}",
                   size))
    print(json.dumps({"matmul_size": size, "matmul_flops_per_second": matmuls, "rows": rows}))
    return 0


def model_dir(args: argparse.Namespace) -> Path:
    """The HF directory to train: --model-dir, else a random Llama of --model-config (or llama1b), else --model."""
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.models.config import SmolLM2Model, TinyModel

    if args.model_dir:
        return Path(args.model_dir)
    if args.model_config or args.model == "llama1b":
        return random_llama(args.model_config or LLAMA_1B, args.device, default_cache_dir())
    spec = SmolLM2Model() if args.model == "smollm2" else TinyModel(hidden_size=128, num_heads=4)
    return materialize(spec, default_cache_dir())
