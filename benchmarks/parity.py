"""`rlfleet bench parity`: quality and wall time of the same job trained several ways, side by side: synchronously
and asynchronously at each `--staleness` (`--compare staleness`), or asynchronously with AIPO, with the PPO clipped
surrogate (DAPO's clip-higher ranges) and with AIPO plus a KL loss to a frozen reference executor
(`--compare losses`). `--task` trains one of `rlfleet bench peer`'s tasks with RLFleet's defaults instead of a job.

Every run trains on the same number of samples (steps x promptsPerStep x groupSize); only maxStaleness, or only the
loss, differs. Held-out greedy accuracy is measured on the base model once and on each run's final checkpoint,
each evaluation in its own process (a fresh engine), so the table holds before/after accuracy and the
wall time of each run, produced by this command. A job with in-loop evaluation (`evaluation.everySteps`) also gets
each run's held-out accuracy by samples trained, side by side: asynchrony's effect on quality per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.benchmarks.async_speedup import run_once, with_settings
from rlfleet.workers.reference.config import ReferenceRole
from rlfleet.workers.rl.config import AipoLoss, KlPenalty, PolicyLoss, PpoLoss

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "smollm2-arith.yaml"
ACCURACY = re.compile(r"accuracy [0-9.]+ \((\d+)/(\d+) ")
# A --task run: steps (of RLFleet's default 4 prompts x 8 samples) and in-loop evaluations.
TASK_STEPS, TASK_EVAL_EVERY = 60, 10
# The KL run's coefficient (k3, as a loss term): GRPO's usual beta is 0.04.
KL_COEF = 0.05


@dataclass(frozen=True)
class Variant:
    name: str
    staleness: int
    loss: PolicyLoss | None = None
    """None: the job's."""
    kl: float = 0.0
    """Coefficient of a KL loss to a frozen reference executor; 0: no reference."""


def accuracy(job_path: str, model_dir: Path | None, limit: int, cwd: Path) -> tuple[int, int]:
    """(correct, total) from `rlfleet eval` run in a child process."""
    # Not in a checkout: its operator/ folder on sys.path would shadow the stdlib module in the child.
    command = [sys.executable, "-m", "rlfleet.workers.cli", "eval", str(Path(job_path).resolve()), "--limit", str(limit)]
    if model_dir is not None:
        command += ["--model-dir", str(model_dir)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=cwd)
    found = ACCURACY.search(done.stdout)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return int(found.group(1)), int(found.group(2))


def with_variant(job: Any, variant: Variant) -> Any:
    """The job with the variant's loss and, with a KL, a reference executor (maxStaleness is with_settings')."""
    spec = job.spec
    if variant.kl:
        spec = spec.model_copy(update={"roles": spec.roles.model_copy(update={"reference": ReferenceRole()})})
    kl = KlPenalty(coef=variant.kl) if variant.kl else spec.algorithm.kl
    algorithm = spec.algorithm.model_copy(update={"loss": variant.loss or spec.algorithm.loss, "kl": kl})
    return job.model_copy(update={"spec": spec.model_copy(update={"algorithm": algorithm})})


def final_checkpoint(run_dir: Path, steps: int) -> Path:
    from rlfleet.workers.trainer.checkpoint import CHECKPOINTS_DIR

    path = run_dir / CHECKPOINTS_DIR / f"step-{steps:06d}"
    if not path.is_dir():
        raise RuntimeError(f"{path} is missing: the run did not write its final checkpoint")
    return path


def variants(compare: str, staleness: list[int]) -> list[Variant]:
    """Each run, the baseline first; the losses at the first staleness, the async runs one per staleness."""
    if compare == "losses":
        first = staleness[0]
        return [Variant("aipo", first, AipoLoss()), Variant("ppo", first, PpoLoss(eps_low=0.2, eps_high=0.28)),
                Variant("aipo+kl", first, AipoLoss(), kl=KL_COEF)]
    if len(staleness) == 1:
        return [Variant("sync", 0), Variant("async", staleness[0])]
    return [Variant("sync", 0)] + [Variant(f"async-{n}", n) for n in staleness]


def markdown(rows: list[dict], base: tuple[int, int], settings: str) -> str:
    lines = [f"Settings: {settings}", "",
             "| run | maxStaleness | loss | KL coef | trained samples | wall s | median step s | held-out accuracy "
             "before | after |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['name']} | {row['staleness']} | {row['loss']} | {row['kl']:g} | {row['samples']} | "
                     f"{row['wall']:.0f} | {row['step']:.1f} | {base[0] / base[1]:.3f} ({base[0]}/{base[1]}) | "
                     f"{row['correct'] / row['total']:.3f} ({row['correct']}/{row['total']}) |")
    first = rows[0]
    lines.append("")
    for other in rows[1:]:
        lines.append(f"Wall-time ratio {first['name']} / {other['name']}: {first['wall'] / other['wall']:.2f}; "
                     f"accuracy after, {other['name']} minus {first['name']}: "
                     f"{other['correct'] / other['total'] - first['correct'] / first['total']:+.3f}")
    return "\n".join(lines)


def by_samples(records: list[dict[str, Any]]) -> dict[int, tuple[int, float]]:
    """In-loop held-out accuracy by version evaluated: (samples trained into those weights, accuracy)."""
    trained, samples = {0: 0}, 0
    for record in records:
        samples += record["samples_trained"]
        trained[record["policy_version"]] = samples
    return {r["eval_policy_version"]: (trained[r["eval_policy_version"]], r["eval_accuracy"])
            for r in records if "eval_accuracy" in r}


