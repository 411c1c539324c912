"""Pipeline-parallel training (roles.trainer.pipelineParallel): the decoder layers cut into stages over the ranks,
micro-batches through the stages one forward, one backward (1F1B), each stage sharded FSDP2-style over its ranks.

Rank r runs stage r // dp, where dp = worldSize / stages, as rank r % dp of that stage (the device mesh
("pp", "dp")). The ranks of one index form one pipeline, which trains that index's share of the batch, as FSDP's
ranks share it without a pipeline. Every stage of a pipeline packs the same micro-batches itself, so all that
crosses a stage boundary is the hidden states forward and their gradients backward, point to point: each stage knows
the shapes, and a one-number header says the dtype. The last stage computes log pi and the loss; the others hold
the activations of at most `stages - stage` micro-batches (1F1B's bound).

A model with tied embeddings (SmolLM2) keeps its output layer on the last stage as a copy of the embedding; the
copy's gradient is summed with the embedding's before each step (Megatron's embedding group), so the two stay
equal, and only the embedding is pushed and checkpointed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlfleet.workers.rl.config import AipoLoss, KlPenalty, PolicyLoss
from rlfleet.workers.sync.plan import stage_layers
from rlfleet.workers.trainer.policy import (SUMS, Passes, Sample, batch_loss, batch_sums, plan_passes, step_metrics,
                                           update)
from rlfleet.workers.trainer.shared_prompts import SharedBatch, completion_head, pack_shared, shared_cost
from rlfleet.workers.world import local_shard

STAGE_METHOD = "rlfleet_stage_forward"
"""The FSDP2 forward method of a stage (`stage_forward`): the root's parameters (embedding, final norm, output layer)
are gathered around it as around forward()."""
FORWARD, BACKWARD = "forward", "backward"
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What a hidden state may cross a stage boundary in; the header names it by its index."""
TIED_COPY = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Models whose decoder `stage_forward` runs as their own forward does: embedding, layers called alike, final norm (not
Gemma 2's, whose forward scales the embedding and caps the logits, nor Phi-3's)."""
# torch's clip_grad_norm_ divides by the norm plus this, so that a zero gradient stays zero.
CLIP_EPS = 1e-6


class Absent(nn.Module):
    """In place of a decoder layer another stage holds: the layer indexes, and so the parameter names, stay."""


@dataclass
class Pipeline:
    """This rank's place in the pipeline, and the process groups it talks over."""

    stages: int
    stage: int
    data_parallel: int
    index: int
    """This rank's index within its stage, which is also its pipeline's (the share of the batch it trains)."""
    layers: range
    """The decoder layers this stage holds."""
    mesh: Any
    """The device mesh of this stage's ranks, which FSDP2 shards it over."""
    device: torch.device
    tied: bool = False
    """Whether the model ties its output layer to its embedding."""
    tied_group: Any = None
    """The first and last stages' ranks of this index, which sum the tied weights' gradients."""

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int) -> int:
        return stage * self.data_parallel + self.index

    def send_forward(self, hidden: Tensor) -> list:
        header = torch.tensor([WIRE_DTYPES.index(hidden.dtype)], dtype=torch.long, device=hidden.device)
        return [_send(header, self.rank_of(self.stage + 1)), _send(hidden, self.rank_of(self.stage + 1))]

    def receive_forward(self, tokens: int, width: int) -> Tensor:
        header = _received(torch.empty(1, dtype=torch.long, device=self.device), self.rank_of(self.stage - 1))
        dtype = WIRE_DTYPES[int(header)]
        return _received(torch.empty((1, tokens, width), dtype=dtype, device=self.device), self.rank_of(self.stage - 1))

    def send_backward(self, grad: Tensor) -> list:
        return [_send(grad, self.rank_of(self.stage - 1))]

    def receive_backward(self, output: Tensor) -> Tensor:
        return _received(torch.empty_like(output), self.rank_of(self.stage + 1))


def _send(tensor: Tensor, peer: int) -> tuple[Any, Tensor]:
    """A send in flight, with its tensor, which must live until it is waited for."""
    tensor = tensor.contiguous()
    return dist.isend(tensor, peer), tensor


def _received(buffer: Tensor, peer: int) -> Tensor:
    dist.irecv(buffer, peer).wait()
    return buffer


