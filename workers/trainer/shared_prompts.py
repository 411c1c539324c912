"""log pi of the completion tokens: sequences packed end to end, each prompt's forward shared by its samples.

A step's samples come in groups of `groupSize` completions of one prompt. The reference path
(policy.token_logprobs) runs prompt + completion for every sample, right-padded; here nothing is padded.
One forward runs every distinct prompt once and every sample's completion inputs (all but its last token),
all concatenated into one row: the prompts first, each at positions 0.., then the completions, each at the
positions after its prompt. In every layer a prompt's queries see its own keys, and a completion's see its
prompt's keys followed by its own, gathered from the layer's keys, so the gradient of every completion flows
back into the one prompt forward. The attention is `packed_attention`, a transformers attention function that
takes the batch's layout (`Layout`) from the forward's kwargs and attends within each segment only
(variable-length attention): no [length, length] score or mask exists for the batch, and on a GPU none at
all (flash). The result is the same computation as the reference (same loss, same gradients, to float
rounding): every token sees the same tokens at the same positions. (The prompts once had a forward of their
own: a second pass of every layer on the host for a few tokens while the GPU waited, which made a 1B model's step
on an H200 16% longer.)

Only the positions that predict a completion token reach the output layer: in one plain pass when their
float32 logits fit in free memory, else `chunk_tokens` at a time, each chunk recomputed in the backward.
"""

from __future__ import annotations

import array
import functools
import inspect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from rlfleet.workers.rl.sampling import sampled_logprobs
from rlfleet.workers.trainer.memory import free_bytes

# The trainer registers this method with FSDP2 so that its root parameters (embedding, final norm,
# output layer) are gathered around it as they are around forward().
FORWARD_METHOD = "rlfleet_completion_logprobs"
ATTENTION = "rlfleet_packed"
"""The attention implementation the trainer loads models with (`from_pretrained(attn_implementation=ATTENTION)`)."""
# Share of free memory the output layer's float32 logits (and the copies softmax and its backward make,
# LOGIT_COPIES in all) may take for log pi to be computed in one plain pass instead of chunks.
LOGITS_SHARE = 0.25
LOGIT_COPIES = 4
# Queries per attention call on the segment-by-segment path: its scores and mask are [heads, block, keys],
# linear in the length.
QUERY_BLOCK = 256
FLASH_DTYPES = (torch.bfloat16, torch.float16)
# Torch's CPU attention gives a query a result that differs in the last bit with how many keys its call holds (the
# first 40 rows of a causal call over 40 or 47 keys differ from the same rows over 48 or more), not only with those
# it sees. With every CPU call's keys padded (masked) to a multiple of KEY_ALIGN it is the same in any batch, and as
# vLLM's CPU attention computes it: in bfloat16 a last-bit difference in a few attention outputs sends the log-probs
# 0.02 nats apart (BENCHMARKS.md).
KEY_ALIGN = 16


@dataclass(frozen=True)
class Layout:
    """Where the segments (prompts, then completions) lie in the packed row, for `packed_attention` (the
    `rlfleet_layout` kwarg).

    Queries of segment i are rows ``query_starts[i]:query_starts[i+1]``; its keys and values are rows
    ``key_starts[i]:key_starts[i+1]`` of the layer's keys gathered by `key_index`. A query sees every key of its
    segment up to its own position, the segment's last query its last key (causal, aligned bottom-right).
    """

    query_starts: Tensor
    """``[S + 1]`` int32 cumulative query lengths."""
    key_starts: Tensor
    """``[S + 1]`` int32 cumulative key lengths."""
    longest_query: int
    longest_key: int
    key_index: Tensor
    """``[sum keys]`` segment after segment, the rows of the layer's keys it sees: a prompt its own, a completion
    its prompt's then its own."""
    query_ends: tuple[int, ...]
    key_ends: tuple[int, ...]
    """The same boundaries as Python ints, for the segment-by-segment path (no device sync)."""


