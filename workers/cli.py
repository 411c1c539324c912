"""The `rlfleet` command. Parses first and imports heavy modules only in the chosen command."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NoReturn

from rlfleet.workers.executors import KINDS

BENCHMARKS = {
    "weight-sync": "rlfleet.benchmarks.weight_sync",
    "async": "rlfleet.benchmarks.async_speedup",
    "generator": "rlfleet.benchmarks.generator_overhead",
    "parity": "rlfleet.benchmarks.parity",
    "chaos": "rlfleet.benchmarks.chaos",
    "trainer": "rlfleet.benchmarks.trainer",
    "peer": "rlfleet.benchmarks.peer",
    "pools": "rlfleet.benchmarks.pools",
    "pipeline": "rlfleet.benchmarks.pipeline",
    "quantization": "rlfleet.benchmarks.quantization",
}
ROLE_MAINS = {kind.role: kind.main for kind in KINDS}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args) or 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description="Asynchronous RL post-training of LLMs.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run a job on this machine (workers as local processes)")
    run.add_argument("job", nargs="?", help="RLJob YAML file (with --resume: optional, e.g. to raise steps)")
    run.add_argument("--out", default=None, help="run directory of a new run (default: runs/<job name>)")
    run.add_argument("--resume", default=None, metavar="RUN_DIR",
                     help="continue the run in RUN_DIR from its last checkpoint (its job unless one is given)")
    run.set_defaults(func=_run)

    scale = commands.add_parser("scale", help="add or remove generators of a run in progress (or of its resume)")
    scale.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory")
    scale.add_argument("--generators", type=int, required=True,
                       help="the run's generator count from now on (with --pool, that pool's)")
    scale.add_argument("--pool", default=None, help="the generator pool to scale (a job with pools: any of them)")
    scale.set_defaults(func=_scale)

    check = commands.add_parser("validate", help="check a job file and its data, and print the resolved job")
    check.add_argument("job")
    check.set_defaults(func=_validate)

    evaluate = commands.add_parser("eval", help="a model's greedy completions of the job's held-out prompts, graded by "
                                     "the job's scorers")
    evaluate.add_argument("job", help="RLJob YAML file (its model, data and scorers)")
    evaluate.add_argument("--model-dir", default=None, help="HF directory to evaluate, e.g. a checkpoint")
    evaluate.add_argument("--limit", type=int, default=200, help="held-out prompts to use")
    evaluate.add_argument("--wordings", choices=["trained", "unseen"], default="trained",
                          help="ask the held-out problems as training does, or in wordings training never used")
    evaluate.add_argument("--verbose", action="store_true",
                          help="show the model loaders' logs (vLLM, transformers), held back otherwise unless it fails")
    evaluate.set_defaults(func=_eval)

    merge = commands.add_parser("merge", help="merge a LoRA checkpoint's adapters into a full HF model directory")
    merge.add_argument("checkpoint", help="a checkpoint directory of a LoRA run (e.g. RUN/checkpoints/best)")
    merge.add_argument("--out", required=True, help="where to write the merged model")
    merge.add_argument("--base", default=None, help="base model directory (default: the one the run trained)")
    merge.set_defaults(func=_merge)

    fetch = commands.add_parser("fetch", help="fetch the job's model.uri and data.uri into the worker cache")
    fetch.add_argument("job", help="RLJob YAML file")
    fetch.add_argument("--role", choices=sorted(ROLE_MAINS), help="only what this role reads (default: all)")
    fetch.set_defaults(func=_fetch)

    render = commands.add_parser("render", help="print the Kubernetes manifests the operator would create")
    render.add_argument("job", help="RLJob YAML file")
    render.add_argument("--namespace", default=None, help="namespace of the objects (default: the job's)")
    render.add_argument("--image", default=None, help="worker image (default: the operator's default)")
    render.set_defaults(func=_render)

    bench = commands.add_parser("bench", help="benchmarks, each measured side by side in one run",
                                add_help=False)
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="its own options (see `rlfleet bench NAME --help`)")
    bench.set_defaults(func=_bench)

    plan = commands.add_parser("plan", help="predict sync and async step times on a GPU cluster (H100 defaults)")
    size = plan.add_mutually_exclusive_group(required=True)
    size.add_argument("--model", choices=["8b", "70b", "405b"], help="a Llama 3.1 shape")
    size.add_argument("--params-b", type=float, help="any size, billions (Llama-3-like shape)")
    size.add_argument("--paper", action="store_true", help="compare with LlamaRL's three published settings")
    size.add_argument("--job", metavar="JOB_YAML", help="an RLJob's generator pools: replicas, GPUs, tensor "
                                                        "parallelism and why")
    plan.add_argument("--gpus", type=int, default=128, help="GPUs in all (the best split is searched)")
    plan.add_argument("--generator-gpus", type=int, default=None, help="fix the split instead of searching it")
    plan.add_argument("--inter-node-gbps", type=float, default=50.0, help="per-GPU network GB/s (NDR IB: 50)")
    plan.add_argument("--sequences", type=int, default=2048, help="completions per step")
    plan.add_argument("--prompt-tokens", type=float, default=1024, help="mean prompt length")
    plan.add_argument("--gen-mean", type=float, default=1024, help="mean completion length")
    plan.add_argument("--gen-max", type=float, default=4096, help="longest completion")
    plan.set_defaults(func=_plan)

    report = commands.add_parser("report", help="PNGs and a summary (bubble ratios) of runs, side by side")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, e.g. a sync and an async run")
    report.add_argument("--out", default=None, help="where to write them (default: FIRST_RUN_DIR/report)")
    report.add_argument("--window", default=None, metavar="FROM:TO",
                        help="timeline window in seconds since the loop started (default: the whole loop)")
    report.set_defaults(func=_report)

    toy = commands.add_parser("toy-reward-model", help="train the examples' tiny reward model (seconds, on a CPU)")
    toy.add_argument("out", metavar="OUT_DIR", help="where to write it (a HF directory a job's rewardModel.path names)")
    toy.add_argument("--digit", default="7", choices=list("0123456789"),
                     help="it prefers completions that contain this digit")
    toy.set_defaults(func=_toy_reward_model)

    worker = commands.add_parser("worker", help="run one worker (started by `run` or by a pod)")
    worker.add_argument("role", choices=sorted(ROLE_MAINS))
    worker.set_defaults(func=_worker)
    return parser


def _toy_reward_model(args: argparse.Namespace) -> int:
    from rlfleet.workers.reward_model.toy import train_digit_preference

    accuracy = train_digit_preference(Path(args.out), args.digit)
    print(f"rlfleet: reward model preferring completions with a {args.digit} written to {args.out} "
          f"(held-out accuracy {accuracy:.2f})")
    return 0


def _load(path: str):
    from rlfleet.workers.spec import SpecError, load_job

    try:
        return load_job(path)
    except (SpecError, OSError) as error:
        sys.exit(f"rlfleet: {path}: {error}")


def _with_reward_code(job, run_code=True):
    """The job with each python scorer's and a python environment's file content in its `source`, refused (naming
    the field) when a file is missing or its code does not load: checked by importing it (`run_code`, where the job
    runs) or, as the operator checks it, by reading it without running it."""
    from rlfleet.workers.environment import loading
    from rlfleet.workers.scorer.python import import_problems, source_problems, with_sources

    scorers, problems = with_sources(job.spec.scorers)
    environment, missing = loading.with_environment_source(job.spec.roles.environment)
    problems += missing
    if not problems and run_code:
        problems = import_problems(scorers) + loading.environment_import_problems(environment)
    elif not problems:
        problems = source_problems(scorers) + loading.environment_source_problems(environment)
    if problems:
        sys.exit("rlfleet: " + "; ".join(problems))
    roles = job.spec.roles.model_copy(update={"environment": environment})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"scorers": scorers, "roles": roles})})


def _run(args: argparse.Namespace) -> int:
    from rlfleet.workers.engines import check_tensor_parallel
    from rlfleet.workers.local import CONFIG_FILE, missing_paths, run_local, with_absolute_paths
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.storage.fetch import FetchError, fetch_for

    if args.resume:
        out = Path(args.resume)
        if args.out:
            sys.exit("rlfleet: --resume names the run directory already: drop --out")
        if not (out / CONFIG_FILE).is_file():
            sys.exit(f"rlfleet: --resume {out}: no run to resume there (no {CONFIG_FILE})")
        job = _load(args.job or str(out / CONFIG_FILE))
    elif args.job:
        job = _load(args.job)
        out = Path(args.out or f"runs/{job.metadata.name}")
        if (out / CONFIG_FILE).exists():
            sys.exit(f"rlfleet: {out} holds a run already: continue it with `rlfleet run --resume {out}`, "
                     "or give another --out")
    else:
        sys.exit("rlfleet run: give a job file, or --resume RUN_DIR")
    job = with_absolute_paths(_with_reward_code(job))
    if missing := missing_paths(job):
        sys.exit("rlfleet: " + "; ".join(missing) + " (a relative path is taken from where rlfleet run runs)")
    # Fetched, built or converted once here, so workers find it in the cache and a bad model or URI fails early.
    try:
        fetch_for(job, None, default_cache_dir())
    except FetchError as err:
        sys.exit(f"rlfleet: {err}")
    _check_data(job)
    try:
        check_tensor_parallel(job, materialize(job.spec.model, default_cache_dir()))
    except ValueError as err:
        sys.exit(f"rlfleet: {err}")
    verb = "resuming" if args.resume else "running"
    print(f"rlfleet: {verb} {job.metadata.name} in {out} (worker logs in {out}/logs)")
    return run_local(job, out)


def _scale(args: argparse.Namespace) -> int:
    """`kubectl scale rlj` for a local run: the run follows its config's generator count."""
    from rlfleet.workers.local import CONFIG_FILE, write_config
    from rlfleet.workers.spec import SpecError, parse_job

    path = Path(args.run_dir) / CONFIG_FILE
    if not path.is_file():
        sys.exit(f"rlfleet scale: {args.run_dir}: no run there (no {CONFIG_FILE})")
    document = _load(str(path)).to_dict()
    generator = document["spec"]["roles"]["generator"]
    pools = {pool["name"]: pool for pool in generator["pools"]}
    if bool(pools) != bool(args.pool) or args.pool and args.pool not in pools:
        sys.exit(f"rlfleet scale: --pool: name one of the job's generator pools ({', '.join(pools) or 'it has none'})")
    scaled = pools[args.pool] if args.pool else generator
    before, scaled["replicas"] = scaled["replicas"], args.generators
    if args.pool:
        generator.pop("replicas")  # the pools' sum
    try:
        job = parse_job(document)
    except SpecError as error:
        sys.exit(f"rlfleet scale: --generators {args.generators}: {error}")
    write_config(path, job)
    where = f" in pool {args.pool}" if args.pool else ""
    print(f"rlfleet: {args.run_dir}: generators {before} -> {args.generators}{where} "
          "(a run in progress starts or stops them at once and the controller uses them from its next step; a "
          "stopped run resumes with them)")
    return 0


