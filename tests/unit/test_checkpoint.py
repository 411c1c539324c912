"""Atomic checkpoints: round trip, pruning, and what latest_checkpoint must ignore."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch.testing import assert_close
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlfleet.workers.trainer.checkpoint import latest_checkpoint, read_checkpoint, save_checkpoint


def tiny_model(seed: int, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def trained(seed: int, tied: bool = False) -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    """A model and an AdamW that has taken one step, so the optimizer has state to save."""
    model = tiny_model(seed, tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def save(root, step, model, optimizer, keep=2, **kwargs):
    state = {"policy_version": step, "data_position": 8 * step}
    return save_checkpoint(root, step, model, model.state_dict(), optimizer.state_dict(), state, keep, **kwargs)


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_restores_weights_optimizer_and_state(tmp_path, tied):
    model, optimizer = trained(0, tied)
    path = save(tmp_path, 3, model, optimizer)
    assert path == tmp_path / "step-000003"
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()

    fresh = tiny_model(1, tied)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    weights, optimizer_state, state = read_checkpoint(path)
    missing, unexpected = fresh.load_state_dict(weights, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if tied else [])
    fresh_optimizer.load_state_dict(optimizer_state)

    assert state == {"step": 3, "policy_version": 3, "data_position": 24}
    assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    assert_close(restored["state"], saved["state"], rtol=0, atol=0)
    if tied:  # the tie survives the load
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_checkpoint_is_a_loadable_hf_directory(tmp_path):
    vocab = {f"t{i}": i for i in range(32)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))
    tokenizer.save_pretrained(tmp_path / "tok")
    model, optimizer = trained(0)
    path = save(tmp_path / "ckpt", 5, model, optimizer, tokenizer_dir=tmp_path / "tok")

    assert AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("t7") == 7
    loaded = LlamaForCausalLM.from_pretrained(path)
    assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)


def test_keep_prunes_to_the_newest(tmp_path):
    model, optimizer = trained(0)
    for step in (1, 2, 3, 10):
        save(tmp_path, step, model, optimizer, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000010"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000010"


def test_latest_ignores_temp_and_incomplete_dirs(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    model, optimizer = trained(0)
    save(tmp_path, 4, model, optimizer)
    (tmp_path / ".tmp-step-000009-12345").mkdir()
    (tmp_path / ".tmp-step-000009-12345" / "state.json").write_text("{}")
    (tmp_path / "step-000010").mkdir()  # a crash before state.json, or someone else's dir
    (tmp_path / "step-000011").write_text("not a directory")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000004"


def test_stale_temp_dir_is_cleaned_and_same_step_is_replaced(tmp_path):
    model, optimizer = trained(0)
    stale = tmp_path / f".tmp-step-000002-{os.getpid() + 1}"
    stale.mkdir()
    save(tmp_path, 2, model, optimizer)
    assert not stale.exists()
    save_checkpoint(tmp_path, 2, model, model.state_dict(), optimizer.state_dict(), {"policy_version": 7}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    state = json.loads((tmp_path / "step-000002" / "state.json").read_text())
    assert state == {"step": 2, "policy_version": 7}


def test_state_step_must_agree(tmp_path):
    model, optimizer = trained(0)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, 2, model, model.state_dict(), optimizer.state_dict(), {"step": 3}, keep=1)
