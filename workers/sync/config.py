"""DDMA weight sync settings (`spec.weightSync`). Torch-free: part of the RLJob schema."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.workers.strict import Strict

class WeightSync(Strict):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl when the roles have GPUs, else gloo."""
    bucket_mb: int = Field(64, ge=1, le=16384, alias="bucketMB")
    """Size of each preallocated flat transfer bucket, MiB."""
    timeout_seconds: float = Field(120.0, gt=0.0, le=3600.0)
    """Deadline of every sync collective."""
    snapshot: bool = False
    """Send large blocks from a copy made when the push starts rather than straight from the live weights.
    Off, the optimizer step waits for sends still reading the weights, which costs nothing while generators
    receive as they generate (BENCHMARKS.md); on, it steps at once, for a copy of the large blocks and its
    memory: for generators that take weights only between generate calls (vLLM multiprocess or tensor-parallel)."""
    verify: bool = False
    """Check every push by content: trainers send a checksum of what they sent (per bucket and block, an exact
    sum of the bit patterns) and each generator refuses a version whose content differs (the replica is marked
    down and rejoins). Costs one read of the pushed weights on each side."""
