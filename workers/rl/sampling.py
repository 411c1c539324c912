"""The distribution generators sample from, and the trainer's log pi under that same distribution.

The rule, shared by the torch engine (which samples with it), the trainer (which scores with it) and
vLLM 0.32 with ``logprobs_mode="processed_logprobs"`` (``Sampler.sample`` in ``vllm/v1/sample/sampler.py``,
then ``apply_top_k_top_p_pytorch`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``):

1. divide the logits, computed in float32 from the output layer on every side (`float32_logits`; vLLM's
   ``head_dtype: float32``), by the temperature;
2. top-p: sort the scaled logits ascending, take the softmax's cumulative sum, and drop every token
   whose cumulative sum is ``<= 1 - top_p`` (float32): what stays is the smallest set of most likely
   tokens holding at least ``top_p`` of the mass. The most likely token always stays;
3. renormalise over the tokens that stay (``log_softmax`` with the others at ``-inf``).

Ties: when n tokens tie at the least kept value, only as many (k) stay as the mass needs. vLLM keeps k
too: on CPUs whichever its sort left last, on GPUs the lowest token ids (``topk_topp_triton.py``). The
torch engine keeps the lowest ids. The trainer cannot know which k an engine kept, only that the sampled
token was one of them, so it weighs each other tie by its chance of being kept, (k - 1)/(n - 1) (k/n when
the target is not tied): the normaliser is the same whichever k were kept. Float32 logits rarely tie;
bfloat16 logits often do.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Rows sorted at once when finding nuclei: bounds the sort's values and int64 indices to ~50 MB
# whatever the batch, instead of a [B, L, V] sort.
SORT_CHUNK_ELEMENTS = 1 << 22


def processed_logits(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """``[..., V]`` float32 logits of the distribution sampled from: scaled, ``-inf`` outside the nucleus.

    What the torch engine samples from and reports log mu of (its ``log_softmax``).
    """
    _check(temperature, top_p)
    scaled = _scaled(logits, temperature)
    if top_p < 1.0:
        scaled.masked_fill_(outside_nucleus(scaled, top_p), float("-inf"))
    return scaled


def float32_logits(head: nn.Linear, hidden: Tensor) -> Tensor:
    """``[..., V]`` logits of the output layer `head` computed in float32, whatever its weights' dtype and
    autocast's. Rounded to bfloat16, logits of the usual magnitudes (16 to 32) move by up to 1/16; the
    trainer and the generator rounding differently made ~0.01 nats of their per-token log-prob gap.
    vLLM's counterpart: ``head_dtype: float32`` (engines/vllm_engine.py)."""
    # On a GPU, the operands in the dtype the matmul would run in (autocast's, else the weights'), the product float32.
    low = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else head.weight.dtype
    if hidden.is_cuda and low in LOW_PRECISION and head.bias is None:
        with torch.autocast("cuda", enabled=False):
            flat = _Float32Product.apply(hidden.reshape(-1, hidden.shape[-1]).to(low), head.weight.to(low))
        return flat.view(*hidden.shape[:-1], head.weight.shape[0])  # -1 is ambiguous for no rows
    bias = None if head.bias is None else head.bias.float()
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), head.weight.float(), bias)


LOW_PRECISION = (torch.bfloat16, torch.float16)


