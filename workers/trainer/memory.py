"""A trainer or critic pod whose memory limit cannot hold what its ranks load is refused at start, with the field
to raise, instead of being killed for memory over and over without a word (exit 137, CrashLoopBackOff).

The bound is a floor, not an estimate of the peak: every rank loads the whole model in float32 on the host before
it moves it to its device and shards it. A limit under that is clearly too small, whatever else the pod needs.

Also here: the device's free memory, and the micro-batch token budget chosen from it when microBatchTokens is unset.
"""

from __future__ import annotations

import math
from pathlib import Path

# cgroup v2, then v1 (where "no limit" is a huge number of bytes).
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
CGROUP_USAGE = ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")
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


def free_bytes(device) -> int:
    """Bytes a new tensor on `device` (a torch.device) may take now: on a GPU what the driver has free plus what
    torch's allocator holds unused; on a CPU the kernel's MemAvailable, or less under a container's limit."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    available = _mem_available()
    limit = memory_limit()
    if limit is not None:
        available = min(available, limit - (_cgroup_usage() or 0))
    return max(0, available)


# Per token and decoder layer, what a training forward keeps for the backward, in hidden- and intermediate-sized
# vectors of the compute dtype: norms, q/k/v, attention output, residuals (~10 hidden); the MLP's gate, up, their
# product and activation (~4 intermediate). Checkpointing keeps one hidden vector per layer, plus one layer's whole
# set while it is recomputed.
HIDDEN_VECTORS = 10
INTERMEDIATE_VECTORS = 4
# The budget assumes a token costs this many times the estimate (the output layer's chunks, allocator fragmentation,
# float32 norms) and leaves the rest of free memory to what the estimate does not count.
SAFETY = 2.0
FREE_SHARE = 0.8
MIN_TOKENS = 256
MAX_TOKENS = 10**8  # config.Training.micro_batch_tokens' bound


def token_budget(config, dtype_bytes: int, checkpointing: bool, free: int, training_bytes: int) -> int:
    """Tokens per micro-batch that fit in `free` bytes, less `training_bytes` (gradients and optimizer state not
    allocated yet), for a Llama-like `config` (hidden_size, intermediate_size, num_hidden_layers)."""
    layer = (HIDDEN_VECTORS * config.hidden_size + INTERMEDIATE_VECTORS * config.intermediate_size) * dtype_bytes
    if checkpointing:
        per_token = config.num_hidden_layers * config.hidden_size * dtype_bytes + layer
    else:
        per_token = config.num_hidden_layers * layer
    tokens = int((free * FREE_SHARE - training_bytes) / (per_token * SAFETY))
    return min(MAX_TOKENS, max(MIN_TOKENS, tokens))


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _cgroup_usage() -> int | None:
    for path in CGROUP_USAGE:
        try:
            return int(Path(path).read_text(encoding="ascii").strip())
        except OSError:
            continue
    return None
