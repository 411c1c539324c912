"""What every executor role of a job has (replicas, resources, placement, environment): the base of each role's
section in `spec.roles`, whose own fields live beside the executor (generator/config.py, trainer/config.py).
Torch-free: part of the RLJob schema."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfleet.workers.strict import Strict

QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
# Kubernetes label syntax (nodeSelector): checked here, or the API server would refuse the StatefulSet only
# after the operator had created the job's other objects.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Set by the planner, the operator or the image for every worker: a job's own value would break them.
RESERVED_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                          "HOME", "PATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "POD_NAME",
                          "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"})
GPU_RESOURCE = "nvidia.com/gpu"
# Host memory per GPU by default: a rank holds a full copy of the weights (and vLLM its own) while loading.
GPU_MEMORY_GI = 32


class Resources(Strict):
    cpu: str = Field("1", pattern=QUANTITY)
    """CPU request (Kubernetes quantity)."""
    memory: str | None = Field(None, pattern=QUANTITY)
    """Memory request and limit (Kubernetes quantity). Unset: 4Gi, or 32Gi per GPU for a GPU pod (its ranks load
    the model into host memory before their GPUs)."""
    gpu: int = Field(0, ge=0, le=64)
    """nvidia.com/gpu per pod; > 0 selects NCCL and CUDA."""
    extra: dict[str, str] = Field(default_factory=dict, max_length=16)
    """Other resources per pod, requested and limited alike: `rdma/hca: "1"` (an RDMA device plugin's),
    `hugepages-2Mi: 1Gi`, ..."""

    @property
    def memory_or_default(self) -> str:
        return self.memory or (f"{GPU_MEMORY_GI * self.gpu}Gi" if self.gpu else "4Gi")

    @field_validator("extra")
    @classmethod
    def _resource_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, quantity in value.items():
            prefix, _, short = name.rpartition("/")
            if not LABEL_VALUE.match(short) or not short or prefix and not LABEL_PREFIX.match(prefix):
                raise ValueError(f"{name[:60]!r} is not a resource name ([domain/]name)")
            if name in ("cpu", "memory", GPU_RESOURCE):
                raise ValueError(f"{name!r}: set it as resources.{'gpu' if name == GPU_RESOURCE else name}")
            if not re.match(QUANTITY, quantity):
                raise ValueError(f"{name}: {quantity[:60]!r} is not a quantity (e.g. 1, 500m, 2Gi)")
        return value


def one_gpu_at_most(resources: Resources, what: str, advice: str = "") -> Resources:
    """Resources of an executor that runs on one device: more than one GPU per pod is refused, naming `what`."""
    if resources.gpu > 1:
        raise ValueError(f"gpu: {what} runs on one GPU, got {resources.gpu}{advice}")
    return resources


class Toleration(Strict):
    key: str | None = Field(None, max_length=253)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0)


class Role(Strict):
    replicas: int = Field(1, ge=1, le=1024)
    """Processes (pods) of this role."""
    resources: Resources = Field(default_factory=Resources)
    """Per-pod resources."""
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Kubernetes nodeSelector."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    """Kubernetes tolerations."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes pod affinity (nodeAffinity, podAntiAffinity, ...), passed to the pods as written."""
    env: dict[str, str] = Field(default_factory=dict, max_length=128)
    """Extra environment of this role's processes (pods, and `rlfleet run`'s): NCCL_SOCKET_IFNAME, NCCL_IB_HCA,
    NCCL_DEBUG, ... The variables RLFleet sets itself are refused."""
    host_network: bool = False
    """Pods use their node's network (NCCL over the host's InfiniBand/RoCE interfaces without a CNI in the path).
    Their ports are then the node's: the operator keeps one pod of the role per node (pod anti-affinity), and the
    job's NetworkPolicy does not cover them."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name[:60]!r} is not an environment variable name")
            if name.startswith("RLFLEET_") or name in RESERVED_ENV:
                raise ValueError(f"{name} is set by RLFleet itself (ranks, peers, paths): leave it out")
        return value

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return node_labels(value)


def node_labels(value: dict[str, str]) -> dict[str, str]:
    """A nodeSelector with Kubernetes' label syntax, else a ValueError naming the bad key or value."""
    for key, label in value.items():
        prefix, _, name = key.rpartition("/")
        if not name or not LABEL_VALUE.match(name) or prefix and not (
                len(prefix) <= 253 and LABEL_PREFIX.match(prefix)):
            raise ValueError(f"{key[:60]!r} is not a label key ([prefix/]name, name at most 63 characters)")
        if not LABEL_VALUE.match(label):
            raise ValueError(f"{key[:60]!r}: {label[:60]!r} is not a label value (at most 63 characters)")
    return value


class RankedRole(Role):
    """A role whose pods run one process (rank) per GPU in one torch.distributed world: the trainer, the critic."""

    ranks_per_pod: int = Field(1, ge=1, le=64)
    """Processes (ranks) per pod, one per GPU: by default resources.gpu (every GPU of the pod), else 1. The
    role's world is replicas x ranksPerPod. More than one on CPUs stands in for a multi-GPU pod."""

    @model_validator(mode="before")
    @classmethod
    def _every_gpu_by_default(cls, data: Any) -> Any:
        return default_to_gpus(data, "ranksPerPod", "ranks_per_pod")

    @model_validator(mode="after")
    def _one_rank_per_gpu(self) -> RankedRole:
        if self.resources.gpu and self.ranks_per_pod != self.resources.gpu:
            raise ValueError(f"ranksPerPod must equal resources.gpu ({self.resources.gpu}): each rank drives one GPU")
        return self

    @property
    def world_size(self) -> int:
        return self.replicas * self.ranks_per_pod


def default_to_gpus(data: Any, alias: str, name: str) -> Any:
    """A field per GPU left out of a role: as many as the pod's GPUs."""
    resources = data.get("resources") if isinstance(data, dict) else None
    gpu = resources.get("gpu") if isinstance(resources, dict) else None
    if isinstance(gpu, int) and gpu > 1 and alias not in data and name not in data:
        return {**data, alias: gpu}
    return data
