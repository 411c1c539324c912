"""models/forward.py: fused RMS norms compute what Llama's own do, and only replace norms that compute it; rounding
as vLLM's CPU kernels changes nothing in float32."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rlfleet.workers.models.forward import round_as_cpu_kernels, use_fused_norms
from rlfleet.workers.trainer.shared_prompts import ATTENTION

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def _model(config_class, model_class, dtype, attention="sdpa"):
    torch.manual_seed(0)
    model = model_class(config_class(**SHAPE, attn_implementation=attention)).to(dtype)
    for name, parameter in model.named_parameters():
        if "norm" in name:  # ones at initialisation: make the product with the weight count
            parameter.data.normal_(1.0, 0.5)
    return model


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, norms", [((LlamaConfig, LlamaForCausalLM), 5), ((Qwen3Config, Qwen3ForCausalLM), 9)])
def test_fused_norms_give_the_models_logits_and_gradients(family, norms, dtype, device):
    """Bit for bit on a CPU; within rounding on a GPU, whose fused kernel sums the squares in another order."""
    model = _model(*family, dtype).to(device)
    fused = copy.deepcopy(model)
    assert use_fused_norms(fused) == norms  # two a layer and the final one; Qwen3's q and k norms too
    ids = torch.randint(0, 64, (2, 12), device=device)
    outputs = [m(input_ids=ids).logits for m in (model, fused)]
    for out in outputs:
        out.float().square().mean().backward()
    _same(outputs[1], outputs[0], device, "logits")
    for (name, a), b in zip(model.named_parameters(), fused.parameters()):
        _same(b.grad, a.grad, device, name)


def _same(actual: torch.Tensor, expected: torch.Tensor, device: str, what: str) -> None:
    if device == "cuda":
        torch.testing.assert_close(actual, expected, msg=what)
    else:
        assert torch.equal(actual, expected), what


def test_a_norm_of_other_arithmetic_is_left_alone():
    """Gemma 2's norm multiplies by 1 + weight in float32: not Llama's."""
    assert use_fused_norms(_model(Gemma2Config, Gemma2ForCausalLM, torch.float32)) == 0


@pytest.mark.parametrize("family", [(LlamaConfig, LlamaForCausalLM), (Qwen3Config, Qwen3ForCausalLM)])
def test_rounding_as_vllms_cpu_kernels_changes_nothing_in_float32(family):
    """The layers it rounds add, normalise and attend in float32 as before: the same logits and gradients, bit for
    bit (in bfloat16, test_trainer_passes and test_logprob_parity)."""
    model = _model(*family, torch.float32, ATTENTION)
    rounded = copy.deepcopy(model)
    assert round_as_cpu_kernels(rounded) == 2
    ids = torch.randint(0, 64, (2, 20))
    outputs = [m(input_ids=ids).logits for m in (model, rounded)]
    for out in outputs:
        out.square().mean().backward()
    assert torch.equal(outputs[1], outputs[0])
    for (name, a), b in zip(model.named_parameters(), rounded.parameters()):
        assert torch.equal(b.grad, a.grad), name


def test_rounding_as_vllms_cpu_kernels_needs_the_trainers_attention():
    """Another attention function would take the layer's request to round and ignore it."""
    with pytest.raises(ValueError, match=ATTENTION):
        round_as_cpu_kernels(_model(LlamaConfig, LlamaForCausalLM, torch.float32))