@dataclass(frozen=True)
class SharedBatch:
    """A micro-batch packed end to end: distinct prompts once, then every sample's completion inputs."""

    ids: Tensor
    """``[sum P + sum C']`` the distinct prompts one after the other, then the completion tokens fed to the model:
    all but each sample's last (its first is predicted from its prompt's last position)."""
    positions: Tensor
    """``[sum P + sum C']`` a prompt's positions 0..P-1, a completion's the positions after its prompt."""
    key_index: Tensor
    """``[sum P + sum (P + C')]`` Layout.key_index."""
    predictors: Tensor
    """``[T]`` per completion token, the row of the forward's output predicting it."""
    targets: Tensor
    """``[T]`` the completion tokens, sample after sample."""
    completion_mask: Tensor
    """``[B, C]`` bool, True on real completion tokens: the per-token tensors below are right-padded per sample,
    since sequence-level losses (GSPO's ratio) reduce over each sample's tokens."""
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
    query_ends: tuple[int, ...]
    """Cumulative query lengths of the segments from 0: every prompt, then every sample that feeds any token."""
    key_ends: tuple[int, ...]
    """Cumulative key lengths of the same segments (a completion's: its prompt's and its own), from 0."""

    def to(self, device: torch.device | str) -> SharedBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return SharedBatch(**{name: v.to(device) if isinstance(v, Tensor) else v for name, v in moved.items()})

    def layout(self) -> Layout:
        return _layout(self.query_ends, self.key_ends, self.key_index)


def pack_shared(samples: Sequence) -> SharedBatch:
    """Pack samples (policy.Sample) end to end, equal prompt_ids once."""
    rows: dict[tuple[int, ...], int] = {}
    group = [rows.setdefault(tuple(s.prompt_ids), len(rows)) for s in samples]
    prompts = list(rows)
    prompt_ends = list(itertools.accumulate(map(len, prompts), initial=0))
    ids = [t for p in prompts for t in p]
    positions = [t for p in prompts for t in range(len(p))]
    key_index, query_ends, key_ends, predictors = list(range(len(ids))), list(prompt_ends), list(prompt_ends), []
    for row, sample in zip(group, samples):
        start, length, fed = prompt_ends[row], len(prompts[row]), len(sample.completion_ids) - 1
        first = len(ids)  # this sample's first completion row
        if sample.completion_ids:
            predictors.append(start + length - 1)
            predictors += range(first, first + fed)
        if fed <= 0:
            continue
        ids += sample.completion_ids[:-1]
        positions += range(length, length + fed)
        key_index += range(start, start + length)
        key_index += range(first, first + fed)
        query_ends.append(query_ends[-1] + fed)
        key_ends.append(key_ends[-1] + length + fed)
    targets = [t for s in samples for t in s.completion_ids]
    return SharedBatch(_long(ids), _long(positions), _long(key_index), _long(predictors), _long(targets),
                       *_per_token(samples), tuple(query_ends), tuple(key_ends))


def shared_cost(samples: Sequence) -> int:
    """Tokens one forward of these samples processes: each distinct prompt once, and every completion but its
    last token (nothing is padded)."""
    prompts = {tuple(s.prompt_ids) for s in samples}
    return sum(map(len, prompts)) + sum(max(0, len(s.completion_ids) - 1) for s in samples)


def completion_logprobs(lm: nn.Module, batch: SharedBatch, temperature: float, top_p: float,
                        chunk_tokens: int) -> Tensor:
    """``[B, C]`` float32 log pi of each completion token under the sampling distribution (0 where masked).

    `lm` is a Hugging Face causal LM of the Llama family (`lm.model` the decoder, `lm.lm_head` the output layer)
    loaded with attn_implementation=ATTENTION.
    """
    impl = lm.config._attn_implementation
    if impl != ATTENTION:
        raise ValueError(f"packed batches need attn_implementation={ATTENTION!r}, the model uses {impl!r}")
    hidden = lm.model(input_ids=batch.ids[None], position_ids=batch.positions[None], use_cache=False,
                      rlfleet_layout=batch.layout()).last_hidden_state[0]
    return completion_head(lm, hidden, batch, temperature, top_p, chunk_tokens)