def build_pipeline(stages: int, world_size: int, rank: int, device: torch.device, lm: nn.Module) -> Pipeline:
    """This rank's Pipeline: its mesh and the tied-weights groups (collective: every rank builds every group)."""
    from torch.distributed.device_mesh import init_device_mesh

    if lm.config.model_type not in MODEL_TYPES:
        raise ValueError(f"roles.trainer.pipelineParallel: a {lm.config.model_type} model cannot be cut into stages "
                         f"yet (only {', '.join(MODEL_TYPES)}); set pipelineParallel to 1")
    data_parallel = world_size // stages
    stage, index = divmod(rank, data_parallel)
    mesh = init_device_mesh(device.type, (stages, data_parallel), mesh_dim_names=("pp", "dp"))["dp"]
    layers = stage_layers(lm.config.num_hidden_layers, stages)[stage]
    tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    pipeline = Pipeline(stages, stage, data_parallel, index, layers, mesh, device, tied)
    if tied:
        for member in range(data_parallel):
            group = dist.new_group([member, (stages - 1) * data_parallel + member])
            if member == index and (pipeline.first or pipeline.last):  # a middle stage holds neither copy
                pipeline.tied_group = group
    return pipeline


def split(lm: nn.Module, pipeline: Pipeline) -> list[nn.Module]:
    """Keep only this stage's part of `lm` (a Llama-shaped causal LM: `lm.model.embed_tokens`, `.layers`, `.norm`,
    `lm.lm_head`); returns the decoder layers it holds."""
    decoder = lm.model
    for index in range(len(decoder.layers)):
        if index not in pipeline.layers:
            decoder.layers[index] = Absent()
    if pipeline.last and pipeline.tied:
        lm.lm_head.weight = nn.Parameter(decoder.embed_tokens.weight.detach().clone())
    if not pipeline.first:
        decoder.embed_tokens = None
    if not pipeline.last:
        decoder.norm = None
        lm.lm_head = None
    return [decoder.layers[index] for index in pipeline.layers]


def register_stage_forward(lm: nn.Module, pipeline: Pipeline, compute_dtype: torch.dtype) -> None:
    """Make `stage_forward` an FSDP2 forward method of the (sharded) root module `lm`."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(lm, STAGE_METHOD, functools.partial(stage_forward, lm, pipeline, compute_dtype))
    register_fsdp_forward_method(lm, STAGE_METHOD)


def stage_forward(lm: nn.Module, pipeline: Pipeline, compute_dtype: torch.dtype, batch: SharedBatch,
                  hidden: Tensor | None, temperature: float, top_p: float, chunk_tokens: int) -> Tensor:
    """This stage's part of `completion_logprobs`: from the batch's ids (first stage) or the hidden states the stage
    before sent, through this stage's layers, to the hidden states for the next stage or, on the last, log pi. The
    layers are called as the model's own forward calls them, the rotary embedding computed in the dtype the
    embedding computes in, so that the result is the unsplit model's."""
    decoder = lm.model
    if hidden is None:
        hidden = decoder.embed_tokens(batch.ids[None])
    positions = batch.positions[None]
    rotary = decoder.rotary_emb(torch.empty(0, dtype=compute_dtype, device=hidden.device), position_ids=positions)
    layout = batch.layout()
    for index in pipeline.layers:
        hidden = decoder.layers[index](hidden, attention_mask=None, position_embeddings=rotary,
                                       position_ids=positions, past_key_values=None, use_cache=False,
                                       rlfleet_layout=layout)
    if not pipeline.last:
        return hidden
    return completion_head(lm, decoder.norm(hidden)[0], batch, temperature, top_p, chunk_tokens)


def one_f_one_b(stage: int, stages: int, count: int) -> list[tuple[str, int]]:
    """The order of one stage's passes over `count` micro-batches: as many forwards as stages after it (to fill the
    pipeline), then a forward and a backward in turn, then the remaining backwards. Backwards go in micro-batch
    order, so the last one is the last pass on every stage."""
    warmup = min(stages - stage - 1, count)
    order = [(FORWARD, index) for index in range(warmup)]
    for index in range(warmup, count):
        order += [(FORWARD, index), (BACKWARD, index - warmup)]
    return order + [(BACKWARD, index) for index in range(count - warmup, count)]


