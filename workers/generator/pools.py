"""The generator pools of a job (`spec.roles.generator.pools`): each pool resolved against the role's own fields,
with its replicas' indexes among the job's generators, and its tensor parallelism.

Listed pool i owns the block of generator indexes i * POOL_SLOTS onwards: its replica k is generator
i * POOL_SLOTS + k whatever the other pools' sizes, so every pool scales in place and a running replica keeps its
index (`renumbering` refuses only moving or renaming a pool that has replicas). The indexes a pool does not use are
gaps: the endpoints list "" there. Every runtime (the operator's endpoints, `rlfleet run`'s processes, the trainer's
weight pushes) uses this one numbering. A job without pools is one pool named "" of the role's own fields, numbered
0..replicas-1: today's names and numbering.

Torch-free: the operator and the planner use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.workers.generator.config import POOL_SLOTS, GeneratorPool, GeneratorRole

if TYPE_CHECKING:
    from rlfleet.workers.spec import RLJob, RLJobSpec

# GPU Feature Discovery's node label naming a node's GPUs (the product name, spaces as dashes).
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GIB = 1 << 30


@dataclass(frozen=True)
class GpuType:
    memory_gib: float
    """Memory per GPU."""
    product: str
    """The value GPU Feature Discovery writes in nvidia.com/gpu.product (the SXM or most common board)."""


GPU_TYPES = {
    "nvidia-h100-80gb": GpuType(80, "NVIDIA-H100-80GB-HBM3"),
    "nvidia-h200": GpuType(141, "NVIDIA-H200"),
    "nvidia-a100-40gb": GpuType(40, "NVIDIA-A100-SXM4-40GB"),
    "nvidia-a100-80gb": GpuType(80, "NVIDIA-A100-SXM4-80GB"),
    "nvidia-l40s": GpuType(48, "NVIDIA-L40S"),
    "nvidia-l4": GpuType(24, "NVIDIA-L4"),
    "nvidia-a10g": GpuType(24, "NVIDIA-A10G"),
}
# The share of a GPU's memory the weights may take: vLLM needs the rest for the KV cache (the more the cache
# holds, the more sequences decode together), activations and CUDA graphs.
WEIGHT_SHARE = 0.5
MAX_TP = 64
# What a pool may set for itself; the rest of a generator is the role's.
POOL_FIELDS = ("resources", "node_selector", "tolerations", "affinity", "tensor_parallel_size", "kv_cache_mb")
# Parameters of the models whose size the spec does not state otherwise.
SMOLLM2_PARAMETERS = 135_000_000
# Bytes per weight of each spec.model.dtype on a GPU (`auto` is bfloat16 there: models/precision.py).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "auto": 2}


@dataclass(frozen=True)
class Pool:
    name: str
    """"" for the job's one pool when it lists none (its objects keep the role's names)."""
    first: int
    """Its first replica's index among the job's generator replicas: its block's first (0 for the role's pool)."""
    count: int
    """Its replicas."""
    role: GeneratorRole
    """The generator role as this pool's replicas run it: the pool's fields over the role's."""
    why: str
    """How its tensorParallelSize was chosen, for `rlfleet plan --job`."""


def generator_pools(spec: RLJobSpec) -> list[Pool]:
    """Each pool of the job's generators with its replicas' global indexes, in their order."""
    role = spec.roles.generator
    if not role.pools:
        why = f"tensorParallelSize {role.tensor_parallel_size} (the role's)"
        return [Pool("", 0, role.replicas, role, why)]
    resolved = [_resolve(spec, role, pool, f"roles.generator.pools[{index}]") for index, pool in enumerate(role.pools)]
    # Each pool's role lists every pool with all its fields: resolved again (a replica's job, as_pool), they stay.
    explicit = [pool.model_copy(update={"gpu_type": None, **{name: getattr(own, name) for name in POOL_FIELDS}})
                for pool, (own, _) in zip(role.pools, resolved)]
    return [Pool(pool.name, index * POOL_SLOTS, pool.replicas, own.model_copy(update={"pools": explicit}), why)
            for index, (pool, (own, why)) in enumerate(zip(role.pools, resolved))]


def generator_indexes(spec: RLJobSpec) -> list[int]:
    """The indexes of the job's generator replicas, in order (gaps between listed pools' blocks)."""
    return [pool.first + ordinal for pool in generator_pools(spec) for ordinal in range(pool.count)]


def pool_of(spec: RLJobSpec, replica: int) -> Pool:
    """The pool generator replica `replica` (an index) belongs to, by its block: a replica past its pool's count (a
    pod not yet gone after a scale-down) still belongs to it."""
    pools = generator_pools(spec)
    return pools[min(replica // POOL_SLOTS, len(pools) - 1)] if spec.roles.generator.pools else pools[0]


def named_pool(spec: RLJobSpec, name: str) -> Pool:
    for pool in generator_pools(spec):
        if pool.name == name:
            return pool
    raise ValueError(f"no generator pool {name!r} in spec.roles.generator.pools")


def renumbering(before: RLJobSpec, after: RLJobSpec) -> str:
    """Why running `after` instead of `before` would give a running generator replica another pool, or "".

    A replica keeps its index for the life of a job (its sync store, its version, its batches), and an index is its
    pool's place in the list and its ordinal: every pool may change its replicas, pools may be added at the end, but
    a pool with replicas keeps its place and name."""
    old, new = generator_pools(before), generator_pools(after)
    for index, pool in enumerate(old):
        now = new[index].name if index < len(new) else None
        if pool.count and now != pool.name:
            field = f"spec.roles.generator.pools[{index}]" if before.roles.generator.pools else "spec.roles.generator"
            became = "gone" if now is None else f"pool {now!r}" if now else "the role's own"
            return (f"{field}: pool {pool.name or '(the role)'} runs generators {pool.first}.."
                    f"{pool.first + pool.count - 1} and would be {became}: a running job keeps each pool that has "
                    "replicas at its place in the list; scale the pool to 0 first, or add new pools at the end")
    return ""


def as_pool(job: RLJob, pool: Pool) -> RLJob:
    """The job as the pool's replicas see it: spec.roles.generator is the pool's resolved role, so code that reads
    a generator's resources, placement or tensor parallelism from the role reads its pool's."""
    roles = job.spec.roles.model_copy(update={"generator": pool.role})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"roles": roles})})


