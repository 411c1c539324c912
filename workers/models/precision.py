"""`model.dtype: auto`: bfloat16 where matrices multiply fast in it, float32 elsewhere. Torch-free.

Trainers and generators must agree on the dtype (it is the weight push's wire dtype). The processes of a local run
share one CPU, so each resolves `auto` by it at start (`weights_dtype`); the operator resolves it once for all pods,
by the job's GPUs alone (it cannot see the CPUs of the nodes its pods will land on).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.workers.generator.pools import generator_pools

if TYPE_CHECKING:
    from rlfleet.workers.spec import RLJob

# AMX multiplies bfloat16 tiles: a bfloat16 matmul ran 7x faster than a float32 one on such a CPU, while one
# without bfloat16 instructions (AVX2) ran it 17x slower (BENCHMARKS.md, bfloat16 on CPUs).
FAST_BFLOAT16_FLAG = "amx_bf16"
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_fast_bfloat16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this machine's CPU has AMX's bfloat16 tiles (Linux's `amx_bf16` flag)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return FAST_BFLOAT16_FLAG in flags


def resolve_dtype(job: RLJob, fast_cpu_bfloat16: bool) -> RLJob:
    """The job with `model.dtype: auto` made bfloat16 when its trainers and generators all run on GPUs or on
    CPUs with fast bfloat16 (`fast_cpu_bfloat16`), float32 otherwise; any other job as it is."""
    spec = job.spec
    if spec.model.dtype != "auto":
        return job
    roles = (spec.roles.trainer, *(pool.role for pool in generator_pools(spec)))
    fast = all(role.resources.gpu or fast_cpu_bfloat16 for role in roles)
    model = spec.model.model_copy(update={"dtype": "bfloat16" if fast else "float32"})
    return job.model_copy(update={"spec": spec.model_copy(update={"model": model})})


def weights_dtype(job: RLJob) -> str:
    """`model.dtype` as this machine runs it: `auto` resolved by its CPU (the operator resolves it for pods)."""
    return resolve_dtype(job, cpu_has_fast_bfloat16()).spec.model.dtype
