"""Where and in what dtype a trainer rank works, decided on CPU: its GPU, its compute and master dtypes,
and the hook that keeps a weight push whole."""

from __future__ import annotations


import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.workers.sync.shards import SyncSettings
from rlfleet.workers.trainer.policy import train_step
from rlfleet.workers.world import rank_device

from conftest import make_job
from trainer_samples import Sample


SAMPLES = [Sample([1, 2, 3], [4, 5], [-3.0, -3.0], 1.0), Sample([6, 7], [8, 9, 10], [-3.5, -3.0, -2.5], -1.0)]


def test_each_rank_takes_its_own_gpu():
    assert rank_device(0, {"LOCAL_RANK": "3"}) == torch.device("cpu")
    assert rank_device(1, {}) == torch.device("cuda", 0)  # not launched by torchrun: one GPU per pod
    assert rank_device(4, {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)


def test_the_wire_carries_the_jobs_dtype():
    job = make_job(model={"type": "tiny", "dtype": "bfloat16"})
    assert SyncSettings.from_job(job).dtype == "bfloat16"


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_the_forward_computes_in_the_jobs_dtype_while_weights_and_adam_stay_float32(compute):
    model = _model()
    seen: set[torch.dtype] = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(model, optimizer, SAMPLES, temperature=1.0, top_p=1.0, grad_clip=1.0, pad_id=0,
                         compute_dtype=compute)
    assert seen == {compute}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {v.dtype for state in optimizer.state.values() for v in state.values() if v.dim()} == {torch.float32}
    assert metrics["tokens"] == 5 and all(map(torch.isfinite, map(torch.tensor, metrics.values())))
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_push_is_released_before_the_optimizer_changes_the_weights():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = next(model.parameters())
    at_release = []
    train_step(model, optimizer, SAMPLES, temperature=1.0, top_p=1.0, grad_clip=1.0, pad_id=0,
               before_update=lambda: at_release.append(first.detach().clone()))
    assert len(at_release) == 1 and not torch.equal(at_release[0], first), "the hook ran after the step"
