"""`rlfleet bench peer`: held-out accuracy over wall time, RLFleet with its defaults against TRL's GRPOTrainer, side by
side in one run, on tasks nobody tuned for.

For each task, both train the same model on the same data with the same reward (the job's scorers) for the same
wall time, counted from the start of each one's process. RLFleet runs a job that names only its model, data, scorers
and completion length (every other setting is its default); TRL runs its GRPOTrainer with its defaults as a user
would, the completion length and CPU float32 aside (`--trl` changes them). Both curves are greedy accuracy on the
same held-out prompts graded by the job's scorers with the same engine: RLFleet's from its in-loop evaluation (on a
generator while training goes on, so its cost is in RLFleet's wall time), TRL's from its weights saved at marks of
its training time (its clock stopped while saving) and evaluated afterwards by `rlfleet eval`. The base model's
accuracy, measured the same way, starts both curves. Needs `pip install 'rlfleet[peer]'`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlfleet.benchmarks.parity import accuracy

# TRL's GRPOTrainer as the issue measured it: 4 prompts x 4 samples per step at lr 1e-5 (TRL 1.16's own defaults
# are 1 prompt x 8 samples at lr 1e-6, which learns far slower here: `--trl '{}'` runs them).
TRL_CONFIG = {"learning_rate": 1e-5, "per_device_train_batch_size": 16, "num_generations": 4}
MODELS = {
    "smollm2": ({"type": "smollm2"}, "chat"),
    # The CI's short version: a model of a few MB that learns nothing much in a minute, but runs every part.
    "tiny": ({"type": "tiny", "hiddenSize": 128, "numHeads": 4, "numLayers": 2, "intermediateSize": 256}, "plain"),
}
# Short answers without a chain of thought: what a 135M model can learn on two CPU cores in minutes.
JUST_THE_ANSWER = "Answer with just the answer."
TASKS = {
    "arith99": ({"type": "arithmetic", "maxOperand": 99, "operations": ["+", "-", "*"], "wordings": "varied"},
                [{"type": "math_answer"}], 16),
    # Counting in a text; graded on the number in the reply, which the model already gives in a sentence.
    "letter_counting": ({"type": "reasoning_gym", "datasets": {"letter_counting": 1}, "systemPrompt": JUST_THE_ANSWER},
                        [{"type": "math_answer"}], 8),
    # Logic, answered Yes or No; reasoning-gym's own check wants the bare word, which the model must learn to give.
    "syllogism": ({"type": "reasoning_gym", "datasets": {"syllogism": 1}, "systemPrompt": JUST_THE_ANSWER},
                  [{"type": "reasoning_gym", "answerTag": None}], 4),
    # Kinship from a family's description, answered with one word (reasoning-gym's own check).
    "family_relationships": ({"type": "reasoning_gym", "datasets": {"family_relationships": 1},
                              "systemPrompt": JUST_THE_ANSWER}, [{"type": "reasoning_gym", "answerTag": None}], 6),
}
# A run stopped at its wall time is given this long to stop its workers before they are killed.
STOP_GRACE_SECONDS = 120.0


@dataclass
class Curve:
    """Held-out accuracy at seconds of wall time, and the samples trained by then."""

    name: str
    points: list[tuple[float, float]] = field(default_factory=list)
    samples: int = 0

    def at(self, seconds: float) -> float:
        """The accuracy of the newest weights evaluated at or before `seconds`."""
        return max((p for p in self.points if p[0] <= seconds), default=(0.0, float("nan")))[1]

    def reaches(self, target: float) -> float | None:
        """Seconds until the accuracy first reaches `target`; None if it never does."""
        return next((t for t, value in sorted(self.points) if value >= target), None)


def task_job(task: str, model: str, limit: int, eval_every: int) -> dict[str, Any]:
    """The job RLFleet runs: model, data, scorers and completion length; the rest its defaults, save what the bench
    needs (a step count it never reaches: it is stopped on time; evaluation; no checkpoints in the timing)."""
    data, scorers, new_tokens = TASKS[task]
    model_spec, template = MODELS[model]
    name = f"peer-{task}".replace("_", "-")
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
            "spec": {"model": model_spec, "data": data | {"template": template, "heldOut": limit},
                     "scorers": scorers, "generation": {"maxNewTokens": new_tokens},
                     "algorithm": {"steps": 10**6}, "checkpoint": {"everySteps": 10**6},
                     "evaluation": {"everySteps": eval_every, "limit": limit}}}


def run_rlfleet(job_path: Path, out: Path, seconds: float) -> Curve:
    """`rlfleet run` of the job, stopped (SIGTERM) at `seconds`; its in-loop evaluations as a curve."""
    started = time.time()
    with open(out.parent / f"{out.name}.log", "w", encoding="utf-8") as log:
        command = [sys.executable, "-m", "rlfleet.workers.cli", "run", str(job_path), "--out", str(out)]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=out.parent,
                                   start_new_session=True)
        _stop_at(process, started + seconds)
    records = _records(out / "metrics.jsonl")
    if process.returncode not in (0, 128 + signal.SIGTERM) or not records:
        raise RuntimeError(f"rlfleet run exited {process.returncode}: see {out.parent / f'{out.name}.log'}")
    return rlfleet_curve(records, started, seconds)


def rlfleet_curve(records: list[dict[str, Any]], started: float, seconds: float) -> Curve:
    """Each evaluated version's accuracy at the time its weights were trained (version 0: at 0)."""
    trained_at = {r["policy_version"]: r["time"] - started for r in records} | {0: 0.0}
    points = [(trained_at[r["eval_policy_version"]], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    kept = sorted(p for p in points if p[0] <= seconds)
    samples = sum(r["samples_trained"] for r in records if r["time"] - started <= seconds)
    return Curve("RLFleet", kept, samples)


def run_trl(job_path: Path, out: Path, seconds: float, marks: int, config: dict[str, Any], limit: int) -> Curve:
    """TRL for `seconds`, its weights saved at `marks` evenly spaced times, each evaluated as RLFleet's are."""
    times = ",".join(f"{seconds * (k + 1) / marks:.1f}" for k in range(marks))
    command = [sys.executable, "-m", "rlfleet.benchmarks.peer_trl", str(job_path), "--out", str(out),
               "--started", repr(time.time()), "--marks", times, "--config", json.dumps(config)]
    with open(out.parent / f"{out.name}.log", "w", encoding="utf-8") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=out.parent, check=False)
    saved = _records(out / "marks.jsonl")
    if done.returncode != 0 or not saved:
        raise RuntimeError(f"TRL exited {done.returncode}: see {out.parent / f'{out.name}.log'}")
    curve = Curve("TRL", samples=saved[-1]["samples"])
    for mark in saved:
        correct, total = accuracy(str(job_path), Path(mark["model_dir"]), limit, out.parent)
        curve.points.append((mark["elapsed"], correct / total))
        shutil.rmtree(mark["model_dir"])  # a SmolLM2 is half a GB in float32
    return curve


def compare(task: str, base: float, ours: Curve, theirs: Curve, seconds: float, marks: int) -> dict[str, Any]:
    """Both curves at each mark, and the targets' measures: at or above at every mark; our time to their final."""
    theirs.points.insert(0, (0.0, base))  # RLFleet's curve starts with its own evaluation before training
    grid = [seconds * (k + 1) / marks for k in range(marks)]
    final = theirs.points[-1]
    reached = ours.reaches(final[1])
    return {"task": task, "base": base, "grid": grid, "ours": [ours.at(t) for t in grid],
            "theirs": [theirs.at(t) for t in grid], "at_or_above": all(ours.at(t) >= theirs.at(t) for t in grid),
            "their_final": final, "ours_reach_seconds": reached,
            "time_ratio": None if reached is None or final[0] <= 0 else reached / final[0],
            "samples": {"RLFleet": ours.samples, "TRL": theirs.samples},
            "curves": {"RLFleet": ours.points, "TRL": theirs.points}}


def markdown(results: list[dict[str, Any]], settings: str) -> str:
    lines = [f"Settings: {settings}", ""]
    for result in results:
        lines += [f"**{result['task']}** (base model {result['base']:.3f} by `rlfleet eval`, "
                  f"{result['curves']['RLFleet'][0][1]:.3f} by RLFleet's in-loop evaluation; samples trained: RLFleet "
                  f"{result['samples']['RLFleet']}, TRL {result['samples']['TRL']})", "",
                  "| wall s | " + " | ".join(f"{t:.0f}" for t in result["grid"]) + " |",
                  "|---|" + "---|" * len(result["grid"]),
                  "| RLFleet | " + " | ".join(f"{v:.3f}" for v in result["ours"]) + " |",
                  "| TRL | " + " | ".join(f"{v:.3f}" for v in result["theirs"]) + " |", ""]
        seconds, value = result["their_final"]
        reach = result["ours_reach_seconds"]
        lines.append(f"TRL's final {value:.3f} at {seconds:.0f} s; RLFleet reaches it "
                     + ("never" if reach is None else f"at {reach:.0f} s ({result['time_ratio']:.2f} of TRL's time)")
                     + f"; RLFleet at or above TRL at every mark: {'yes' if result['at_or_above'] else 'no'}")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
    for axis, result in zip(axes[0], results):
        for name, points in result["curves"].items():
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        axis.set(title=result["task"], xlabel="wall time, s", ylabel="held-out accuracy (greedy)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _stop_at(process: subprocess.Popen, deadline: float) -> None:
    """Let the process run until `deadline`, then stop it as Ctrl-C would, killing its group if it will not."""
    while process.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench peer", description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of: {', '.join(TASKS)}")
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="the model both train")
    parser.add_argument("--seconds", type=float, default=600.0, help="wall time of each run")
    parser.add_argument("--marks", type=int, default=6, help="evenly spaced times TRL's weights are evaluated at")
    parser.add_argument("--limit", type=int, default=200, help="held-out prompts per evaluation")
    parser.add_argument("--eval-every", type=int, default=10, help="RLFleet's in-loop evaluation, every N steps")
    parser.add_argument("--trl", type=json.loads, default=TRL_CONFIG,
                        help=f"GRPOConfig fields over TRL's defaults, JSON (default: {json.dumps(TRL_CONFIG)})")
    parser.add_argument("--out", default=None, help="keep jobs, logs, peer.json and peer.png here (default: temp)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tasks = args.tasks.split(",")
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or args.seconds <= 0 or args.marks < 1:
        raise SystemExit(f"rlfleet bench peer: unknown tasks {unknown}; choose from {', '.join(TASKS)}" if unknown
                         else "rlfleet bench peer: need --seconds > 0 and --marks >= 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-peer-") as temp:
        root = Path(args.out or temp).resolve()
        root.mkdir(parents=True, exist_ok=True)
        for task in tasks:
            results.append(_one_task(task, args, root))
            (root / "peer.json").write_text(json.dumps(results, indent=1))
        plot(results, root / "peer.png")
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        settings = (f"model {args.model}, {args.seconds:.0f} s of wall time each, greedy accuracy on {args.limit} "
                    f"held-out prompts, RLFleet's defaults, TRL GRPOConfig {json.dumps(args.trl)} over its defaults, "
                    f"{os.cpu_count()} CPUs, load average at the end {load}; picture: {root / 'peer.png'}")
        print(markdown(results, settings))
    return 0


def _one_task(task: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    job_path = root / f"{task}.yaml"
    job_path.write_text(yaml.safe_dump(task_job(task, args.model, args.limit, args.eval_every), sort_keys=False))
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.spec import load_job

    materialize(load_job(job_path).spec.model, default_cache_dir())  # once, before either clock starts
    correct, total = accuracy(str(job_path), None, args.limit, root)
    print(f"{task}: base model {correct}/{total}", flush=True)
    ours = run_rlfleet(job_path, root / f"{task}-rlfleet", args.seconds)
    print(f"{task}: RLFleet {ours.points}", flush=True)
    theirs = run_trl(job_path, root / f"{task}-trl", args.seconds, args.marks, args.trl, args.limit)
    print(f"{task}: TRL {theirs.points}", flush=True)
    return compare(task, correct / total, ours, theirs, args.seconds, args.marks)
