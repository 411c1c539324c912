"""A tiny random Llama with a character tokenizer, built locally so tests never download anything.

Tokenizer contract (decided here, relied on by render_prompt and the trainer):
- one character = one token; characters outside the vocabulary become `<unk>`;
- no special token is added automatically (no post-processor, BOS/EOS never inserted), so
  `decode(tokenizer(text)["input_ids"]) == text` for any text in the vocabulary, and the token ids the
  generator sees are exactly the prompt's characters; the model learns to emit `</s>` to stop;
- a minimal chat template (`user: ...\\nassistant: `), written only with vocabulary characters, so
  `template: chat` jobs also run on tiny models.
"""

from __future__ import annotations

import logging
import string
from pathlib import Path

from rlfleet.workers.models.config import TinyModel

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0, 1, 2, 3
CHARACTERS = string.digits + "+-*/=?.,:;!()" + " \n" + string.ascii_lowercase + string.ascii_uppercase
# Long enough for prompts plus completions in tests; RoPE needs no extra weights for it.
MAX_POSITIONS = 512
# A tiny model for tool environments (TinyModel.toolCalls): what a JSON tool call needs, and room for its chat.
TOOL_CHARACTERS = '<>{}[]"_'
TOOL_MAX_POSITIONS = 2048
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# A tool-calling tiny model's: an assistant turn ends with the end-of-text token the model ends its turns with, so
# a multi-turn chat renders the model's own tokens as their exact prefix (environment/episode.py).
TOOL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ message['content'] }}", "{{ message['content'] }}{{ '" + EOS + "' if message['role'] == 'assistant' }}")


def build_tiny(spec: TinyModel, out_dir: Path) -> None:
    """Write a HF-format directory (float32 safetensors, tokenizer, generation config) into out_dir."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **special_token_ids(),
        vocab_size=len(SPECIAL_TOKENS) + len(characters(spec.tool_calls)),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=TOOL_MAX_POSITIONS if spec.tool_calls else MAX_POSITIONS,
        tie_word_embeddings=spec.tie_embeddings,
        dtype="float32",
    )
    write_random(config, spec.seed, out_dir, build_tokenizer(spec.tool_calls))


def characters(tool_calls: bool = False) -> str:
    return CHARACTERS + (TOOL_CHARACTERS if tool_calls else "")


def special_token_ids() -> dict[str, int]:
    """The tokenizer's BOS, EOS and PAD ids as config fields (every model family names them alike)."""
    return {f"{name}_token_id": SPECIAL_TOKENS.index(token) for name, token in (("bos", BOS), ("eos", EOS),
                                                                                 ("pad", PAD))}


def write_random(config, seed: int, out_dir: Path, tokenizer=None) -> None:
    """A randomly initialised float32 model of this transformers config (any causal LM family), saved with the
    character tokenizer and a generation config into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    tokenizer = tokenizer or build_tokenizer()
    # fork_rng: seed the initialisation without changing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info("built tiny model (%d parameters) in %s", model.num_parameters(), out_dir)


def build_tokenizer(tool_calls: bool = False):
    """The character tokenizer as a transformers fast tokenizer (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(characters(tool_calls)))}
    # BPE without merges and without a pre-tokenizer splits any text into single characters,
    # spaces and newlines included.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=TOOL_MAX_POSITIONS if tool_calls else MAX_POSITIONS,
        chat_template=TOOL_CHAT_TEMPLATE if tool_calls else CHAT_TEMPLATE,
    )
