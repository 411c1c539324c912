"""`rlfleet bench peer`: held-out accuracy over wall time, RLFleet with its defaults against TRL's GRPOTrainer, side by
side in one run, on tasks nobody tuned for.

For each task, both train the same model on the same data with the same reward (the job's scorers) for the same
wall time, counted from the start of each one's process. RLFleet runs a job that names only its model, data, scorers
and completion length (every other setting is its default); TRL runs its GRPOTrainer with its defaults as a user
would, the completion length and CPU float32 aside (`--trl` changes them). Both curves are greedy accuracy on the
same held-out prompts graded by the job's scorers with the same engine, and neither side's evaluation counts in its
wall time: RLFleet's curve is its in-loop evaluation's, on a generator, whose seconds its clock leaves out; TRL's from
its weights saved at marks of its training time (its clock stopped while saving) and evaluated afterwards by
`rlfleet eval`. The base model's accuracy, measured the same way, starts TRL's curve. `--rlfleet NAME=JSON` adds
RLFleet runs with settings changed (spec fields over the defaults), each its own curve beside the defaults': a
candidate default measured against both. Needs `pip install 'rlfleet[peer]'`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

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
# The run of RLFleet's defaults, always first; `--rlfleet` adds variants beside it.
BASELINE = "RLFleet"
VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,30}")
TAKEN_NAMES = ("rlfleet", "trl")
# A run stopped at its wall time is given this long to stop its workers before they are killed.
STOP_GRACE_SECONDS = 120.0
STOP_POLL_SECONDS = 0.5


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


def task_job(task: str, model: str, limit: int, eval_every: int, settings: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """The job RLFleet runs: model, data, scorers and completion length; the rest its defaults, save what the bench
    needs (a step count it never reaches: it is stopped on time; evaluation; no checkpoints in the timing), and a
    variant's `settings` (spec fields, merged in)."""
    data, scorers, new_tokens = TASKS[task]
    model_spec, template = MODELS[model]
    name = f"peer-{task}".replace("_", "-")
    spec = {"model": model_spec, "data": data | {"template": template, "heldOut": limit}, "scorers": scorers,
            "generation": {"maxNewTokens": new_tokens}, "algorithm": {"steps": 10**6},
            "checkpoint": {"everySteps": 10**6}, "evaluation": {"everySteps": eval_every, "limit": limit}}
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
            "spec": merged(spec, settings or {})}


