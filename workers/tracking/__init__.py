"""Experiment tracking: every step's metrics and the resolved job to the trackers the job names (spec.tracking).

Each tracker is optional (its package is the `tracking` extra) and works offline; `open_trackers` is the
plain factory on `type`. The controller logs what it writes to metrics.jsonl, so every tracker holds the
same numbers as the run directory: a step's numbers at its step, a held-out result (`eval_*`) at the version it
scored. A resumed run trains the steps after its checkpoint again; no tracker keeps the lost run's values of them
(docs/algorithms.md: Experiment tracking).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Protocol

from rlfleet.workers.tracking.config import MLflow, TensorBoard, TrackerSpec, WandB

# Wall-clock and bookkeeping fields of a metrics.jsonl record, not metrics.
NOT_METRICS = ("step", "time")
# The fields of a held-out result: a record collects it after the version it scored (in_loop.py).
HELD_OUT_PREFIX = "eval_"


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_held_out(self, version: int, metrics: dict[str, float]) -> None:
        """A held-out result, after the `log` of the record that holds it: at step `version`, the one it scored."""

    def close(self) -> None: ...


def open_trackers(specs: list[TrackerSpec], run_dir: Path, job: dict[str, Any], start_step: int = 0) -> list[Tracker]:
    """Start each tracker the job names (none by default); `job` is the resolved job, logged once. `start_step`:
    the checkpoint's step a resumed run starts from."""
    return [_open(spec, run_dir, job, start_step) for spec in specs]


def log_record(trackers: list[Tracker], record: dict[str, Any]) -> None:
    """A metrics.jsonl record to every tracker: its numbers at its step, its held-out result's at the version that
    was scored."""
    numbers = {k: float(v) for k, v in record.items()
               if k not in NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
    held_out = {k: v for k, v in numbers.items() if k.startswith(HELD_OUT_PREFIX)}
    rest = {k: v for k, v in numbers.items() if k not in held_out}
    for tracker in trackers:
        tracker.log(record["step"], rest)
        if held_out:
            tracker.log_held_out(int(record["eval_policy_version"]), held_out)


def close_trackers(trackers: list[Tracker]) -> None:
    for tracker in trackers:
        tracker.close()


def _open(spec: TrackerSpec, run_dir: Path, job: dict[str, Any], start_step: int) -> Tracker:
    try:
        if spec.type == "tensorboard":
            return TensorBoardTracker(spec, run_dir, job, start_step)
        if spec.type == "wandb":
            return WandBTracker(spec, run_dir, job, start_step)
        if spec.type == "mlflow":
            return MLflowTracker(spec, run_dir, job)
    except ImportError as missing:
        raise RuntimeError(f"spec.tracking {spec.type}: {missing}; install the tracking extra: "
                           "pip install 'rlfleet[tracking]'") from missing
    raise ValueError(f"unknown tracker type {spec.type!r}")


def flattened(document: Any, prefix: str = "") -> dict[str, str]:
    """`{"spec": {"model": {"type": "tiny"}}}` -> `{"spec.model.type": "tiny"}`, lists by index."""
    if isinstance(document, dict):
        items = document.items()
    elif isinstance(document, list):
        items = enumerate(document)
    else:
        return {prefix: str(document)}
    found: dict[str, str] = {}
    for key, value in items:
        found |= flattened(value, f"{prefix}.{key}" if prefix else str(key))
    return found


class TensorBoardTracker:
    """Event files in RUN_DIR/tensorboard: `tensorboard --logdir RUN_DIR/tensorboard`. A resumed run's new event
    file starts by purging the steps after the checkpoint: TensorBoard drops what earlier files hold of them."""

    def __init__(self, spec: TensorBoard, run_dir: Path, job: dict[str, Any], start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        self.writer.add_text("job", f"```\n{json.dumps(job, indent=2)}\n```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_held_out(self, version: int, metrics: dict[str, float]) -> None:
        self.log(version, metrics)

    def close(self) -> None:
        self.writer.close()


class WandBTracker:
    """A W&B run; offline it lives in RUN_DIR/wandb until `wandb sync`. A resumed run is a W&B run of its own in
    the run directory's group: W&B ignores a step below one a run logged already, so continuing the same run would
    keep the lost run's values of the steps trained again."""

    def __init__(self, spec: WandB, run_dir: Path, job: dict[str, Any], start_step: int):
        import wandb

        name = job["metadata"]["name"]
        group = f"{name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        # A run id per start (a run may be resumed from the same checkpoint twice).
        run_id = f"{group}-{start_step}-{time.time_ns() % 10**9}" if start_step else group
        self.run = wandb.init(project=spec.project, mode=spec.mode, dir=str(run_dir), group=group,
                              name=f"{name} from step {start_step}" if start_step else name, id=run_id,
                              resume="allow", config=job, settings=wandb.Settings(silent=True, x_disable_stats=True))
        # Held-out results are drawn against the version they scored, which a later step's row logs.
        self.run.define_metric("eval_policy_version")
        self.run.define_metric(f"{HELD_OUT_PREFIX}*", step_metric="eval_policy_version")
        self.step = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.step = step
        self.run.log(metrics, step=step)

    def log_held_out(self, version: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=self.step)  # W&B steps only grow: the row of the record holding it

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run; by default in a SQLite store in RUN_DIR (`mlflow ui --backend-store-uri
    sqlite:///RUN_DIR/mlflow.db`), artifacts in RUN_DIR/mlartifacts."""

    def __init__(self, spec: MLflow, run_dir: Path, job: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(spec.tracking_uri or f"sqlite:///{run_dir.resolve()}/mlflow.db")
        experiment = self.client.get_experiment_by_name(spec.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            spec.experiment, artifact_location=(run_dir.resolve() / "mlartifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=job["metadata"]["name"]).info.run_id
        self.client.log_dict(self.run_id, job, "job.json")
        from mlflow.entities import Param

        # MLflow caps a parameter value at 6000 characters.
        self.client.log_batch(self.run_id, params=[Param(k, v[:6000]) for k, v in flattened(job["spec"]).items()])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_held_out(self, version: int, metrics: dict[str, float]) -> None:
        self.log(version, metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
