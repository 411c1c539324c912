"""Each experiment tracker writes offline into the run directory, and what it wrote reads back: every metric
of the step records at its step, and the resolved job. (W&B starts its own service process: integration.)"""

from __future__ import annotations

import json

import pytest

from rlfleet.workers.tracking import close_trackers, log_record, open_trackers
from rlfleet.workers.tracking.config import MLflow, TensorBoard, WandB

from conftest import make_job
from runs import wait_for

pytestmark = pytest.mark.integration
JOB = make_job(tracking=[{"type": "tensorboard"}]).to_dict()
RECORDS = [{"step": 1, "time": 1.7e9, "reward_mean": 0.25, "loss": -0.5, "eval_accuracy": 0.4, "eval_policy_version": 0,
            "note": "text"},
           {"step": 2, "time": 1.7e9, "reward_mean": 0.75, "loss": -0.25, "skipped": True}]


def track(spec, run_dir) -> None:
    trackers = open_trackers([spec], run_dir, JOB)
    for record in RECORDS:
        log_record(trackers, record)
    close_trackers(trackers)


def test_tensorboard_event_files_hold_every_metric_and_the_job(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    track(TensorBoard(), tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval_accuracy")] == [(0, pytest.approx(0.4))], \
        "at the version scored, not the record's step"
    assert "time" not in events.Tags()["scalars"] and "step" not in events.Tags()["scalars"]
    job = events.Tensors("job/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"name": "t"' in job


def test_a_resumed_runs_tensorboard_holds_each_step_once_with_the_values_of_metrics_jsonl(tmp_path):
    """Killed after step 4 with a checkpoint at step 2: the resumed run trains steps 3 and 4 again, and TensorBoard
    shows its values of them, not the lost run's (nor both)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lost = open_trackers([TensorBoard()], tmp_path, JOB)
    for step in range(1, 5):
        log_record(lost, {"step": step, "reward_mean": step / 10})
    close_trackers(lost)
    resumed = open_trackers([TensorBoard()], tmp_path, JOB, start_step=2)
    for step in range(3, 6):
        log_record(resumed, {"step": step, "reward_mean": step})
    close_trackers(resumed)
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, 3.0), (4, 4.0), (5, 5.0)]


def test_wandb_offline_run_holds_every_metric_and_the_job(tmp_path):
    track(WandB(mode="offline"), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "no account and no network: the run stays on disk for `wandb sync`"
    log = next(runs[0].glob("*.wandb"))
    expected = [b"reward_mean", b"eval_accuracy", b"loss", b'"type":"tiny"', b'"name":"t"']
    # W&B's own service process may still be flushing the log when finish() returns.
    wait_for(lambda: all(name in log.read_bytes() for name in expected), 30)


def test_a_resumed_run_is_a_wandb_run_of_its_own_beside_the_first(tmp_path):
    """W&B ignores a step below one its run has logged: continuing the same run would keep the lost run's values
    of the steps trained again."""
    track(WandB(mode="offline"), tmp_path)
    resumed = open_trackers([WandB(mode="offline")], tmp_path, JOB, start_step=1)
    log_record(resumed, RECORDS[1])
    close_trackers(resumed)
    first, second = (path.name.split("-", 3)[3] for path in sorted((tmp_path / "wandb").glob("offline-run-*")))
    assert second.startswith(f"{first}-1-"), (first, second)


def test_mlflow_sqlite_store_holds_every_metric_params_and_the_job(tmp_path):
    from mlflow.tracking import MlflowClient

    track(MLflow(), tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlfleet").experiment_id])
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert run.data.params["model.type"] == "tiny" and run.info.status == "FINISHED"
    artifact = client.download_artifacts(run.info.run_id, "job.json", str(tmp_path))
    assert json.loads(open(artifact).read())["metadata"]["name"] == "t"
