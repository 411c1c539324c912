"""What the operator's deployment decides for every job (image, storage, shm): set by Helm values via env."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from rlfleet.operator.policy import PodPolicy

DEFAULT_IMAGE = "ghcr.io/rlfleet/rlfleet:0.1.0-cpu"


@dataclass(frozen=True)
class OperatorConfig:
    image: str = DEFAULT_IMAGE
    """Worker image: the same image as the operator's, with the CPU or CUDA engine."""
    image_pull_policy: str = "IfNotPresent"
    """Kubernetes imagePullPolicy of worker containers."""
    trainer_storage: str = "10Gi"
    """Size of each trainer rank's volume (run dir: checkpoints and metrics); rank 0's holds the checkpoints."""
    storage_class: str = ""
    """StorageClass of trainer volumes; empty = the cluster's default."""
    shm_size: str = "2Gi"
    """Size limit of the memory-backed /dev/shm (NCCL and PyTorch data loading use it; counts as pod memory)."""
    operator_namespace: str = "rlfleet-system"
    """Where the operator runs: its pods may reach the controller's gRPC port through each job's NetworkPolicy."""
    policy: PodPolicy = field(default_factory=PodPolicy)
    """What jobs' pods may ask for beyond the defaults (host paths, host network, loader variables)."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorConfig:
        """Each field from RLFLEET_<FIELD> (e.g. RLFLEET_TRAINER_STORAGE), else its default."""
        env = os.environ if environ is None else environ
        values = {f.name: env[f"RLFLEET_{f.name.upper()}"] for f in fields(cls)
                  if f.name != "policy" and f"RLFLEET_{f.name.upper()}" in env}
        return cls(**values, policy=PodPolicy.from_env(env))
