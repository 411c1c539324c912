"""A trainer or critic pod whose memory limit cannot hold what its ranks load is refused at start, with the field
to raise, instead of being killed for memory over and over without a word (exit 137, CrashLoopBackOff).

The bound is a floor, not an estimate of the peak: every rank loads the whole model in float32 on the host before
it moves it to its device and shards it. A limit under that is clearly too small, whatever else the pod needs.
"""

from __future__ import annotations

import math
from pathlib import Path

# cgroup v2, then v1 (where "no limit" is a huge number of bytes).
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
NO_LIMIT = 1 << 60
FLOAT32_BYTES = 4
# The size suggested is the floor with this much room for everything else a rank holds.
HEADROOM = 1.25
GIB = 1 << 30


class NotEnoughMemory(RuntimeError):
    pass


def memory_limit(paths: tuple[str, ...] = CGROUP_LIMITS) -> int | None:
    """Bytes this container may use, or None without a limit (a machine or session of its own)."""
    for path in paths:
        try:
            text = Path(path).read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text == "max":
            return None
        return int(text) if int(text) < NO_LIMIT else None
    return None


def parameter_count(model_dir: Path) -> int | None:
    """Elements of every tensor in the model's safetensors files (headers only); None for other formats."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total


def check_memory(role: str, ranks_in_pod: int, model_dir: Path, limit: int | None) -> None:
    """Raise NotEnoughMemory, naming spec.roles.<role>.resources.memory, when `limit` cannot hold the floor."""
    params = parameter_count(model_dir)
    if limit is None or params is None:
        return
    floor = ranks_in_pod * params * FLOAT32_BYTES
    if floor > limit:
        raise NotEnoughMemory(
            f"spec.roles.{role}.resources.memory: this pod may use {limit / GIB:.1f} GiB, but each of its "
            f"{ranks_in_pod} {role} rank(s) loads the model's {params / 1e9:.2f} B parameters in float32 before "
            f"sharding them ({floor / GIB:.1f} GiB in all): set it to at least {math.ceil(floor * HEADROOM / GIB)}Gi")
