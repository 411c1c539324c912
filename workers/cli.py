"""The `rlfleet` command. Parses first and imports heavy modules only in the chosen command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCHMARKS = {
    "weight-sync": "rlfleet.benchmarks.weight_sync",
}
ROLE_MAINS = {
    "generator": "rlfleet.workers.generator.main",
    "scorer": "rlfleet.workers.scorer.main",
    "trainer": "rlfleet.workers.trainer.main",
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.func(args) or 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description="Asynchronous RL post-training of LLMs.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run a job on this machine (workers as local processes)")
    run.add_argument("job", help="RLJob YAML file")
    run.add_argument("--out", default=None, help="run directory (default: runs/<job name>)")
    run.set_defaults(func=_run)

    check = commands.add_parser("validate", help="check a job file and print the resolved job")
    check.add_argument("job")
    check.set_defaults(func=_validate)

    evaluate = commands.add_parser("eval", help="greedy accuracy of a model on the job's held-out prompts")
    evaluate.add_argument("job", help="RLJob YAML file (its model and data)")
    evaluate.add_argument("--model-dir", default=None, help="HF directory to evaluate, e.g. a checkpoint")
    evaluate.add_argument("--limit", type=int, default=200, help="held-out prompts to use")
    evaluate.set_defaults(func=_eval)

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

    worker = commands.add_parser("worker", help="run one worker (started by `run` or by a pod)")
    worker.add_argument("role", choices=sorted(ROLE_MAINS))
    worker.set_defaults(func=_worker)
    return parser


def _load(path: str):
    from rlfleet.workers.spec import SpecError, load_job

    try:
        return load_job(path)
    except (SpecError, OSError) as error:
        sys.exit(f"rlfleet: {path}: {error}")


def _run(args: argparse.Namespace) -> int:
    from rlfleet.workers.local import run_local
    from rlfleet.workers.models import default_cache_dir, materialize

    job = _load(args.job)
    out = Path(args.out or f"runs/{job.metadata.name}")
    # Built (or converted) once here, so workers find it in the cache and a bad model fails early.
    materialize(job.spec.model, default_cache_dir())
    print(f"rlfleet: running {job.metadata.name} in {out} (worker logs in {out}/logs)")
    return run_local(job, out)


def _validate(args: argparse.Namespace) -> int:
    import json

    print(json.dumps(_load(args.job).to_dict(), indent=2))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rlfleet.workers.evaluate import evaluate

    job = _load(args.job)
    correct, total = evaluate(job, Path(args.model_dir) if args.model_dir else None, args.limit)
    print(f"accuracy {correct / total:.3f} ({correct}/{total} held-out prompts, greedy)")
    return 0


def _render(args: argparse.Namespace) -> int:
    from rlfleet.operator.render import render_job

    print(render_job(_load(args.job), namespace=args.namespace, image=args.image), end="")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(BENCHMARKS[args.name]).main(args.args)


def _worker(args: argparse.Namespace) -> int:
    import importlib

    from rlfleet.workers.logs import setup_logging
    from rlfleet.workers.plan import WorkerContext

    ctx = WorkerContext.from_environ()
    setup_logging(ctx.role, ctx.rank)
    importlib.import_module(ROLE_MAINS[args.role]).main(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