def markdown_pools(spec: RLJobSpec) -> str:
    """`rlfleet plan --job`: each generator pool, its replicas, GPUs and tensor parallelism, and why."""
    lines = ["| pool | replicas | GPU type | GPUs per pod | tensorParallelSize | why |", "|---|---|---|---|---|---|"]
    for pool in generator_pools(spec):
        indexes = f"{pool.count} (#{pool.first}..#{pool.first + pool.count - 1})" if pool.count else "0"
        product = pool.role.node_selector.get(GPU_PRODUCT_LABEL, "any")
        lines.append(f"| {pool.name or '(the role)'} | {indexes} | {product} | {pool.role.resources.gpu} | "
                     f"{pool.role.tensor_parallel_size} | {pool.why} |")
    return "\n".join(lines)


def _resolve(spec: RLJobSpec, role: GeneratorRole, pool: GeneratorPool, field: str) -> tuple[GeneratorRole, str]:
    resources = pool.resources or role.resources
    gpu_type = GPU_TYPES[pool.gpu_type] if pool.gpu_type else None
    if pool.tensor_parallel_size is not None:
        tp, why = pool.tensor_parallel_size, f"tensorParallelSize {pool.tensor_parallel_size} (the pool's)"
    elif gpu_type:
        tp, why = _fitting_tp(spec, gpu_type, f"{field}.tensorParallelSize")
    elif pool.resources is not None:
        tp = max(1, resources.gpu)
        why = f"tensorParallelSize {tp} (every GPU of the pool's pods)"
    else:
        tp, why = role.tensor_parallel_size, f"tensorParallelSize {role.tensor_parallel_size} (the role's)"
    if gpu_type and not resources.gpu:
        resources = resources.model_copy(update={"gpu": tp})  # a GPU type's pool asks for its replica's GPUs
    if resources.gpu and tp > resources.gpu:
        raise ValueError(f"{field}: tensorParallelSize {tp} needs as many GPUs, resources.gpu is {resources.gpu}: "
                         "raise resources.gpu or set tensorParallelSize")
    selector = role.node_selector if pool.node_selector is None else pool.node_selector
    if gpu_type:
        selector = {GPU_PRODUCT_LABEL: gpu_type.product} | selector
    own = {name: getattr(role, name) if getattr(pool, name) is None else getattr(pool, name) for name in POOL_FIELDS}
    own |= {"resources": resources, "node_selector": selector, "tensor_parallel_size": tp}
    return role.model_copy(update=own), why


def _fitting_tp(spec: RLJobSpec, gpu: GpuType, field: str) -> tuple[int, str]:
    """The smallest power of two whose slice of the weights leaves WEIGHT_SHARE of each GPU free."""
    parameters = model_parameters(spec)
    if parameters is None:
        raise ValueError(f"{field}: the model's size is not known before it loads: set spec.model.parametersB, or "
                         "the pool's tensorParallelSize")
    weights = parameters * DTYPE_BYTES[spec.model.dtype]
    room = gpu.memory_gib * GIB * WEIGHT_SHARE
    tp = 1
    while weights / tp > room and tp < MAX_TP:
        tp *= 2
    if weights / tp > room:
        raise ValueError(f"{field}: the weights ({weights / GIB:.1f} GiB) do not fit {MAX_TP} GPUs of "
                         f"{gpu.memory_gib:g} GiB")
    why = (f"tensorParallelSize {tp}: {parameters / 1e9:.3g}B parameters x {DTYPE_BYTES[spec.model.dtype]} bytes "
           f"({spec.model.dtype}) = {weights / GIB:.1f} GiB of weights, {weights / tp / GIB:.1f} GiB per GPU <= "
           f"{WEIGHT_SHARE:.0%} of {gpu.memory_gib:g} GiB (the rest holds the KV cache)")
    if tp > 1:
        why += f"; at {tp // 2}, {weights / (tp // 2) / GIB:.1f} GiB per GPU would not fit"
    return tp, why


def model_parameters(spec: RLJobSpec) -> int | None:
    """The model's parameters where the spec tells them (a tiny Llama's shape, SmolLM2, an HF model's parametersB);
    None for an HF model without parametersB."""
    model = spec.model
    if model.type == "smollm2":
        return SMOLLM2_PARAMETERS
    if model.type == "hf":
        return None if model.parameters_b is None else round(model.parameters_b * 1e9)
    hidden, layers = model.hidden_size, model.num_layers
    vocab = 512  # the character tokenizer's ids, at most
    per_layer = 4 * hidden * hidden + 3 * hidden * model.intermediate_size + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden
