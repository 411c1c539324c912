"""A generator's merge of pushed LoRA factors equals, bit for bit, the checkpoint merged by peft (`rlfleet merge`,
`rlfleet eval`) as an engine loads it in the model's dtype: the held-out accuracy of the best checkpoint is that of
the weights `rlfleet eval` scores."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rlfleet.workers.sync.plan import GeneratorLayout
from rlfleet.workers.sync.receiving import AdapterReceiver, base_regions
from rlfleet.workers.sync.shards import SyncSettings
from rlfleet.workers.trainer import lora
from rlfleet.workers.trainer.config import Lora

from conftest import make_job

SPEC = Lora(rank=4, alpha=8.0)


class Factors:
    """The pushed factors as the receiver holds them after a receive (in the wire's dtype)."""

    def __init__(self, targets: dict[str, torch.Tensor]):
        self.targets = targets

    def receive(self) -> None:
        pass


def _adapter_checkpoint(tmp_path) -> torch.nn.Module:
    """The base model saved in float32, and the trainer's model (adapters attached) saved as an adapter checkpoint."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    wrapped = lora.attach(lm, SPEC)
    with torch.no_grad():  # a small update, as after some steps at a LoRA learning rate
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 1e-3)
    wrapped.save_pretrained(tmp_path / "adapter")
    return lm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_generators_merge_is_the_merged_checkpoint_in_the_models_dtype(tmp_path, dtype):
    lm = _adapter_checkpoint(tmp_path)
    wire = getattr(torch, SyncSettings.from_job(make_job(model={"type": "tiny", "dtype": "bfloat16"},
                                                         training={"lora": {"rank": 4, "alpha": 8.0}})).dtype)
    shards = {name: shard.to(wire) for name, shard in lora.push_shards(lm, lora.scale_of(SPEC)).items()}
    weights = sorted({name.replace(".lora_A", "").replace(".lora_B", "") for name in shards})
    layout = GeneratorLayout(1, 64)
    receiver = AdapterReceiver(Factors(shards), *base_regions(tmp_path / "base", weights, layout, 0, "cpu"),
                               layout, 0, dtype)
    receiver.receive()
    merged = lora.merge(tmp_path / "adapter", tmp_path / "merged").joinpath("model.safetensors")
    from safetensors.torch import load_file

    expected = {name: tensor.to(dtype) for name, tensor in load_file(merged).items()}
    assert weights and all(torch.equal(receiver.targets[name], expected[name]) for name in weights), \
        sum(int((receiver.targets[n] != expected[n]).sum()) for n in weights)
