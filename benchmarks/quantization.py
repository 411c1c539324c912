"""`rlfleet bench quantization`: quantized generation against the model's own dtype, on the same prompts.

For each method (`roles.generator.quantization`, `kv-fp8` for kvCacheDtype fp8), a fresh vLLM engine (in its own
process, in-process engine) samples `--group` completions of each of `--prompts` arithmetic prompts (chat template,
temperature 1, the job's seed), twice: the second pass is timed (generated tokens per second). Then the trainer, as a
job of that dtype loads it on CPU generators (float32 master weights, FSDP2 over a world of one, vLLM's roundings),
computes log pi of every sampled token at the same weights: `logprob_gap` is the mean |log pi - log mu| a token, the
train/inference mismatch a method adds, which the loss's importance weights then correct.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rlfleet.benchmarks.trainer import in_child

METHODS = ("none", "int8", "fp8_per_channel", "kv-fp8")


def _generator(method: str) -> dict:
    return {"kvCacheDtype": "fp8"} if method == "kv-fp8" else {"quantization": method}


def _prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rlfleet.workers.data.config import ArithmeticData
    from rlfleet.workers.data.tasks import ArithmeticTask, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stream = ArithmeticTask(ArithmeticData(max_operand=99, template="chat")).train(0)
    return [render_prompt(next(stream), tokenizer, "chat") for _ in range(count)]


def _generate(method: str, args: dict, out) -> None:
    """Child process: one engine of `method`; its timed pass's rate and samples."""
    import time

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from rlfleet.workers.engines import create_engine
    from rlfleet.workers.engines.base import Sampling, SequenceIn
    from rlfleet.workers.spec import parse_job

    job = parse_job({"metadata": {"name": "bench"}, "spec": {
        "model": {"type": "smollm2", "dtype": args["dtype"]}, "generation": {"maxNewTokens": args["max_new_tokens"]},
        "roles": {"generator": {"engine": "vllm", "kvCacheMB": 256, **_generator(method)}}}})
    engine = create_engine(job, Path(args["model_dir"]))
    sequences = [SequenceIn(ids, []) for ids in _prompts(args["model_dir"], args["prompts"]) for _ in range(args["group"])]
    sampling = Sampling(max_tokens=args["max_new_tokens"], temperature=1.0, top_p=1.0, seed=0)
    engine.generate(sequences, sampling)  # warm-up
    start = time.perf_counter()
    segments = engine.generate(sequences, sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for s in segments)
    out.put({"tokens_per_second": tokens / seconds, "tokens": tokens,
             "samples": [(seq.prompt_ids, seg.token_ids, seg.logprobs) for seq, seg in zip(sequences, segments)]})


def _gap(samples: list, args: dict, out) -> None:
    """Child process: the trainer's mean |log pi - log mu| over `samples` at the engine's weights."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlfleet.workers.models.forward import align_forward
    from rlfleet.workers.trainer.config import Training
    from rlfleet.workers.trainer.policy import Passes, train_step
    from rlfleet.workers.trainer.sample import Sample
    from rlfleet.workers.trainer.shared_prompts import ATTENTION
    from rlfleet.workers.trainer.worker import prepare

    lm = AutoModelForCausalLM.from_pretrained(args["model_dir"], dtype=torch.float32, attn_implementation=ATTENTION)
    align_forward(lm, generators_on_gpu=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    prepare(lm, Training(), getattr(torch, args["dtype"]), world_size=1)
    batch = [Sample(prompt, tokens, logprobs, [True] * len(tokens), [True] * len(tokens), [], 1.0, [])
             for prompt, tokens, logprobs in samples if tokens]
    metrics = train_step(lm, torch.optim.SGD(lm.parameters(), lr=0.0), batch, temperature=1.0, top_p=1.0,
                         grad_clip=1.0, pad_id=0, passes=Passes(chunk_tokens=256))
    out.put({"logprob_gap": metrics["logprob_gap"]})


def _row(method: str, args: dict) -> dict:
    generated = in_child(_generate, method, args)
    if "error" in generated:
        return {"method": method, **generated}
    return {"method": method, "tokens_per_second": generated["tokens_per_second"], "tokens": generated["tokens"],
            **in_child(_gap, generated["samples"], args)}


def markdown(rows: list[dict], title: str) -> str:
    base = next((row["tokens_per_second"] for row in rows if row["method"] == "none" and "error" not in row), None)
    lines = [title, "", "| method | tokens/s | vs none | logprob_gap (nats a token) |", "|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['method']} | {row['error'][:120]} | | |")
            continue
        ratio = f"{row['tokens_per_second'] / base:.2f}x" if base else ""
        lines.append(f"| {row['method']} | {row['tokens_per_second']:,.0f} | {ratio} | {row['logprob_gap']:.4f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench quantization", description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="what to compare")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="model.dtype (fp8 methods need bfloat16)")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per completion at most")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.models.config import SmolLM2Model

    settings = vars(args) | {"model_dir": str(materialize(SmolLM2Model(), default_cache_dir()))}
    rows = [_row(method, settings) for method in args.methods]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(markdown(rows, f"SmolLM2-135M-Instruct, {args.dtype}, {args.prompts} prompts x {args.group} completions of "
                         f"up to {args.max_new_tokens} tokens, temperature 1; load average at the end {load}"))
    print(json.dumps({"rows": rows}))
    return 0
