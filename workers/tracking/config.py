"""Experiment trackers (`spec.tracking`), each optional and each working offline. Torch-free: part of the RLJob
schema."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from rlfleet.workers.strict import Strict


class TensorBoard(Strict):
    """TensorBoard event files in RUN_DIR/tensorboard (needs the `tensorboard` package: the `tracking` extra)."""

    type: Literal["tensorboard"] = "tensorboard"


class WandB(Strict):
    """Weights & Biases (needs the `wandb` package: the `tracking` extra)."""

    type: Literal["wandb"] = "wandb"
    project: str = Field("rlfleet", min_length=1, max_length=128)
    """W&B project the run is filed under."""
    mode: Literal["offline", "online"] = "offline"
    """offline: files in RUN_DIR/wandb, no account needed (`wandb sync` uploads them later); online needs
    WANDB_API_KEY in the trainer's environment."""


class MLflow(Strict):
    """MLflow (needs `mlflow-skinny` or `mlflow`: the `tracking` extra)."""

    type: Literal["mlflow"] = "mlflow"
    tracking_uri: str | None = Field(None, min_length=1, max_length=4096)
    """Where runs are recorded; unset: a SQLite store RUN_DIR/mlflow.db (artifacts in RUN_DIR/mlartifacts), no
    server needed (`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db` shows it)."""
    experiment: str = Field("rlfleet", min_length=1, max_length=256)
    """MLflow experiment name."""


TrackerSpec = Annotated[Union[TensorBoard, WandB, MLflow], Field(discriminator="type")]
