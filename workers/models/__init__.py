"""Model specs to HF-format directories that both vLLM and transformers load.

`materialize(spec, cache_dir)` builds or converts at most once per cache: the build goes into a temp
directory beside the target and is renamed into place, under a file lock (flock), so workers sharing
a cache never see a half-written model and never build it twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from rlfleet.workers.spec import HFModel, SmolLM2Model, TinyModel

log = logging.getLogger(__name__)

# Part of the tiny models' cache key: bump it when build_tiny changes, so old builds are not reused.
TINY_BUILD_VERSION = 1
SMOLLM2_DIR = "smollm2-135m-instruct"


class ModelNotFound(FileNotFoundError):
    """An `hf` model path that is missing or not a HF-format directory."""


def default_cache_dir() -> Path:
    """Where built and converted models live: $RLFLEET_CACHE, else ~/.cache/rlfleet."""
    return Path(os.environ.get("RLFLEET_CACHE") or Path.home() / ".cache" / "rlfleet").expanduser()


def materialize(model_spec: TinyModel | HFModel | SmolLM2Model, cache_dir: Path | None = None) -> Path:
    """A HF-format directory (config.json, safetensors, tokenizer, generation config) for the spec."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if model_spec.type == "tiny":
        from rlfleet.workers.models.tiny import build_tiny

        target = cache_dir / f"tiny-{tiny_key(model_spec)}"
        return _build_once(target, lambda out: build_tiny(model_spec, out))
    elif model_spec.type == "hf":
        return _check_hf_dir(model_spec.path)
    elif model_spec.type == "smollm2":
        from rlfleet.workers.models.smollm2 import convert_smollm2

        return _build_once(cache_dir / SMOLLM2_DIR, convert_smollm2)
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


def _check_hf_dir(path: str) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ModelNotFound(f"model.path {path!r}: no such directory")
    if not (directory / "config.json").is_file():
        raise ModelNotFound(f"model.path {path!r}: no config.json, not a HF-format model directory")
    return directory


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Run build(temp_dir) and rename it to target, unless target exists; safe across processes."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if target.is_dir():  # another process finished it while we waited
            return target
        # Holding the lock, any temp dir left beside the target is from a builder that was killed.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        log.info("building %s", target)
        temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(temp)
            _make_readable(temp)
            os.rename(temp, target)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    return target


def _make_readable(directory: Path) -> None:
    # mkdtemp makes 0700 and safetensors writes 0600; a shared cache must be readable by other users.
    os.chmod(directory, 0o755)
    for path in directory.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    # The lock file is never deleted: unlinking it would let a late process lock a different inode.
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