def filling(shares: Sequence[Sequence[Sample]], passes: Passes, stages: int) -> Passes:
    """`passes` with micro-batches small enough that each share of the batch makes at least `stages` of them
    (as far as its samples allow), so that every stage of a pipeline has work while the others do."""
    cost = max(shared_cost(share) for share in shares)
    budget = max(1, -(-cost // stages))
    return replace(passes, micro_batch_tokens=min(passes.micro_batch_tokens or budget, budget))


def pipeline_step(model: nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample], *,
                  pipeline: Pipeline, loss: PolicyLoss = AipoLoss(), temperature: float, top_p: float,
                  grad_clip: float, pad_id: int, normalizer: float, world_size: int = 1, before_update=None,
                  passes: Passes, micro_batch_count: int | None = None, kl: KlPenalty | None = None) -> dict[str, float]:
    """policy.train_step on one pipeline stage: the same micro-batches (`samples` is the pipeline's share, the same
    on each of its stages), the same loss on the last stage, the same update; `world_size` is the pipeline count
    (the stage's FSDP ranks). Every rank returns the step's metrics over all ranks."""
    del pad_id  # packed micro-batches only: nothing is padded
    batches = [pack_shared(micro).to(pipeline.device) for micro in plan_passes(samples, passes, micro_batch_count)]
    width = model.config.hidden_size
    forward = getattr(model, STAGE_METHOD)
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=pipeline.device)
    inputs: dict[int, Tensor | None] = {}
    outputs: dict[int, Tensor] = {}
    sends: list = []
    for kind, index in one_f_one_b(pipeline.stage, pipeline.stages, len(batches)):
        batch = batches[index]
        if kind == FORWARD:
            received = None if pipeline.first else pipeline.receive_forward(len(batch.ids), width).requires_grad_()
            out = forward(batch, received, temperature, top_p, passes.chunk_tokens)
            if pipeline.last:
                value, metrics = batch_loss(batch, out, loss, normalizer, kl)
                sums += batch_sums(value, metrics, pipeline.device)
                out = value * world_size  # FSDP averages the gradients over the stage's ranks: sum them instead
            else:
                sends += pipeline.send_forward(out.detach())
            inputs[index], outputs[index] = received, out
            continue
        model.set_requires_gradient_sync(index == len(batches) - 1)  # reduce once, after the last backward
        out = outputs.pop(index)
        out.backward(None if pipeline.last else pipeline.receive_backward(out))
        received = inputs.pop(index)
        if received is not None:
            sends += pipeline.send_backward(received.grad)
    for work, _ in sends:
        work.wait()
    sum_tied_gradients(model, pipeline)
    grad_norm = clip_gradients(model, pipeline, grad_clip)
    skipped = update(optimizer, grad_norm, before_update)
    return step_metrics(sums, grad_norm, skipped, kl, reduce=True)  # stages without the loss add zeros


def _tied_weight(lm: nn.Module, pipeline: Pipeline) -> nn.Parameter:
    return lm.get_input_embeddings().weight if pipeline.first else lm.lm_head.weight


def sum_tied_gradients(lm: nn.Module, pipeline: Pipeline) -> None:
    """The embedding's and its copy's gradients, each the sum of both (a tied weight's gradient)."""
    if pipeline.tied_group is None:
        return
    with torch.no_grad():
        dist.all_reduce(local_shard(_tied_weight(lm, pipeline).grad), group=pipeline.tied_group)


def clip_gradients(lm: nn.Module, pipeline: Pipeline, max_norm: float) -> float:
    """clip_grad_norm_ over the whole model: the norm over every stage's and every rank's shards (a tied copy counted
    once), every gradient scaled by the same factor. Returns the norm, the same on every rank."""
    grads = [p.grad for p in lm.parameters() if p.grad is not None]
    copy = lm.lm_head.weight if pipeline.last and pipeline.tied and not pipeline.first else None
    counted = [p.grad for p in lm.parameters() if p.grad is not None and p is not copy]
    squares = torch.zeros((), dtype=torch.float64, device=pipeline.device)
    for grad in counted:
        squares += local_shard(grad).double().square().sum()
    dist.all_reduce(squares)
    norm = float(squares.sqrt())
    if math.isfinite(norm):
        factor = min(1.0, max_norm / (norm + CLIP_EPS))
        with torch.no_grad():
            for grad in grads:
                local_shard(grad).mul_(factor)
    return norm
