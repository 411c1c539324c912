"""What the trainer, the torch engine and the trainer bench change in a loaded Hugging Face causal LM so that each
computes its forward the same way, and without needless kernels: float32 logits (rl/sampling.py) and fused RMS
norms. Parameters keep their names (weight pushes and checkpoints go by them)."""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rlfleet.workers.rl.sampling import use_float32_logits


def align_forward(lm: nn.Module) -> None:
    """Float32 logits and fused norms in `lm`, as every side computes them."""
    use_float32_logits(lm)
    use_fused_norms(lm)


def use_fused_norms(lm: nn.Module) -> int:
    """Make every norm of `lm` that computes Llama's RMS norm (Mistral's, Qwen's: the same code) one fused
    normalisation and a product with its weight; returns how many. Llama's own is seven element-wise kernels forward
    and more backward, the largest share of a bfloat16 step's element-wise time on an H200. The result is the same:
    the normalisation in float32, rounded to the input's dtype, then times the weight (bit for bit on a CPU)."""
    norms = [module for module in lm.modules() if _is_llama_norm(type(module))]
    for norm in norms:
        norm.forward = functools.partial(_fused_rms_norm, norm)
    return len(norms)


def _fused_rms_norm(norm: nn.Module, hidden: Tensor) -> Tensor:
    return norm.weight * F.rms_norm(hidden, (hidden.shape[-1],), eps=norm.variance_epsilon)


@functools.cache
def _is_llama_norm(cls: type) -> bool:
    forward, llama = getattr(cls.forward, "__code__", None), LlamaRMSNorm.forward.__code__
    return forward is not None and (forward.co_code, forward.co_consts, forward.co_names) == (
        llama.co_code, llama.co_consts, llama.co_names)
