"""`rlfleet bench async`: the same job synchronously (maxStaleness 0) and asynchronously, interleaved.

Each repeat runs the job twice with `run_local` (A = sync, B = async, A B A B ...), drops the warm-up
steps, and takes medians from metrics.jsonl. The ideal speed-up of overlapping generation and training
is `(Tg + Tt) / max(Tg, Tt)`, with Tg the generator busy seconds per step (engine generate time) and Tt
the trainer busy seconds per step (step time minus waiting for rollouts: train plus packing the weight
push), both taken from the synchronous runs.

With `--sync-strategies` it instead runs the asynchronous job with each way of keeping a weight push
whole (DESIGN §2), interleaved: *wait* (the trainer waits for sends still reading its live shards before
its optimizer step) and *snapshot* (large blocks are copied before they are sent), and reports both.
`--model` replaces the job's model (JSON), e.g. with one large enough to have direct blocks (>= 1 MiB of
whole rows per trainer rank), without which the two strategies do the same thing.

That ideal assumes the two roles run on separate devices. On one CPU machine they do not: with
`--cores split` (the default) every worker gets one OpenMP thread and vLLM binds its thread to core 0,
so the generator and the trainer each have about one core, like two devices; `--cores shared` lets
both use every core, and then overlapping them mostly trades one role's speed for the other's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "tiny-local.yaml"
# One thread per worker, the generator's bound to core 0: the trainer gets the other core.
SPLIT_CORES_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
FIELDS = ("step_seconds", "generator_busy_seconds", "trainer_busy_seconds", "train_seconds", "sync_pack_seconds",
          "sync_wait_seconds")
# weightSync.snapshot of each strategy's runs.
STRATEGIES = {"wait": False, "snapshot": True}


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Median of each timing field over the steps after the first `warmup` ones."""
    kept = records[warmup:]
    if not kept:
        raise ValueError(f"no steps left after {warmup} warm-up steps (got {len(records)})")
    return {f: statistics.median(float(r.get(f, 0.0)) for r in kept) for f in FIELDS} | {"steps": len(kept)}


def ideal_ratio(generator_busy: float, trainer_busy: float) -> float:
    """Speed-up of perfect overlap: the sum of both roles' work over the longer of the two."""
    longest = max(generator_busy, trainer_busy)
    return (generator_busy + trainer_busy) / longest if longest > 0 else 1.0


def compare(sync_runs: list[dict[str, float]], async_runs: list[dict[str, float]]) -> dict[str, float]:
    """Medians over repeats of the per-run medians, the achieved and the ideal ratio."""
    def med(runs: list[dict[str, float]], field: str) -> float:
        return statistics.median(r[field] for r in runs)

    sync_step, async_step = med(sync_runs, "step_seconds"), med(async_runs, "step_seconds")
    tg, tt = med(sync_runs, "generator_busy_seconds"), med(sync_runs, "trainer_busy_seconds")
    achieved, ideal = sync_step / async_step, ideal_ratio(tg, tt)
    return {"sync_step": sync_step, "async_step": async_step, "tg": tg, "tt": tt, "achieved": achieved,
            "ideal": ideal, "of_ideal": achieved / ideal,
            "async_tg": med(async_runs, "generator_busy_seconds"), "async_tt": med(async_runs, "trainer_busy_seconds")}


def markdown(result: dict[str, float], settings: str) -> str:
    return "\n".join([
        f"Settings: {settings}",
        "",
        "| sync step s | async step s | achieved ratio | Tg s (sync) | Tt s (sync) | ideal (Tg+Tt)/max | "
        "achieved / ideal | Tg s (async) | Tt s (async) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {result['sync_step']:.3f} | {result['async_step']:.3f} | {result['achieved']:.2f} | {result['tg']:.3f} | "
        f"{result['tt']:.3f} | {result['ideal']:.2f} | {result['of_ideal']:.0%} | {result['async_tg']:.3f} | "
        f"{result['async_tt']:.3f} |",
    ])