def _validate(args: argparse.Namespace) -> int:
    import json

    job = _with_reward_code(_load(args.job))
    data = job.spec.data
    if getattr(data, "uri", None):
        print(f"rlfleet: data.uri {data.uri} is not fetched here: `rlfleet run` checks it once fetched",
              file=sys.stderr)
    elif data.type == "jsonl" and not Path(data.path).exists() and job.spec.storage.holds(data.path, "trainer"):
        print(f"rlfleet: data.path {data.path} is on the job's volumes, not here: its trainer pods read it "
              "(`rlfleet render` checks that it lies on one they mount)", file=sys.stderr)
    else:
        _check_data(job)
    print(json.dumps(job.to_dict(), indent=2))
    return 0


def _check_data(job) -> None:
    """Exit naming the line and field where the job's data cannot be trained on."""
    from rlfleet.workers.data.check import check_data
    from rlfleet.workers.data.tasks import DataError

    try:
        check_data(job)
    except DataError as err:
        sys.exit(f"rlfleet: {err}")


def _eval(args: argparse.Namespace) -> int:
    import contextlib

    from rlfleet.workers.evaluation.held_out import evaluate
    from rlfleet.workers.logs import output_held_back, setup_logging

    setup_logging("eval")
    job = _load(args.job)
    unseen = args.wordings == "unseen"
    with contextlib.nullcontext(sys.stdout) if args.verbose else output_held_back() as out:
        scores = evaluate(job, Path(args.model_dir) if args.model_dir else None, args.limit, unseen)
        print("\n".join(scores.lines("greedy, wordings never trained on" if unseen else "greedy")), file=out)
    return 0