def merged(base: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """`base` with `settings` over it, objects merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in settings.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def variant(text: str) -> tuple[str, dict[str, Any]]:
    """`--rlfleet NAME=JSON`: a run of RLFleet with these spec fields over its defaults."""
    name, _, fields = text.partition("=")
    if not VARIANT_NAME.fullmatch(name) or name in TAKEN_NAMES:
        raise argparse.ArgumentTypeError(f"{name!r}: a variant's name is lowercase letters, digits and dashes, "
                                         f"and none of {', '.join(TAKEN_NAMES)} (the defaults' and TRL's runs)")
    return name, spec_fields(fields, name)


def spec_fields(text: str, whose: str = "--settings") -> dict[str, Any]:
    """A JSON object of spec fields, or an argparse error saying what it must be."""
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{whose}: its settings are not JSON ({error}): '{{...}}'") from None
    if not isinstance(settings, dict):
        raise argparse.ArgumentTypeError(f"{whose}: its settings are a JSON object of spec fields")
    return settings


def run_rlfleet(job_path: Path, out: Path, seconds: float, name: str = BASELINE) -> Curve:
    """`rlfleet run` of the job, stopped (SIGTERM) once `seconds` of its wall time not spent evaluating have passed;
    its in-loop evaluations as a curve."""
    started = time.time()
    metrics = out / "metrics.jsonl"
    with open(out.parent / f"{out.name}.log", "w", encoding="utf-8") as log:
        command = [sys.executable, "-m", "rlfleet.workers.cli", "run", str(job_path), "--out", str(out)]
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=out.parent,
                                   start_new_session=True)
        _stop_at(process, lambda: started + seconds + sum(r.get("eval_seconds", 0.0) for r in _records(metrics)))
    records = _records(metrics)
    if process.returncode not in (0, 128 + signal.SIGTERM) or not records:
        raise RuntimeError(f"rlfleet run exited {process.returncode}: see {out.parent / f'{out.name}.log'}")
    return rlfleet_curve(records, started, seconds, name)


def rlfleet_curve(records: list[dict[str, Any]], started: float, seconds: float, name: str = BASELINE) -> Curve:
    """Each evaluated version's accuracy at the time its weights were trained (version 0: at 0), on a clock that
    leaves out the evaluations: TRL's clock stops while it saves weights to evaluate, and RLFleet's evaluation takes
    the generator, the loop's bottleneck, from generating. A record's time leaves out every evaluation collected by
    then, its own included (it ran while the record's step did)."""
    trained_at, evaluating = {0: 0.0}, 0.0
    for record in records:
        evaluating += record.get("eval_seconds", 0.0)
        trained_at[record["policy_version"]] = record["time"] - started - evaluating
    points = [(trained_at[r["eval_policy_version"]], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    kept = sorted(p for p in points if p[0] <= seconds)
    samples = sum(r["samples_trained"] for r in records if trained_at[r["policy_version"]] <= seconds)
    return Curve(name, kept, samples)


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


def compare(task: str, base: float, ours: list[Curve], theirs: Curve, seconds: float, marks: int) -> dict[str, Any]:
    """Every curve at each mark, and the targets' measures for each of ours: at or above theirs at every mark, and
    the time to their final accuracy."""
    theirs.points.insert(0, (0.0, base))  # each of ours starts with its own evaluation before training
    grid = [seconds * (k + 1) / marks for k in range(marks)]
    final = theirs.points[-1]
    targets = {}
    for curve in ours:
        reached = curve.reaches(final[1])
        targets[curve.name] = {"at_or_above": all(curve.at(t) >= theirs.at(t) for t in grid),
                               "reach_seconds": reached,
                               "time_ratio": None if reached is None or final[0] <= 0 else reached / final[0]}
    return {"task": task, "base": base, "grid": grid, "their_final": final, "targets": targets,
            "rows": {curve.name: [curve.at(t) for t in grid] for curve in [*ours, theirs]},
            "samples": {curve.name: curve.samples for curve in [*ours, theirs]},
            "curves": {curve.name: curve.points for curve in [*ours, theirs]}}


def markdown(results: list[dict[str, Any]], settings: str) -> str:
    lines = [f"Settings: {settings}", ""]
    for result in results:
        own = ", ".join(f"{name} {points[0][1]:.3f}" for name, points in result["curves"].items() if name != "TRL")
        samples = ", ".join(f"{name} {count}" for name, count in result["samples"].items())
        lines += [f"**{result['task']}** (base model {result['base']:.3f} by `rlfleet eval`; by each run's in-loop "
                  f"evaluation: {own}; samples trained: {samples})", "",
                  "| wall s | " + " | ".join(f"{t:.0f}" for t in result["grid"]) + " |",
                  "|---|" + "---|" * len(result["grid"])]
        lines += [f"| {name} | " + " | ".join(f"{v:.3f}" for v in row) + " |" for name, row in result["rows"].items()]
        seconds, value = result["their_final"]
        lines += ["", f"TRL's final {value:.3f} at {seconds:.0f} s."]
        for name, target in result["targets"].items():
            reach = target["reach_seconds"]
            lines.append(f"{name} reaches it " + ("never" if reach is None else
                                                  f"at {reach:.0f} s ({target['time_ratio']:.2f} of TRL's time)")
                         + f"; at or above TRL at every mark: {'yes' if target['at_or_above'] else 'no'}.")
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


def _stop_at(process: subprocess.Popen, deadline: Callable[[], float]) -> None:
    """Let the process run until `deadline()` (asked again every poll: it may move), then stop it as Ctrl-C would,
    killing its group if it will not."""
    while process.poll() is None and time.time() < deadline():
        time.sleep(STOP_POLL_SECONDS)
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
    parser.add_argument("--rlfleet", type=variant, action="append", default=[], metavar="NAME=JSON",
                        help="also run RLFleet with these spec fields over its defaults, e.g. "
                             "'lr3e-5={\"algorithm\": {\"learningRate\": 3e-5}}' (repeatable)")
    parser.add_argument("--out", default=None, help="keep jobs, logs, peer.json and peer.png here (default: temp)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tasks = args.tasks.split(",")
    unknown = sorted(set(tasks) - set(TASKS))
    names = [name for name, _ in args.rlfleet]
    if len(set(names)) < len(names):
        raise SystemExit(f"rlfleet bench peer: two --rlfleet variants share a name: {', '.join(names)}")
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
                    f"held-out prompts, RLFleet's defaults{_variants(args.rlfleet)}, TRL GRPOConfig "
                    f"{json.dumps(args.trl)} over its defaults, {os.cpu_count()} CPUs, load average at the end {load}; "
                    f"picture: {root / 'peer.png'}")
        print(markdown(results, settings))
    return 0


def _variants(variants: list[tuple[str, dict[str, Any]]]) -> str:
    return "".join(f", {name}: {json.dumps(settings)} over them" for name, settings in variants)


def _one_task(task: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from rlfleet.workers.models import default_cache_dir, materialize
    from rlfleet.workers.spec import load_job

    jobs = {name: written_job(root / f"{task}-{name.lower()}.yaml",
                              task_job(task, args.model, args.limit, args.eval_every, settings))
            for name, settings in [(BASELINE, {}), *args.rlfleet]}
    job_path = jobs[BASELINE]
    materialize(load_job(job_path).spec.model, default_cache_dir())  # once, before any clock starts
    correct, total = accuracy(str(job_path), None, args.limit, root)
    print(f"{task}: base model {correct}/{total}", flush=True)
    ours = []
    for name, path in jobs.items():
        ours.append(run_rlfleet(path, root / path.stem, args.seconds, name))
        print(f"{task}: {name} {ours[-1].points}", flush=True)
    theirs = run_trl(job_path, root / f"{task}-trl", args.seconds, args.marks, args.trl, args.limit)
    print(f"{task}: TRL {theirs.points}", flush=True)
    return compare(task, correct / total, ours, theirs, args.seconds, args.marks)


def written_job(path: Path, job: dict[str, Any]) -> Path:
    """The job as YAML at `path`, validated first: a variant's wrong field fails before any run starts."""
    from rlfleet.workers.spec import parse_job

    parse_job(job)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path