def completion_head(lm: nn.Module, hidden: Tensor, batch: SharedBatch, temperature: float, top_p: float,
                    chunk_tokens: int) -> Tensor:
    """``[B, C]`` log pi of each completion token from the decoder's final ``[tokens, H]`` hidden states (after its
    norm): only the rows that predict a completion token reach the output layer."""
    predicting = hidden.index_select(0, batch.predictors)
    flat = head_logprobs(_output_layer(lm), predicting, batch.targets, temperature, top_p, chunk_tokens)
    mask = batch.completion_mask
    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)


def _output_layer(lm: nn.Module) -> nn.Module:
    """`lm`'s output layer, with the final logit softcap of a model that has one (Gemma 2's forward applies it after
    lm_head: the trainer, which calls the layer itself, must too)."""
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return _SoftcappedHead(lm.lm_head, cap) if cap else lm.lm_head


class _SoftcappedHead(nn.Module):
    def __init__(self, head: nn.Linear, cap: float):
        super().__init__()
        self.head, self.cap, self.out_features = head, cap, head.out_features

    def forward(self, hidden: Tensor) -> Tensor:
        return self.cap * torch.tanh(self.head(hidden) / self.cap)


def head_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, top_p: float,
                  chunk_tokens: int) -> Tensor:
    """``[T]`` log pi of `targets` from ``[T, H]`` hidden states: in one plain pass when the float32 logits fit in
    LOGITS_SHARE of the device's free memory (no recomputation), else `chunked_logprobs`. Same result either way."""
    logit_bytes = hidden.shape[0] * head.out_features * 4 * LOGIT_COPIES
    if logit_bytes <= LOGITS_SHARE * free_bytes(hidden.device):
        return _head_logprobs(head, hidden, targets, temperature, top_p)
    return chunked_logprobs(head, hidden, targets, temperature, top_p, chunk_tokens)


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


