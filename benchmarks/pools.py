"""`rlfleet bench pools`: two generator replicas of unequal speed, with a batch split by throughput or not.

The job (the tiny example by default) runs three ways, interleaved over `--repeats` rounds: (a) one generator replica, the fast one,
alone; (b) two, the second throttled (RLFLEET_GENERATOR_THROTTLE: it sleeps `--throttle` seconds per generated
token, as a slower GPU would take), each batch handed out whole (RLFLEET_WHOLE_BATCHES), as before batches were
split; (c) the same two, each batch split by the replicas' measured throughput (controller/dispatch.py). From the
steps after the warm-up it takes the mean step time (from the records' times: a straggler's steps count in full),
the mean tokens of a step and share of each replica, and the median of each replica's measured rate (metrics.jsonl
`generator_throughput/<replica>`, tokens a second of Generate time).

Generation bound, a step of (c) takes the step's tokens over the two rates together: the prediction
`tokens / (rate_fast + rate_slow)`, next to which it prints the achieved step time and their ratio (the target is
within 10%), and the same for (a) with the fast rate alone; and the issue's form, the fast replica alone's step time
times `rate_fast / (rate_fast + rate_slow)` (its share of the work once the slow one takes its own). A job whose training is the longer part of a step
(maxStaleness >= 1 overlaps the two) or whose weight pushes are is bound by those instead, whatever the split:
`--max-new-tokens` and `--throttle` make generation the longer part.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlfleet.benchmarks.async_speedup import DEFAULT_JOB, run_once, with_settings
from rlfleet.workers.controller.dispatch import WHOLE_BATCHES_ENV
from rlfleet.workers.generator.server import THROTTLE_ENV

# name: (generator replicas, whole batches)
VARIANTS = {"fast alone": (1, False), "whole batches": (2, True), "split by throughput": (2, False)}


def with_generators(job: Any, replicas: int, engine: str | None) -> Any:
    """The job with this many generator replicas (and that engine, if given), validated like any job."""
    from rlfleet.workers.spec import parse_job

    data = job.to_dict()
    generator = data["spec"]["roles"]["generator"]
    generator["replicas"] = replicas
    if engine:
        generator["engine"] = engine
    return parse_job(data)


def summarize(records: list[dict[str, Any]], warmup: int, replicas: int) -> dict[str, float]:
    """Over the steps after the first `warmup`: the mean step time (a straggler's steps count in full), the mean
    tokens of a step and each replica's mean share, the median of each replica's rate; the rates' prediction."""
    kept = records[warmup:]
    if warmup < 1 or not kept:
        raise ValueError(f"need a warm-up step and a step after it (got {len(records)} steps, warm-up {warmup})")

    def mean(field: str) -> float:
        return statistics.fmean(float(r.get(field, 0.0)) for r in kept)

    found = {"step": (kept[-1]["time"] - records[warmup - 1]["time"]) / len(kept), "tokens": mean("tokens_generated")}
    for replica in range(replicas):
        found[f"rate{replica}"] = statistics.median(float(r.get(f"generator_throughput/{replica}", 0.0)) for r in kept)
        found[f"share{replica}"] = mean(f"generator_share/{replica}")
    found["predicted"] = found["tokens"] / sum(found[f"rate{r}"] for r in range(replicas))
    return found


def markdown(results: dict[str, dict[str, float]], settings: str) -> str:
    """One row a run. Predictions of a step: the step's tokens over the summed rates (generation bound), and the
    fast replica alone's step time times the fast replica's share of the summed rates."""
    lines = [f"Settings: {settings}", "",
             "| run | step s | tokens / step | rate fast tok/s | rate slow tok/s | share slow | tokens / rates s | "
             "achieved / that | fast alone x its share s | achieved / that |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    alone = results["fast alone"]["step"]
    for name, r in results.items():
        fast_share = r["rate0"] / (r["rate0"] + r.get("rate1", 0.0))
        slow = f"{r['rate1']:.0f} | {r['share1']:.2f}" if "rate1" in r else "- | -"
        lines.append(f"| {name} | {r['step']:.3f} | {r['tokens']:.0f} | {r['rate0']:.0f} | {slow} | "
                     f"{r['predicted']:.3f} | {r['step'] / r['predicted']:.2f} | {alone * fast_share:.3f} | "
                     f"{r['step'] / (alone * fast_share):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.steps <= args.warmup or args.warmup < 1 or args.throttle < 0 or args.repeats < 1:
        raise SystemExit("need --steps > --warmup >= 1, --throttle >= 0 and --repeats >= 1")
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.spec import load_job

    job = load_job(args.job)
    materialize(job.spec.model, default_cache_dir())
    chosen = [name for name in VARIANTS if name == "fast alone" or name in (args.only or VARIANTS)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-pools-") as temp:
        root = Path(args.keep or temp)
        started = time.perf_counter()
        for repeat in range(args.repeats):  # A B C A B C ...
            for name in chosen:
                replicas, whole = VARIANTS[name]
                run_job = with_settings(with_generators(job, replicas, args.engine), args.staleness, args.steps,
                                        args.max_new_tokens)
                env = {THROTTLE_ENV: f"1={args.throttle}"} | ({WHOLE_BATCHES_ENV: "1"} if whole else {})
                records = run_once(run_job, root / f"r{repeat}-{name.replace(' ', '-')}", env)
                runs[name].append(summarize(records, args.warmup, replicas))
                print(f"repeat {repeat} {name}: mean step {runs[name][-1]['step']:.3f} s", flush=True)
        wall = time.perf_counter() - started
    results = {name: {field: statistics.median(run[field] for run in found) for field in found[0]}
               for name, found in runs.items()}
    tokens = args.max_new_tokens or job.spec.generation.max_new_tokens
    engine = args.engine or job.spec.roles.generator.engine
    settings = (f"`{Path(args.job).name}`, engine {engine}, maxNewTokens {tokens}, maxStaleness "
                f"{args.staleness}, slow replica throttled {args.throttle} s a token, {args.steps} steps per run "
                f"({args.warmup} warm-up steps dropped), {args.repeats} interleaved rounds (medians), {wall:.0f} s wall")
    print(markdown(results, settings))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench pools", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(DEFAULT_JOB), help="RLJob YAML (default: the tiny example)")
    parser.add_argument("--steps", type=int, default=20, help="trainer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the runs, interleaved A B C A B C")
    parser.add_argument("--staleness", type=int, default=1, help="maxStaleness of every run")
    parser.add_argument("--throttle", type=float, default=0.002,
                        help="seconds the slow replica sleeps per generated token")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion length (default: the job's)")
    parser.add_argument("--engine", choices=["vllm", "torch"], default=None, help="generator engine (default: "
                        "the job's)")
    parser.add_argument("--only", choices=sorted(VARIANTS), action="append", default=None,
                        help="run only these (repeatable; 'fast alone' is always run: the others are compared to it)")
    parser.add_argument("--keep", default=None, help="keep the run directories here (default: a temp dir)")
    return parser
