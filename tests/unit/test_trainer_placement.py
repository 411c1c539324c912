"""Where and in what dtype a trainer rank works, decided on CPU: its GPU, its compute and master dtypes,
and the hook that keeps a weight push whole."""

from __future__ import annotations


import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.workers.models import materialize
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port
from rlfleet.workers.sync.shards import SyncSettings
from rlfleet.workers.trainer.policy import train_step
from rlfleet.workers.trainer.worker import Trainer
from rlfleet.workers.world import rank_device

from conftest import make_job
from support import FIXED_TOKEN
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


LEARNING_RATE = 1e-3


def _job(dtype: str):
    return make_job(model={"type": "tiny", "dtype": dtype}, algorithm={"learningRate": LEARNING_RATE})


def _trainer(dtype: str, model_cache, monkeypatch) -> Trainer:
    """A one-rank trainer of the tiny model in `dtype`, its world joined in this process."""
    job = _job(dtype)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=Endpoints(""), grpc_port=0, metrics_port=0,
                        run_dir=".", token=FIXED_TOKEN)
    return Trainer(ctx, materialize(job.spec.model, model_cache))


def _trained(dtype: str, model_cache, monkeypatch) -> tuple[dict[str, float], dict[str, torch.Tensor], set]:
    """One step of a fresh trainer in `dtype`: its metrics, its weights after the step, and what the first
    layer's down_proj saw in each forward (its weight's dtype, its input's, whether autocast was on)."""
    trainer = _trainer(dtype, model_cache, monkeypatch)
    try:
        seen = set()
        trainer.lm.model.layers[0].mlp.down_proj.register_forward_pre_hook(
            lambda module, args: seen.add((module.weight.dtype, args[0].dtype, torch.is_autocast_enabled("cpu"))))
        metrics = trainer.train(SAMPLES, 0)
        masters = {p.dtype for p in trainer.lm.parameters()}
        adam = {v.dtype for state in trainer.optimizer.state.values() for v in state.values() if v.dim()}
        assert masters == adam == {torch.float32}, "master weights and AdamW state stay float32"
        weights = {name: tensor.clone() for name, tensor in trainer.snapshot().items()}
    finally:
        trainer.stop()
    return metrics, weights, seen


def test_a_bfloat16_trainer_computes_from_bfloat16_weights_without_autocast(model_cache, monkeypatch):
    _, _, seen = _trained("bfloat16", model_cache, monkeypatch)
    assert seen == {(torch.bfloat16, torch.bfloat16, False)}


def test_a_bfloat16_step_is_a_float32_step_to_bfloat16_rounding(model_cache, monkeypatch):
    from transformers import AutoModelForCausalLM

    full, half = (_trained(dtype, model_cache, monkeypatch) for dtype in ("float32", "bfloat16"))
    assert full[2] == {(torch.float32, torch.float32, False)}
    start = AutoModelForCausalLM.from_pretrained(materialize(_job("float32").spec.model, model_cache)).state_dict()
    assert half[0]["loss"] == pytest.approx(full[0]["loss"], rel=2e-2)
    assert half[0]["grad_norm"] == pytest.approx(full[0]["grad_norm"], rel=2e-2)
    # Adam's first step moves each weight by about the learning rate, either way: the two updates agree where a
    # gradient's sign does, which bfloat16 rounding flips only for gradients near zero.
    for name, weight in full[1].items():
        moved = weight - start[name]
        differ = (half[1][name] - start[name] - moved).abs()
        assert float(differ.mean()) < 0.1 * LEARNING_RATE, name
        assert moved.abs().max() > 0.5 * LEARNING_RATE, f"{name} did not move"


def test_the_push_is_released_before_the_optimizer_changes_the_weights():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = next(model.parameters())
    at_release = []
    train_step(model, optimizer, SAMPLES, temperature=1.0, top_p=1.0, grad_clip=1.0, pad_id=0,
               before_update=lambda: at_release.append(first.detach().clone()))
    assert len(at_release) == 1 and not torch.equal(at_release[0], first), "the hook ran after the step"
