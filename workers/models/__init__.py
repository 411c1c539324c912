"""Model specs to HF-format directories that both vLLM and transformers load.

`materialize(spec, cache_dir)` builds, converts or fetches at most once per cache (storage.cache.build_once).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from rlfleet.workers.models.config import HFModel, SmolLM2Model, TinyModel
from rlfleet.workers.storage.cache import build_once, default_cache_dir
from rlfleet.workers.storage.fetch import fetched_tree

log = logging.getLogger(__name__)

# Part of the tiny models' cache key: bump it when build_tiny changes, so old builds are not reused.
TINY_BUILD_VERSION = 1
SMOLLM2_DIR = "smollm2-135m-instruct"


class ModelNotFound(FileNotFoundError):
    """An `hf` model path that is missing or not a HF-format directory."""


def materialize(model_spec: TinyModel | HFModel | SmolLM2Model, cache_dir: Path | None = None) -> Path:
    """A HF-format directory (config.json, safetensors, tokenizer, generation config) for the spec."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if model_spec.type == "tiny":
        from rlfleet.workers.models.tiny import build_tiny

        target = cache_dir / f"tiny-{tiny_key(model_spec)}"
        return build_once(target, lambda out: build_tiny(model_spec, out))
    elif model_spec.type == "hf" and model_spec.uri:
        return _check_hf_dir(fetched_tree(model_spec.uri, cache_dir), f"model.uri {model_spec.uri!r}")
    elif model_spec.type == "hf":
        return _check_hf_dir(Path(model_spec.path).expanduser(), f"model.path {model_spec.path!r}")
    elif model_spec.type == "smollm2":
        from rlfleet.workers.models.smollm2 import convert_smollm2

        return build_once(cache_dir / SMOLLM2_DIR, convert_smollm2)
    raise ValueError(f"unknown model type {model_spec.type!r}")


def tiny_key(spec: TinyModel) -> str:
    """Short stable hash of the spec: equal specs share one build."""
    # dtype is left out: the directory is float32 either way, workers cast when they load it.
    text = f"{TINY_BUILD_VERSION}:{spec.model_dump_json(exclude={'dtype'})}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF model directory: one, or the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # save_pretrained splits large models
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [directory / "model.safetensors"]


def _check_hf_dir(directory: Path, field: str) -> Path:
    if not directory.is_dir():
        raise ModelNotFound(f"{field}: no such directory")
    if not (directory / "config.json").is_file():
        raise ModelNotFound(f"{field}: no config.json, not a HF-format model directory")
    return directory