def compare_strategies(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per strategy, the medians over repeats of the per-run medians; `ratio` is its step time over wait's."""
    medians = {name: {f: statistics.median(r[f] for r in found) for f in FIELDS} for name, found in runs.items()}
    return {name: m | {"ratio": m["step_seconds"] / medians["wait"]["step_seconds"]} for name, m in medians.items()}


def strategies_markdown(result: dict[str, dict[str, float]], settings: str) -> str:
    lines = [f"Settings: {settings}", "",
             "| strategy | step s | trainer busy s | train s | optimizer waited for sends s | pack s | "
             "generator busy s | step / wait's |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['step_seconds']:.3f} | {r['trainer_busy_seconds']:.3f} | "
                     f"{r['train_seconds']:.3f} | {r['sync_wait_seconds']:.4f} | {r['sync_pack_seconds']:.4f} | "
                     f"{r['generator_busy_seconds']:.3f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def with_model(job: Any, model: dict[str, Any]) -> Any:
    """The job with spec.model replaced (validated like any job)."""
    from rlfleet.workers.spec import parse_job

    data = job.to_dict()
    data["spec"]["model"] = model
    return parse_job(data)


@contextlib.contextmanager
def environment(extra: dict[str, str]):
    """Workers inherit this process's environment: set `extra` for the duration of a run."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def with_settings(job: Any, staleness: int, steps: int, max_new_tokens: int | None = None,
                  snapshot: bool = False) -> Any:
    """The job with this run's maxStaleness, steps and weightSync.snapshot (and completion length, if given)."""
    spec = job.spec.model_copy(update={"weight_sync": job.spec.weight_sync.model_copy(update={"snapshot": snapshot})})
    if max_new_tokens is not None:
        generation = spec.generation.model_copy(update={"max_new_tokens": max_new_tokens, "segment_tokens": None})
        spec = spec.model_copy(update={"generation": generation})
    algorithm = spec.algorithm.model_copy(update={"max_staleness": staleness, "steps": steps})
    # One checkpoint at the end only: checkpoint writes are not what is measured.
    checkpoint = spec.checkpoint.model_copy(update={"every_steps": steps})
    return job.model_copy(update={"spec": spec.model_copy(update={"algorithm": algorithm, "checkpoint": checkpoint})})


def run_once(job: Any, out_dir: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Run the job locally; its metrics.jsonl records."""
    from rlfleet.workers.local import run_local

    log = io.StringIO()
    with environment(env):
        code = run_local(job, out_dir, out=log)
    if code != 0:
        raise RuntimeError(f"run in {out_dir} exited {code}:\n{log.getvalue()[-4000:]}")
    with open(out_dir / "metrics.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench async", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(DEFAULT_JOB), help="RLJob YAML (default: the tiny example)")
    parser.add_argument("--steps", type=int, default=40, help="trainer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    parser.add_argument("--repeats", type=int, default=2, help="sync/async pairs, interleaved A B A B")
    parser.add_argument("--staleness", type=int, default=1, help="maxStaleness of the asynchronous runs")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="completion length (default: the job's); longer balances generation and training")
    parser.add_argument("--cores", choices=["split", "shared"], default="split",
                        help="split: one core for the generator, one for the rest; shared: all for all")
    parser.add_argument("--keep", default=None, help="keep the run directories here (default: a temp dir)")
    parser.add_argument("--sync-strategies", action="store_true",
                        help="compare the wait and snapshot weight-push strategies (async runs) instead")
    parser.add_argument("--model", type=json.loads, default=None, help="replace the job's model (JSON)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.staleness < 1 or args.steps <= args.warmup or args.repeats < 1:
        raise SystemExit("need --staleness >= 1, --steps > --warmup and --repeats >= 1")
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.spec import load_job

    job = load_job(args.job) if args.model is None else with_model(load_job(args.job), args.model)
    materialize(job.spec.model, default_cache_dir())
    # Each repeat runs every variant once, in this order: A B A B ...
    variants = ({name: (args.staleness, snapshot) for name, snapshot in STRATEGIES.items()} if args.sync_strategies
                else {0: (0, False), args.staleness: (args.staleness, False)})
    runs: dict[Any, list[dict[str, float]]] = {name: [] for name in variants}
    core_env = SPLIT_CORES_ENV if args.cores == "split" else {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-async-") as temp:
        root = Path(args.keep or temp)
        started = time.perf_counter()
        for repeat in range(args.repeats):
            for name, (staleness, snapshot) in variants.items():
                run_job = with_settings(job, staleness, args.steps, args.max_new_tokens, snapshot)
                records = run_once(run_job, root / f"r{repeat}-{name}", core_env)
                runs[name].append(summarize(records, args.warmup))
                print(f"repeat {repeat} {_label(name)}: median step {runs[name][-1]['step_seconds']:.3f} s", flush=True)
        wall = time.perf_counter() - started
    tokens = args.max_new_tokens or job.spec.generation.max_new_tokens
    model = "" if args.model is None else f" with model {json.dumps(args.model)}"
    pairs = "strategy" if args.sync_strategies else "sync/async"
    settings = (f"`{Path(args.job).name}`{model} with maxNewTokens {tokens}, cores {args.cores}, "
                f"{args.steps} steps per run ({args.warmup} warm-up steps dropped), {args.repeats} interleaved {pairs} rounds, async maxStaleness "
                f"{args.staleness}, {wall:.0f} s wall")
    if args.sync_strategies:
        print(strategies_markdown(compare_strategies(runs), settings))
    else:
        print(markdown(compare(runs[0], runs[args.staleness]), settings))
    return 0


def _label(name: Any) -> str:
    return f"maxStaleness {name}" if isinstance(name, int) else f"strategy {name}"
