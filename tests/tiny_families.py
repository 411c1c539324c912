"""Tiny random models of the families users train, each built from its own transformers config with the project's
character tokenizer (workers/models/tiny.py): what every family test loads, nothing downloaded.

Shapes are chosen so each family exercises what sets it apart while every check runs at generator TP 2: four query
heads over two kv heads (grouped-query attention, two kv heads per TP rank at most), head_dim 32 (vLLM's CPU
attention), and a sliding window of 8 tokens wherever the family has one, so a sequence of a few dozen tokens
reaches past it.
"""

from __future__ import annotations

from pathlib import Path

from rlfleet.workers.models.tiny import MAX_POSITIONS, SPECIAL_TOKENS, CHARACTERS, special_token_ids, write_random

SLIDING_WINDOW = 8
SHAPE = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "intermediate_size": 256, "max_position_embeddings": MAX_POSITIONS}
# family -> (transformers config class, what that family sets apart).
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),  # the reference, here with grouped-query heads
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),  # biases on q/k/v
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False}),  # RMSNorm of q and k per head
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": SLIDING_WINDOW}),
    # sqrt(hidden)-scaled embeddings, (1 + w) norms, tied head, query_pre_attn_scalar, attention and final logit
    # softcapping, sliding-window layers alternating with global ones.
    "gemma2": ("Gemma2Config", {"sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 1,
                                "attn_logit_softcapping": 1.0, "final_logit_softcapping": 1.0}),
    # Fused qkv_proj and gate_up_proj in HF's own checkpoint.
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),
}
# Gemma scales its embeddings (also its output layer) by sqrt(hidden): at the usual init std of 0.02 they drown the
# layers, and greedy output repeats the last token whatever the layers hold. Tests of greedy output build it so.
GREEDY_INIT = {"gemma2": {"initializer_range": 0.002}}


def build_family(family: str, out_dir: Path, seed: int = 0, **shape) -> Path:
    """A random float32 model of `family` (a key of FAMILIES) with the character tokenizer, saved into out_dir;
    `shape` overrides SHAPE's fields."""
    import transformers

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(**(SHAPE | shape), **extra, **special_token_ids(),
                                         vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS), dtype="float32")
    write_random(config, seed, out_dir)
    return Path(out_dir)
