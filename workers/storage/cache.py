"""The worker cache ($RLFLEET_CACHE): built, converted and fetched models and data, each made at most once.

`build_once(target, build)` makes the target in a temp directory beside it and renames it into place, under a
file lock (flock), so workers sharing a cache (one machine, or pods sharing a claim) never see a half-written
tree and never make it twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """$RLFLEET_CACHE, else ~/.cache/rlfleet."""
    return Path(os.environ.get("RLFLEET_CACHE") or Path.home() / ".cache" / "rlfleet").expanduser()


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
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
