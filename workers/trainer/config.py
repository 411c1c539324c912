"""How the trainer trains: micro-batches, log-prob chunks, activation checkpointing, the learning-rate
schedule and LoRA (`spec.training`), checkpoints, and what a trainer pod is (`spec.roles.trainer`). Torch-free:
part of the RLJob schema, which the operator imports."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from rlfleet.workers.roles import RankedRole
from rlfleet.workers.strict import Strict

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM fuses these into one weight each (qkv_proj, gate_up_proj): loading part of one would leave the rest unset.
FUSED_TARGETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class ConstantSchedule(Strict):
    """Linear warm-up, then learningRate for the rest of the run."""

    type: Literal["constant"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=10**7)
    """Steps over which the rate rises linearly to learningRate (step s of them uses (s + 1) / (warmupSteps + 1))."""


class CosineSchedule(Strict):
    """Linear warm-up, then a cosine decay from learningRate to minRatio x learningRate at the last step."""

    type: Literal["cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0, le=10**7)
    """Steps over which the rate rises linearly to learningRate."""
    min_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """The rate at the last step, as a fraction of learningRate."""


LrSchedule = Annotated[Union[ConstantSchedule, CosineSchedule], Field(discriminator="type")]


class Lora(Strict):
    """Train low-rank adapters (peft LoRA) instead of every weight; the generators get only the adapters and
    merge them into their own copy of the base weights."""

    rank: int = Field(16, ge=1, le=1024)
    """Rank r of each adapter."""
    alpha: float = Field(32.0, gt=0.0, le=1e4)
    """Scale: the update is (alpha / rank) x B A."""
    target_modules: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]] = (
        Field(default_factory=lambda: list(LORA_TARGETS), min_length=1))
    """Linear layers that get adapters (Llama names); q/k/v go together, and so do gate/up."""

    @model_validator(mode="after")
    def _fused_together(self) -> Lora:
        for group in FUSED_TARGETS:
            chosen = [name for name in group if name in self.target_modules]
            if chosen and len(chosen) != len(group):
                raise ValueError(f"targetModules: {', '.join(group)} go together (vLLM fuses them into one weight)")
        return self


class Training(Strict):
    micro_batch_tokens: int | None = Field(None, ge=1, le=10**8)
    """Token budget of one forward/backward: a step's samples are cut into micro-batches of at most this many
    tokens (packed end to end, no padding; a prompt shared by several samples counts once) and their gradients
    accumulated. Bounds activation memory; the loss and its gradient are the same as one pass over the whole batch.
    Unset: chosen at start from the device's free memory and the model's size (per-token activations, less with
    activationCheckpointing), the same on every rank, and logged."""
    logprob_chunk_tokens: int = Field(1024, ge=1, le=10**7)
    """Completion tokens whose vocabulary-wide logits exist at once when a micro-batch's float32 logits do not fit in
    a quarter of free memory: log pi is then computed (and recomputed in the backward) this many tokens at a time;
    when they fit, in one plain pass."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input and recompute the layer in the backward: less memory, ~1/3 more compute."""
    compile: bool = False
    """torch.compile each decoder layer. Off by default: compiling takes minutes on a small CPU (again for new batch
    shapes) and no speed-up was measured there; `rlfleet bench trainer --compile` measures a machine."""
    lr_schedule: LrSchedule = Field(default_factory=ConstantSchedule)
    """Learning rate over the steps (algorithm.learningRate is its peak)."""
    lora: Lora | None = None
    """Train LoRA adapters instead of the full model (unset: full fine-tuning)."""


class Checkpoint(Strict):
    every_steps: int = Field(10, ge=1, le=10**7)
    """Write a checkpoint every this many trainer steps (and at the end)."""
    keep: int = Field(2, ge=1, le=1000)
    """Checkpoints kept on disk."""


class TrainerRole(RankedRole):
    """Trainer pods: replicas x ranksPerPod ranks train the policy; rank 0 also runs the controller."""

    pipeline_parallel: int = Field(1, ge=1, le=64)
    """Pipeline stages: the decoder layers are cut into this many contiguous stages (the first also holds the
    embedding, the last the final norm and the output layer), each on worldSize / pipelineParallel ranks that shard
    it FSDP2-style; micro-batches flow through the stages one forward, one backward (1F1B). Rank r runs stage
    r // (worldSize / pipelineParallel). The step learns what one rank's would; each stage pushes its own shards to
    the generators. 1: no pipeline, every rank holds a shard of every layer."""

    @model_validator(mode="after")
    def _stages_divide_the_world(self) -> TrainerRole:
        if self.world_size % self.pipeline_parallel:
            raise ValueError(f"pipelineParallel ({self.pipeline_parallel}) must divide the trainer ranks, replicas x "
                             f"ranksPerPod ({self.world_size}): each stage has as many ranks")
        return self

    @property
    def data_parallel(self) -> int:
        """Ranks per pipeline stage: each holds a shard of its stage and trains its share of the batch."""
        return self.world_size // self.pipeline_parallel