def packed_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float, dropout: float = 0.0, rlfleet_layout: Layout | None = None,
                     rlfleet_round_to: torch.dtype | None = None, **kwargs) -> tuple[Tensor, None]:
    """The attention of a model loaded with ATTENTION: per segment of `rlfleet_layout` (see Layout). Without a layout
    (a padded batch: the reference path, evaluation, the torch engine) it is transformers' SDPA attention. Given
    `rlfleet_round_to` (models/forward.py ROUND_TO), it attends in float32 from its inputs rounded to that dtype and
    rounds its output once, as vLLM's CPU attention does."""
    if rlfleet_round_to is None:
        return _attention(module, query, key, value, attention_mask, scaling, dropout, rlfleet_layout, **kwargs)
    query, key, value = (t.to(rlfleet_round_to).float() for t in (query, key, value))
    out, _ = _attention(module, query, key, value, attention_mask, scaling, dropout, rlfleet_layout, **kwargs)
    return out.to(rlfleet_round_to), None


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               scaling: float, dropout: float, rlfleet_layout: Layout | None, **kwargs) -> tuple[Tensor, None]:
    if rlfleet_layout is None:
        if not query.is_cuda:
            key, value, attention_mask = _aligned_keys(key, value, attention_mask, query.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("packed attention has no dropout: the trainer keeps it off so that pi equals mu")
    layout = rlfleet_layout
    # [1, heads, tokens, dim] -> [tokens, heads, dim]; keys and values segment after segment
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    k, v = k.index_select(0, layout.key_index), v.index_select(0, layout.key_index)
    # Gemma 2's attention logit softcap (a tanh of every score) has no flash kernel here; a sliding window does.
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if q.is_cuda and q.dtype in FLASH_DTYPES and not softcap:
        return _flash(q, k, v, layout, scaling, window)[None], None
    return _by_segment(q, k, v, layout, scaling, window, softcap)[None], None


def _flash(q: Tensor, k: Tensor, v: Tensor, layout: Layout, scaling: float, window: int | None = None) -> Tensor:
    """Flash variable-length attention, causal: flash aligns the causal mask bottom-right when a segment has more
    keys than queries, so query t of a completion sees its whole prompt and its own keys 0..t; with a sliding
    `window` (Mistral's, Gemma 2's), only the last `window` of them, itself included. Older torch (2.11) lacks some
    arguments: then the KV heads are repeated for each query head, and the scale is applied to q."""
    from torch.nn.attention.varlen import varlen_attn

    accepted = _varlen_arguments()
    if "window_size" in accepted:
        options = {"window_size": (window - 1 if window else -1, 0)}
    elif window and window < layout.longest_key:
        raise ValueError(f"a sliding window of {window} tokens needs torch's varlen_attn with window_size (torch >= "
                         f"2.12): this torch has {torch.__version__}")
    else:
        options = {"is_causal": True}
    if "enable_gqa" in accepted:
        options["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if "scale" in accepted:
        options["scale"] = scaling
    else:  # the kernel's own scale is 1/sqrt(head dim)
        q = q * (scaling * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, layout.query_starts, layout.key_starts, layout.longest_query, layout.longest_key,
                       **options)


@functools.cache
def _varlen_arguments() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _by_segment(q: Tensor, k: Tensor, v: Tensor, layout: Layout, scaling: float, window: int | None = None,
                softcap: float | None = None) -> Tensor:
    """SDPA segment by segment, QUERY_BLOCK queries at a time (CPUs, float32 on a GPU): scores and mask of one block,
    ``[heads, block, keys]``. In the inputs' dtype: on a 2-core CPU, segments of 15 x 75 and 256 x 320 ran forward
    and backward 6% and 17% faster in bfloat16 than upcast to float32. A sliding `window` masks keys more than
    `window` - 1 before the query; a `softcap` (Gemma 2) bounds each score by softcap * tanh(score / softcap)."""
    # [heads, tokens, dim], cut into segments by one split each: slicing every segment out of the whole would
    # make each slice's backward zero-fill a gradient of the whole (40% of the tiny model's profiled CPU step).
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    queries = q.split(_lengths(layout.query_ends), dim=1)
    keys, values = (t.split(_lengths(layout.key_ends), dim=1) for t in (k, v))
    out = []
    for q_seg, k_seg, v_seg in zip(queries, keys, values):
        offset = k_seg.shape[1] - q_seg.shape[1]  # keys before the first query's own
        k_seg, v_seg = (F.pad(t, (0, 0, 0, -t.shape[1] % KEY_ALIGN)) for t in (k_seg, v_seg))
        for block in range(0, q_seg.shape[1], QUERY_BLOCK):
            stop = min(block + QUERY_BLOCK, q_seg.shape[1])
            seen = _align(offset + stop)  # the keys past the block's last query's are masked
            rows = torch.arange(block, stop, device=q.device)[:, None] + offset
            columns = torch.arange(seen, device=q.device)[None]
            mask = (columns <= rows) & (columns > rows - window) if window else columns <= rows
            block_keys, block_values = k_seg[:, :seen], v_seg[:, :seen]
            if softcap:
                out.append(_softcapped(q_seg[:, block:stop], block_keys, block_values, mask, scaling, softcap))
            else:
                # In four dimensions: three-dimensional inputs take another CPU kernel, which rounds otherwise
                out.append(F.scaled_dot_product_attention(q_seg[None, :, block:stop], block_keys[None],
                                                          block_values[None], attn_mask=mask, scale=scaling,
                                                          enable_gqa=True)[0])
    return torch.cat(out, dim=1).transpose(0, 1)


def _aligned_keys(key: Tensor, value: Tensor, mask: Tensor | None,
                  queries: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """`key` and `value` (``[batch, heads, keys, dim]``) padded to a multiple of KEY_ALIGN keys, which `mask` hides
    (without a mask, the last query sees every key and each query before it one key fewer)."""
    pad = -key.shape[2] % KEY_ALIGN
    if not pad:
        return key, value, mask
    if mask is None:
        rows = torch.arange(queries, device=key.device)[:, None] + key.shape[2] - queries
        mask = torch.arange(key.shape[2], device=key.device)[None] <= rows
    hidden = False if mask.dtype == torch.bool else float("-inf")
    key, value = (F.pad(t, (0, 0, 0, pad)) for t in (key, value))
    return key, value, F.pad(mask, (0, pad), value=hidden)


def _align(keys: int) -> int:
    return -(-keys // KEY_ALIGN) * KEY_ALIGN


def _softcapped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float) -> Tensor:
    """Attention with Gemma 2's logit softcap, as its eager attention computes it (softmax in float32)."""
    k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scale / softcap)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32)
    return weights.to(q.dtype) @ v


def _layout(query_ends: tuple[int, ...], key_ends: tuple[int, ...], key_index: Tensor) -> Layout:
    starts = torch.tensor([query_ends, key_ends], dtype=torch.int32, device=key_index.device)
    return Layout(starts[0], starts[1], max(_lengths(query_ends)), max(_lengths(key_ends)), key_index, query_ends,
                  key_ends)


def _lengths(ends: Sequence[int]) -> list[int]:
    return [b - a for a, b in zip(ends, ends[1:])]


def _long(values: Sequence[int]) -> Tensor:
    return _tensor(values, torch.long)


ARRAY_TYPES = {torch.long: "q", torch.float32: "f", torch.bool: "B"}


def _tensor(values: Sequence, dtype: torch.dtype) -> Tensor:
    """A 1-D tensor of `values` through a typed array: a third of torch.tensor's time on a list of Python numbers."""
    data = array.array(ARRAY_TYPES[dtype], values)
    return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _per_token(samples: Sequence) -> tuple[Tensor, ...]:
    """completion_mask, gen_logprobs, sampled, trained, ref_logprobs and advantages, ``[B, C]`` right-padded. Each
    from one flat list (a tensor per sample and field took 20 ms of host time for 512 short samples)."""
    lengths = [len(s.completion_ids) for s in samples]
    mask = torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]

    def spread(values: list, dtype: torch.dtype) -> Tensor:
        return torch.zeros(mask.shape, dtype=dtype).masked_scatter_(mask, _tensor(values, dtype))

    def flat(field: str) -> list:
        return [x for s in samples for x in getattr(s, field)]

    # A sample without a reference's log-probs (or with one advantage) fills its row with 0 (or that advantage).
    ref_logprobs = [x for s, n in zip(samples, lengths) for x in (s.ref_logprobs or [0.0] * n)]
    advantages = [x for s, n in zip(samples, lengths) for x in (s.token_advantages or [float(s.advantage)] * n)]
    return (mask, spread(flat("gen_logprobs"), torch.float32), spread(flat("sampled"), torch.bool),
            spread(flat("trained"), torch.bool), spread(ref_logprobs, torch.float32),
            spread(advantages, torch.float32))


def _mask(attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """No mask for a packed pass (`packed_attention` knows its segments); SDPA's for a padded batch."""
    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTENTION, packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _mask)


def register_for_fsdp(lm: nn.Module) -> None:
    """Make `completion_logprobs` an FSDP2 forward method of the (sharded) root module `lm`."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(lm, FORWARD_METHOD, functools.partial(completion_logprobs, lm))
    register_fsdp_forward_method(lm, FORWARD_METHOD)


def forward_of(lm: nn.Module):
    """`completion_logprobs` bound to `lm`, through FSDP's hooks when `lm` is sharded."""
    return getattr(lm, FORWARD_METHOD, None) or functools.partial(completion_logprobs, lm)


def checkpoint_layers(layers: Iterable[nn.Module]) -> None:
    """Activation checkpointing: each decoder layer keeps only its input and is recomputed in the backward.

    Wraps the layer's own forward, so parameter names stay as they are (the sync plan and checkpoints use
    them) and FSDP's per-layer hooks stay around the recomputation.
    """
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def _head_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, top_p: float) -> Tensor:
    return sampled_logprobs(head(hidden), targets, temperature, top_p)
