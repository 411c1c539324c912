"""LoRA through peft: adapters on the trainer, only the adapters on the wire, adapter checkpoints that merge into a
full HF directory.

Names: peft calls a factor `<module>.lora_A.default.weight` inside the model and
`base_model.model.<module>.lora_A.weight` in its files; the weight push calls it `<module>.lora_A.weight`
(sync/plan.py), with B already multiplied by alpha / rank so that the generator adds plain B A.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from rlfleet.workers.sync.plan import LORA_B, adapted_weight
from rlfleet.workers.trainer.checkpoint import ADAPTER_CONFIG, TOKENIZER_FILES
from rlfleet.workers.trainer.config import Lora

log = logging.getLogger(__name__)
ADAPTER = "default"  # peft's name for the one adapter
FILE_PREFIX = "base_model.model."


def attach(lm: nn.Module, spec: Lora) -> nn.Module:
    """Wrap `lm` in a peft model whose only trainable parameters are adapters (B starts at zero: the policy
    starts as the base model, which is what the generators load)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                        lora_dropout=0.0, bias="none")
    return get_peft_model(lm, config)


def push_name(name: str) -> str:
    """The weight push's name of a parameter of the model peft wrapped."""
    return name.replace(f".{ADAPTER}.", ".")


def push_shapes(lm: nn.Module) -> dict[str, tuple[int, ...]]:
    return {push_name(name): tuple(p.shape) for name, p in lm.named_parameters() if p.requires_grad}


def push_shards(lm: nn.Module, scale: float) -> dict[str, torch.Tensor]:
    """This rank's piece of every factor (FSDP2 Shard(0) pieces, or whole), B times `scale`."""
    shards = {}
    for name, p in lm.named_parameters():
        if p.requires_grad:
            local = getattr(p, "to_local", lambda p=p: p)().detach()
            shards[push_name(name)] = local * scale if adapted_weight(push_name(name))[1] == LORA_B else local
    return shards


def scale_of(spec: Lora) -> float:
    return spec.alpha / spec.rank


def state_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter weights as read from a checkpoint's file, named as in the peft model's state dict."""
    return {name.replace(".weight", f".{ADAPTER}.weight"): tensor for name, tensor in weights.items()}


def merge(checkpoint: Path, out: Path, base: Path | None = None) -> Path:
    """Write a full HF directory: the base model (the checkpoint's own record of it unless given) with the
    checkpoint's adapters merged in, and its tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = base or Path(json.loads((checkpoint / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, checkpoint).merge_and_unload()
    merged.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)
    log.info("merged %s into %s (base %s)", checkpoint, out, base)
    return out


@contextlib.contextmanager
def loadable(model_dir: Path) -> Iterator[Path]:
    """`model_dir` itself, or for an adapter checkpoint a temporary full directory merged from it."""
    if not (model_dir / ADAPTER_CONFIG).is_file():
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="rlfleet-merged-") as temp:
        yield merge(model_dir, Path(temp))