def _merge(args: argparse.Namespace) -> int:
    from rlfleet.workers.logs import setup_logging
    from rlfleet.workers.trainer.checkpoint import ADAPTER_CONFIG
    from rlfleet.workers.trainer.lora import merge

    setup_logging("merge")
    checkpoint = Path(args.checkpoint)
    if not (checkpoint / ADAPTER_CONFIG).is_file():
        sys.exit(f"rlfleet: {checkpoint} holds no {ADAPTER_CONFIG}: not a LoRA checkpoint (a full one loads as it is)")
    out = merge(checkpoint, Path(args.out), Path(args.base) if args.base else None)
    print(f"rlfleet: wrote {out} (base model with {checkpoint}'s adapters merged in)")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from rlfleet.workers.logs import setup_logging
    from rlfleet.workers.storage.cache import default_cache_dir
    from rlfleet.workers.storage.fetch import FetchError, fetch_for

    setup_logging("fetch")
    try:
        paths = fetch_for(_load(args.job), args.role, default_cache_dir())
    except FetchError as err:
        sys.exit(f"rlfleet: {err}")
    for path in paths:
        print(path)
    return 0


def _render(args: argparse.Namespace) -> int:
    from rlfleet.operator.render import render_job
    from rlfleet.workers.spec import SpecError

    try:
        # Checked as the operator checks it: the code is for the image's Python, not necessarily this one's.
        job = _with_reward_code(_load(args.job), run_code=False)
        print(render_job(job, namespace=args.namespace, image=args.image), end="")
    except SpecError as error:
        sys.exit(f"rlfleet: {args.job}: {error}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(BENCHMARKS[args.name]).main(args.args)


def _plan(args: argparse.Namespace) -> int:
    from rlfleet.workers import capacity

    if args.job:
        from rlfleet.workers.generator.pools import markdown_pools

        print(markdown_pools(_load(args.job).spec))
        return 0
    cluster = capacity.with_bandwidth(capacity.Cluster(), args.inter_node_gbps)
    if args.paper:
        print(capacity.markdown_paper(cluster))
        return 0
    model = capacity.LLAMA3[args.model] if args.model else capacity.llama_like(args.params_b)
    work = capacity.Workload(args.sequences, args.prompt_tokens, args.gen_mean, args.gen_max)
    if args.generator_gpus is None:
        prediction = capacity.best_split(model, work, args.gpus, cluster)
    elif 0 < args.generator_gpus < args.gpus:
        prediction = capacity.predict(model, work, args.generator_gpus, args.gpus - args.generator_gpus, cluster)
    else:
        sys.exit("rlfleet: --generator-gpus must be between 1 and --gpus - 1")
    print(capacity.markdown_plan(model, work, prediction))
    return 0


def _report(args: argparse.Namespace) -> int:
    from rlfleet.workers.report import write_report

    runs = [Path(run) for run in args.runs]
    out = Path(args.out) if args.out else runs[0] / "report"
    window = None
    if args.window:
        try:
            start, end = (float(part) for part in args.window.split(":"))
        except ValueError:
            sys.exit(f"rlfleet: --window {args.window!r}: want FROM:TO in seconds, e.g. 10:20")
        window = (start, end)
    try:
        print(write_report(runs, out, window), end="")
    except FileNotFoundError as error:
        sys.exit(f"rlfleet: {error}")
    print(f"rlfleet: wrote {out}/reward.png, {out}/timeline.png and {out}/summary.txt")
    return 0


def _worker(args: argparse.Namespace) -> NoReturn:
    import os
    import signal

    from rlfleet.workers.cores import pin_to_planned_cores
    from rlfleet.workers.executors import worker_main
    from rlfleet.workers.logs import setup_logging
    from rlfleet.workers.plan import WorkerContext
    from rlfleet.workers.wire import FENCE_DIR_ENV

    pin_to_planned_cores(os.environ)  # first: every thread and rank it starts stays there
    per_pod = _ranks_to_start(args.role)
    if per_pod > 1:
        from rlfleet.workers.launch import run_pod

        exit_now(run_pod(args.role, per_pod))
    ctx = WorkerContext.from_environ()
    setup_logging(ctx.role, ctx.rank)
    os.environ[FENCE_DIR_ENV] = os.path.join(ctx.run_dir, "fence", f"{ctx.role}-{ctx.rank}")
    # A pod's worker is its container's PID 1, which the kernel shields from every signal it has no handler
    # for: without one, `kubectl delete pod` (or a suspend) waited out the 60 s grace period for its SIGKILL.
    signal.signal(signal.SIGTERM, _exit_at_once)
    code = 1
    try:
        worker_main(args.role)(ctx)
        code = 0
    except Exception:
        logging.getLogger("rlfleet").exception("%s-%d failed", ctx.role, ctx.rank)
    finally:
        exit_now(code)


def _ranks_to_start(role: str) -> int:
    """The ranks a trainer or critic pod's process starts (ranksPerPod), or 0 for a process that is a rank itself."""
    import json
    import os

    from rlfleet.workers.executors import BY_ROLE

    if not BY_ROLE[role].ranked or "LOCAL_RANK" in os.environ or "RLFLEET_RANK" in os.environ:
        return 0
    from rlfleet.workers.plan import ranks_per_pod
    from rlfleet.workers.spec import parse_job

    with open(os.environ["RLFLEET_JOB_CONFIG"], encoding="utf-8") as handle:
        return ranks_per_pod(parse_job(json.load(handle)), role)


def exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown, once the worker stopped in order: torch's
    process-group threads outlive `destroy_process_group` (modules still hold their groups), and one that
    drops its last work during teardown needs the GIL, finds the interpreter gone and aborts the process
    (SIGABRT, "terminate called without an active exception")."""
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_at_once(signum: int, _frame: object) -> NoReturn:
    """Exit now, as a SIGKILL would: every peer survives that (the trainer resumes from its checkpoint), while a
    graceful stop could wait on threads and RPCs in flight."""
    logging.getLogger("rlfleet").warning("stopping on SIGTERM")
    exit_now(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