class _Float32Product(torch.autograd.Function):
    """``hidden @ weight.T`` of bfloat16 (or float16) operands, accumulated and returned in float32 by CUDA's
    ``mm(out_dtype=)``: the float32 product near the low-precision matmul's speed (on an H200, a 2048 x 49152 head
    over 8192 tokens: forward and backward 14 ms, 11 ms with bfloat16 logits, 103 ms casting both operands to
    float32). ``mm(out_dtype=)`` has no derivative: the backward multiplies in the operands' dtype, as autocast's
    would (gradients within 5e-4 of the float32 product's)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        hidden, weight = ctx.saved_tensors
        grad = grad.to(hidden.dtype)
        return grad @ weight, grad.t() @ hidden


def use_float32_logits(lm: nn.Module) -> None:
    """Make the output layer of the causal LM `lm` compute in float32 (`float32_logits`) wherever it is called:
    a full forward, Hugging Face's generate, the trainer's chunked log pi. Its parameters keep their names."""
    head = lm.get_output_embeddings()
    head.forward = functools.partial(float32_logits, head)


def sampled_logprobs(logits: Tensor, targets: Tensor, temperature: float, top_p: float) -> Tensor:
    """``[...]`` float32 log-prob of each target under the sampling distribution (module docstring).

    The target is always in the support: float differences between the engine's forward and this one
    can move a sampled token just past the nucleus boundary, and a ``-inf`` (or, through ``w * A *
    log pi``, a NaN) would poison the loss. Such a token is scored under the nucleus plus itself.

    Gradients flow through the temperature and the renormalisation, with the nucleus held fixed (the
    set of kept tokens is a step function of the logits, with zero gradient almost everywhere).

    Args:
        logits: ``[..., V]`` raw logits, any float dtype (may require grad).
        targets: ``[...]`` int64 token ids.
        temperature: > 0.
        top_p: in (0, 1]; 1 skips the sort and costs nothing over ``log_softmax(logits / T)``.
    """
    _check(temperature, top_p)
    if top_p < 1.0:
        scaled = _scaled(logits, temperature)
        drop, tie_ids, tie_log_shares = _scored_support(scaled, targets, top_p)
        scaled.masked_fill_(drop, float("-inf"))
        if len(tie_ids):  # float32 logits rarely tie: no in-place step, nor its backward, for nothing
            scaled.put_(tie_ids, tie_log_shares, accumulate=True)
    else:
        scaled = logits.float() if temperature == 1.0 else _scaled(logits, temperature)
    # logit[target] - logsumexp: never materialises a [..., V] log-softmax.
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - scaled.logsumexp(dim=-1)


@torch.no_grad()
def outside_nucleus(scaled: Tensor, top_p: float) -> Tensor:
    """``[..., V]`` bool: True for the tokens an engine does not sample from ``softmax(scaled)``."""
    drop = torch.empty(scaled.shape, dtype=torch.bool, device=scaled.device).view(-1, scaled.shape[-1])
    for start, chunk in _row_chunks(scaled):
        least, kept_ties = _boundary(chunk, top_p)
        tied = chunk == least
        surplus = tied & (tied.cumsum(dim=-1) > kept_ties)  # the lowest token ids stay
        drop[start : start + len(chunk)] = (chunk < least) | surplus
    return drop.view(scaled.shape)


@torch.no_grad()
def _scored_support(scaled: Tensor, targets: Tensor, top_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """What the trainer drops (below the least kept value, never the target), and the flat index and log
    share of each token tied at that value where only some ties stay.

    The engine kept the target, so the other k - 1 kept ties are some of the other n - 1: each of those
    counts (k - 1) / (n - 1) in the normaliser (k / n each when the target is not tied).
    """
    vocab = scaled.shape[-1]
    drop = torch.empty(scaled.shape, dtype=torch.bool, device=scaled.device).view(-1, vocab)
    flat_targets = targets.reshape(-1, 1)
    tie_ids, tie_log_shares = [], []
    for start, chunk in _row_chunks(scaled):
        least, kept_ties = _boundary(chunk, top_p)
        chunk_targets = flat_targets[start : start + len(chunk)]
        drop[start : start + len(chunk)] = chunk < least
        others = (chunk == least).scatter_(-1, chunk_targets, False)
        target_tied = chunk.gather(-1, chunk_targets) == least
        kept_others = kept_ties - target_tied.long()
        other_ties = others.sum(dim=-1, keepdim=True)
        rows, columns = (others & (kept_others < other_ties)).nonzero(as_tuple=True)
        tie_ids.append((start + rows) * vocab + columns)
        tie_log_shares.append((kept_others[rows, 0] / other_ties[rows, 0]).log())
    drop = drop.view(scaled.shape)
    drop.scatter_(-1, targets.unsqueeze(-1), False)
    return drop, torch.cat(tie_ids), torch.cat(tie_log_shares)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` in float32, in one fresh tensor that callers may change in place."""
    # Copy then divide in place: a bfloat16 input never has two float32 copies alive at once.
    return logits.to(torch.float32, copy=True).div_(temperature)


def _row_chunks(scaled: Tensor) -> Iterator[tuple[int, Tensor]]:
    """``(first row, rows)`` of the ``[N, V]`` view of ``scaled``, a bounded number of elements at a time."""
    rows = scaled.reshape(-1, scaled.shape[-1])
    step = max(1, SORT_CHUNK_ELEMENTS // scaled.shape[-1])
    # No rows is still one (empty) chunk: callers concatenate what the chunks give.
    for start in range(0, max(1, rows.shape[0]), step):
        yield start, rows[start : start + step]


def _boundary(rows: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """``[N, V]`` -> ``[N, 1]`` each: the least scaled logit the nucleus keeps, and how many of the tokens
    holding exactly that value it keeps."""
    vocab = rows.shape[-1]
    ascending = rows.sort(dim=-1).values
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    # 1 - p in float32, as vLLM computes it; cumulative sums never decrease, so dropped tokens are a prefix.
    dropped = (cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32)).sum(dim=-1, keepdim=True)
    dropped.clamp_(max=vocab - 1)  # the most likely token always stays
    least = ascending.gather(-1, dropped)
    kept_ties = vocab - dropped - (rows > least).sum(dim=-1, keepdim=True)
    return least, kept_ties


def _check(temperature: float, top_p: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
