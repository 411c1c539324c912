"""Atomic trainer checkpoints: ``root/step-000123/`` = HF model dir (a peft adapter dir for LoRA runs) +
optimizer.pt + state.json, and ``root/best/``, the weights that scored best on the held-out set.

A checkpoint is written into a temporary sibling, fsynced, then renamed into place, so a crash
leaves either the whole checkpoint or a ``.tmp-*`` dir that nothing reads. One writer per root
(trainer rank 0) is assumed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from torch import nn

from rlfleet.workers.models import weight_files

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
# peft's adapter files: what a LoRA run's checkpoints hold instead of model.safetensors.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The trainer's checkpoints, under its run directory.
CHECKPOINTS_DIR = "checkpoints"
# The checkpoint that scored best on the held-out set, beside the step-NNNNNN ones.
BEST_DIR = "best"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Files that make a tokenizer loadable; copied so the checkpoint is a complete HF directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    state: dict[str, Any],
    keep: int,
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``root/step-<step:06d>/`` atomically, then keep only the newest ``keep`` checkpoints.

    ``weights`` and ``optimizer_state`` are full (gathered) state dicts: the trainer's own are
    sharded. ``model`` gives the HF config, or is a peft model whose adapters ``weights`` are (a peft
    adapter directory is written). ``state`` is the controller's JSON state (policy version, data
    position, ...); ``step`` is added to it. Returns the checkpoint's path.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if state.get("step", step) != step:
        raise ValueError(f"state['step']={state['step']} differs from step={step}")
    root = Path(root)
    final = _write_atomically(root, f"step-{step:06d}", model, weights, {**state, "step": step}, tokenizer_dir,
                              lambda tmp: torch.save(optimizer_state, tmp / OPTIMIZER_FILE))
    _prune(root, keep)
    return final


def save_best(root: str | os.PathLike[str], model: nn.Module, weights: dict[str, torch.Tensor], state: dict[str, Any],
              tokenizer_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write ``root/best/`` atomically: the weights that scored best on the held-out set, as a loadable
    directory like a checkpoint's, without optimizer state (it is never resumed from)."""
    return _write_atomically(Path(root), BEST_DIR, model, weights, state, tokenizer_dir, lambda tmp: None)


def best_state(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The state ``root/best/`` was saved with (its version and held-out scores); {} without one."""
    path = Path(root) / BEST_DIR / STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_atomically(root: Path, name: str, model: nn.Module, weights: dict[str, torch.Tensor],
                      state: dict[str, Any], tokenizer_dir: str | os.PathLike[str] | None,
                      extra: Callable[[Path], None]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():  # left by an earlier crash of a process that had our pid (pid 1 in containers)
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp, state_dict=_untied(model, weights))  # always safetensors in transformers 5
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), tmp)
    extra(tmp)
    # Written last: a step dir without state.json is never taken for a checkpoint.
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    _fsync_tree(tmp)
    final = root / name
    _move_into_place(tmp, final)
    _fsync_dir(root)
    log.info("checkpoint %s written", final)
    return final


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = _complete_checkpoints(Path(root))
    return found[-1][1] if found else None


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(full weights, full optimizer state, controller state) of a checkpoint, for the trainer to load."""
    path = Path(path)
    optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    return _read_weights(path), optimizer_state, json.loads((path / STATE_FILE).read_text())


def _untied(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied copies (lm_head = embed_tokens) are stored once, as save_pretrained does for a live model."""
    if getattr(model.config, "tie_word_embeddings", False):
        return {name: tensor for name, tensor in weights.items() if name != "lm_head.weight"}
    return weights


def _copy_tokenizer(source: Path, target: Path) -> None:
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if not copied:
        raise FileNotFoundError(f"{source}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    for name in copied:
        shutil.copyfile(source / name, target / name)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = [path / ADAPTER_WEIGHTS] if (path / ADAPTER_WEIGHTS).is_file() else weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def _move_into_place(tmp: Path, final: Path) -> None:
    if not final.exists():
        os.rename(tmp, final)
        return
    # Rewriting the same step (after a restart): a directory cannot be replaced atomically, so
    # move the old one aside first and delete it only once the new one is in place.
    aside = final.with_name(f"{TMP_PREFIX}old-{final.name}-{os.getpid()}")
    if aside.exists():
        shutil.rmtree(aside)
    os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside)


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _prune(root: Path, keep: int) -> None:
    for _, old in _complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
        log.info("checkpoint %s pruned", old)
    # With one writer per root, any other temp dir is what a crashed writer left behind.
    ours = f"-{os.getpid()}"
    for entry in root.iterdir():
        if entry.name.startswith(TMP_PREFIX) and not entry.name.endswith(ours) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            log.info("stale temporary checkpoint %s removed", entry)


def _fsync_tree(directory: Path) -> None:
    for dirpath, _, filenames in os.walk(directory):
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry itself reaches the disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
