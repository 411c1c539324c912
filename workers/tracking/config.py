"""Experiment trackers (`spec.tracking`), each optional and each working offline. Torch-free: part of the RLJob
schema."""

from __future__ import annotations

import ipaddress
import socket
from typing import Annotated, Literal, Union
from urllib.parse import urlsplit

from pydantic import Field, field_validator

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

    @field_validator("tracking_uri")
    @classmethod
    def _not_link_local(cls, value: str | None) -> str | None:
        if value and reaches_link_local(value):
            raise ValueError("a link-local address (169.254.0.0/16, fe80::/10: a cloud's instance metadata service, "
                             "which hands out the node's credentials): name the MLflow server")
        return value


# Names that clouds resolve to their metadata service's link-local address.
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "instance-data.ec2.internal"})


def reaches_link_local(uri: str) -> bool:
    """Whether a URI's host is a link-local address, written any way a resolver reads it (169.254.169.254,
    2852039166, 0xa9fea9fe, [fe80::1], [::ffff:169.254.169.254]), or a metadata service's name."""
    try:
        host = urlsplit(uri).hostname
    except ValueError:  # a malformed [IPv6] part: no host to reach
        return False
    if not host:
        return False
    if host.rstrip(".") in METADATA_HOSTS:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:  # the legacy IPv4 forms inet_aton reads, as a URL's client would: 2852039166, 0xa9.0xfe.43518
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return False  # a name
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_link_local


TrackerSpec = Annotated[Union[TensorBoard, WandB, MLflow], Field(discriminator="type")]