def by_samples_markdown(rows: list[dict]) -> str:
    """Each run's in-loop accuracy at each step evaluated, with the samples trained by then (stale drops lower it)."""
    steps = sorted({step for row in rows for step in row["by_samples"]})
    lines = ["Held-out accuracy (in-loop, greedy) @ samples trained, by step:", "",
             "| run | " + " | ".join(str(step) for step in steps) + " |", "|---|" + "---|" * len(steps)]
    for row in rows:
        curve = row["by_samples"]
        lines.append(f"| {row['name']} | " + " | ".join(
            f"{curve[step][1]:.3f} @{curve[step][0]}" if step in curve else "-" for step in steps) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from rlfleet.benchmarks.peer import TASKS  # which imports this module's `accuracy`

    parser = argparse.ArgumentParser(prog="rlfleet bench parity", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(DEFAULT_JOB), help="RLJob YAML (default: the SmolLM2 example)")
    parser.add_argument("--steps", type=int, default=None, help="trainer steps of each run (default: the job's)")
    parser.add_argument("--compare", choices=["staleness", "losses"], default="staleness",
                        help="sync against async, or AIPO, PPO and AIPO with a KL to a reference (all async)")
    parser.add_argument("--task", choices=sorted(TASKS), default=None,
                        help="instead of --job: a task of `rlfleet bench peer`, SmolLM2 with RLFleet's defaults")
    parser.add_argument("--staleness", type=lambda text: [int(n) for n in text.split(",")], default=[1],
                        help="maxStaleness of the asynchronous runs, comma-separated: one run each (default 1)")
    parser.add_argument("--settings", type=_spec_fields, default={},
                        help="spec fields merged into every run's job, as JSON, e.g. "
                             "'{\"algorithm\": {\"epochs\": 4}}' (a trainer its generators outpace)")
    parser.add_argument("--limit", type=int, default=200, help="held-out prompts per evaluation")
    parser.add_argument("--keep", default=None, help="keep the run directories here (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.staleness) < 1 or (args.steps is not None and args.steps < 1):
        raise SystemExit("need --staleness >= 1 and --steps >= 1")
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.spec import load_job

    rows = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-parity-") as temp:
        root = Path(args.keep or temp)
        root.mkdir(parents=True, exist_ok=True)
        args.job = _job_file(args, root)
        job = load_job(args.job)
        materialize(job.spec.model, default_cache_dir())
        steps = args.steps or (TASK_STEPS if args.task else job.spec.algorithm.steps)
        algorithm = job.spec.algorithm
        samples = steps * algorithm.prompts_per_step * algorithm.group_size
        base = accuracy(args.job, None, args.limit, root)
        print(f"base model: {base[0]}/{base[1]} held-out prompts right", flush=True)
        for variant in variants(args.compare, args.staleness):
            run_dir = root / variant.name
            if run_dir.exists():
                raise SystemExit(f"{run_dir} exists: a run there would resume, not start fresh; pick another --keep")
            started = time.perf_counter()
            records = run_once(with_variant(with_settings(job, variant.staleness, steps), variant), run_dir, {})
            wall = time.perf_counter() - started
            correct, total = accuracy(args.job, final_checkpoint(run_dir, steps).resolve(), args.limit, root)
            step = statistics.median(float(r["step_seconds"]) for r in records)
            rows.append({"name": variant.name, "staleness": variant.staleness, "samples": samples, "wall": wall,
                         "step": step, "correct": correct, "total": total, "kl": variant.kl,
                         "loss": (variant.loss or job.spec.algorithm.loss).type, "by_samples": by_samples(records)})
            print(f"{variant.name}: {wall:.0f} s, {correct}/{total} right after training", flush=True)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    staleness = ", ".join(map(str, args.staleness))
    settings = (f"`{Path(args.job).name}`{_described(args.settings)}, {steps} steps x "
                f"{algorithm.prompts_per_step} prompts x {algorithm.group_size} samples each run, async maxStaleness "
                f"{staleness}, greedy eval on {args.limit} held-out prompts, {os.cpu_count()} CPUs, load average at "
                f"the end {load}")
    print(markdown(rows, base, settings))
    if rows[0]["by_samples"]:
        print("\n" + by_samples_markdown(rows))
    return 0


def _job_file(args: argparse.Namespace, root: Path) -> str:
    """The job every run starts from: --job, or a peer task's (SmolLM2 with RLFleet's defaults, evaluated in the
    loop), with --settings merged in; written to `root` unless it is --job as it stands."""
    from rlfleet.benchmarks.peer import merged, task_job, written_job
    from rlfleet.workers.local import with_absolute_paths
    from rlfleet.workers.spec import load_job

    if args.task:
        return str(written_job(root / f"{args.task}.yaml",
                               task_job(args.task, "smollm2", args.limit, TASK_EVAL_EVERY, args.settings)))
    if not args.settings:
        return args.job
    job = with_absolute_paths(load_job(args.job)).to_dict()  # its relative paths were the caller's
    return str(written_job(root / Path(args.job).name, merged(job, {"spec": args.settings})))


def _spec_fields(text: str) -> dict[str, Any]:
    from rlfleet.benchmarks.peer import spec_fields

    return spec_fields(text)


def _described(settings: dict[str, Any]) -> str:
    return f" with {json.dumps(settings)}" if settings else ""
