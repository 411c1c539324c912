"""log pi of the completion tokens, each prompt's forward shared by the samples that answer it.

A step's samples come in groups of `groupSize` completions of one prompt. Today's reference path
(policy.token_logprobs) runs prompt + completion for every sample; here each distinct prompt runs
once, its keys and values are handed to the completions that follow it, and the gradient of every
completion flows back into that one prompt forward. The result is the same computation (same loss,
same gradients, to float rounding): the rows of a right-padded batch see the same tokens at the same
positions. Only the positions that predict a completion token reach the output layer, a chunk of
`chunk_tokens` at a time and recomputed in the backward, so `[batch, length, vocab]` logits never exist.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache, DynamicLayer

from rlfleet.workers.rl.sampling import sampled_logprobs

# The trainer registers this method with FSDP2 so that its root parameters (embedding, final norm,
# output layer) are gathered around it as they are around forward().
FORWARD_METHOD = "rlfleet_completion_logprobs"
ATTENTION = ("sdpa", "eager")


def attention_for(device: torch.device, compute_dtype: torch.dtype) -> str:
    """The attention the trainer loads: eager for bfloat16 on a CPU, whose fused (SDPA) attention backward is
    4x slower in bfloat16 than in float32 (BENCHMARKS.md, bfloat16 on CPUs); SDPA elsewhere."""
    return "eager" if device.type == "cpu" and compute_dtype == torch.bfloat16 else "sdpa"


@dataclass(frozen=True)
class SharedBatch:
    """Distinct prompts, and per sample its prompt's row and its completion, right-padded."""

    prompt_ids: Tensor
    """``[G, P]`` each distinct prompt once."""
    prompt_mask: Tensor
    """``[G, P]`` 1 on real prompt tokens."""
    prompt_lengths: Tensor
    """``[G]``."""
    group: Tensor
    """``[B]`` row of each sample's prompt."""
    inputs: Tensor
    """``[B, C']`` the completion tokens fed to the model: all but the last (the first is predicted from the
    prompt's last position); C' >= 1, so every micro-batch runs the same forward calls (FSDP needs that)."""
    targets: Tensor
    """``[B, C]`` the completion tokens."""
    completion_mask: Tensor
    """``[B, C]`` bool, True on real completion tokens."""
    gen_logprobs: Tensor
    """``[B, C]`` float32 log mu of each completion token (0 elsewhere, or where not sampled)."""
    sampled: Tensor
    """``[B, C]`` bool, True where the policy sampled the completion token."""
    trained: Tensor
    """``[B, C]`` bool, True where the completion token enters the loss."""
    ref_logprobs: Tensor
    """``[B, C]`` float32 log pi_ref of each completion token (0 elsewhere, or without a reference)."""
    advantages: Tensor
    """``[B, C]`` float32 advantage of each completion token (0 elsewhere)."""

    def to(self, device: torch.device | str) -> SharedBatch:
        return SharedBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def pack_shared(samples: Sequence, pad_id: int) -> SharedBatch:
    """Pack samples (policy.Sample) so that equal prompt_ids are one prompt row."""
    rows: dict[tuple[int, ...], int] = {}
    group = [rows.setdefault(tuple(s.prompt_ids), len(rows)) for s in samples]
    prompts = list(rows)
    longest = max(len(s.completion_ids) for s in samples)
    prompt_ids, prompt_mask = _right_padded(prompts, max(map(len, prompts)), pad_id)
    inputs, _ = _right_padded([s.completion_ids[:-1] for s in samples], max(1, longest - 1), pad_id)
    targets, completion_mask = _right_padded([s.completion_ids for s in samples], longest, pad_id)
    gen_logprobs = torch.zeros(targets.shape, dtype=torch.float32)
    sampled = torch.zeros(targets.shape, dtype=torch.bool)
    trained = torch.zeros(targets.shape, dtype=torch.bool)
    ref_logprobs = torch.zeros(targets.shape, dtype=torch.float32)
    advantages = torch.zeros(targets.shape, dtype=torch.float32)
    for row, sample in enumerate(samples):
        gen_logprobs[row, : len(sample.gen_logprobs)] = torch.tensor(list(sample.gen_logprobs), dtype=torch.float32)
        sampled[row, : len(sample.sampled)] = torch.tensor(list(sample.sampled), dtype=torch.bool)
        trained[row, : len(sample.trained)] = torch.tensor(list(sample.trained), dtype=torch.bool)
        ref_logprobs[row, : len(sample.ref_logprobs)] = torch.tensor(list(sample.ref_logprobs), dtype=torch.float32)
        advantages[row, : len(sample.completion_ids)] = (
            torch.tensor(list(sample.token_advantages), dtype=torch.float32) if sample.token_advantages
            else float(sample.advantage))
    return SharedBatch(prompt_ids, prompt_mask, torch.tensor([len(p) for p in prompts]), torch.tensor(group),
                       inputs, targets, completion_mask.bool(), gen_logprobs, sampled, trained, ref_logprobs,
                       advantages)


def shared_cost(samples: Sequence) -> int:
    """Tokens one forward of these samples processes, padding included: each distinct prompt once."""
    prompts = {tuple(s.prompt_ids) for s in samples}
    longest = max(len(s.completion_ids) for s in samples)
    return len(prompts) * max(map(len, prompts)) + len(samples) * max(1, longest - 1)


def completion_logprobs(lm: nn.Module, batch: SharedBatch, temperature: float, top_p: float,
                        chunk_tokens: int) -> Tensor:
    """``[B, C]`` float32 log pi of each completion token under the sampling distribution (0 where masked).

    `lm` is a Hugging Face causal LM of the Llama family (`lm.model` the decoder, `lm.lm_head` the output layer).
    """
    impl = lm.config._attn_implementation
    if impl not in ATTENTION:
        raise ValueError(f"prompt sharing needs attention {' or '.join(ATTENTION)}, the model uses {impl!r}")
    recorded = Cache(layer_class_to_replicate=_Recording)
    prompt = lm.model(input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask, past_key_values=recorded,
                      use_cache=False).last_hidden_state
    prefix = Cache(layers=[_Prefix(layer.keys[batch.group], layer.values[batch.group]) for layer in recorded.layers])
    positions = batch.prompt_lengths[batch.group, None] + torch.arange(batch.inputs.shape[1], device=batch.inputs.device)
    completion = lm.model(input_ids=batch.inputs, attention_mask=_completion_mask(batch, impl, prompt.dtype),
                          position_ids=positions, past_key_values=prefix, use_cache=False).last_hidden_state
    # Token 0 is predicted from the prompt's last position, token t from the completion's position t - 1.
    last = prompt[batch.group, batch.prompt_lengths[batch.group] - 1]
    width = batch.targets.shape[1]
    predicting = torch.cat([last[:, None], completion], dim=1)[:, :width]
    mask = batch.completion_mask
    flat = chunked_logprobs(lm.lm_head, predicting[mask], batch.targets[mask], temperature, top_p, chunk_tokens)
    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)


def chunked_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, top_p: float,
                     chunk_tokens: int) -> Tensor:
    """``[T]`` log pi of `targets` from ``[T, H]`` hidden states, `chunk_tokens` rows of logits at a time.

    Each chunk's logits are recomputed in the backward instead of kept: memory holds one chunk's
    ``[chunk, vocab]`` float32 logits (and the sort of the top-p path) at a time, for one more pass of the
    output layer. An empty `hidden` still yields a (zero-size) result tied to the graph, so a micro-batch
    without completion tokens backpropagates (zeros) through every layer like the others.
    """
    parts = [checkpoint(_head_logprobs, head, h, t, temperature, top_p, use_reentrant=False)
             for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))]
    return torch.cat(parts)


def register_for_fsdp(lm: nn.Module) -> None:
    """Make `completion_logprobs` an FSDP2 forward method of the (sharded) root module `lm`."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(lm, FORWARD_METHOD, functools.partial(completion_logprobs, lm))
    register_fsdp_forward_method(lm, FORWARD_METHOD)


def forward_of(lm: nn.Module):
    """`completion_logprobs` bound to `lm`, through FSDP's hooks when `lm` is sharded."""
    return getattr(lm, FORWARD_METHOD, None) or functools.partial(completion_logprobs, lm)


def checkpoint_layers(lm: nn.Module) -> None:
    """Activation checkpointing: each decoder layer keeps only its input and is recomputed in the backward.

    Wraps the layer's own forward, so parameter names stay as they are (the sync plan and checkpoints use
    them) and FSDP's per-layer hooks stay around the recomputation. The caches above are written so that a
    recomputed layer reads and records the same keys and values again.
    """
    for layer in lm.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def _head_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, top_p: float) -> Tensor:
    return sampled_logprobs(head(hidden), targets, temperature, top_p)


def _completion_mask(batch: SharedBatch, impl: str, dtype: torch.dtype) -> Tensor:
    """``[B, 1, C', P + C']``: each completion position sees its prompt's real tokens and, causally, its own
    completion. Built here, since HF's mask would take the positions (which start after each prompt) for
    indices into the padded keys."""
    width = batch.inputs.shape[1]
    prompt = batch.prompt_mask[batch.group].bool()[:, None, :].expand(-1, width, -1)
    causal = torch.ones(width, width, dtype=torch.bool, device=prompt.device).tril()
    allowed = torch.cat([prompt, causal.expand(prompt.shape[0], -1, -1)], dim=-1)[:, None]
    if impl == "sdpa":  # boolean: True takes part
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


class _Recording(DynamicLayer):
    """Keeps the prompt's keys and values of one layer. Overwritten, not appended: a layer recomputed by
    activation checkpointing records the same tensors again."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states


class _Prefix(DynamicLayer):
    """The prompt's keys and values in front of the completion's; nothing is stored, so a recomputation
    sees the same prefix."""

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.dtype, self.device = keys.dtype, keys.device

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _right_padded(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[Tensor, Tensor]:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[index, : len(row)] = 1
    return ids, mask
