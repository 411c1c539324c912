"""Generator engines behind one interface, picked by `roles.generator.engine`."""

from __future__ import annotations

import json
from pathlib import Path

from rlfleet.workers.engines.base import Engine
from rlfleet.workers.models.precision import weights_dtype
from rlfleet.workers.spec import RLJob

# Prompts here are short; the cap keeps vLLM's per-sequence bookkeeping small for long-context models.
PROMPT_BUDGET = 1024


def max_model_len(model_dir: Path, max_new_tokens: int) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return min(config["max_position_embeddings"], PROMPT_BUDGET + max_new_tokens)


def create_engine(job: RLJob, model_dir: Path) -> Engine:
    role = job.spec.roles.generator
    length = max_model_len(model_dir, job.spec.generation.max_new_tokens)
    dtype = weights_dtype(job)
    if role.engine == "vllm":
        from rlfleet.workers.engines.vllm_engine import VllmEngine

        return VllmEngine(model_dir, dtype=dtype, kv_cache_mb=role.kv_cache_mb, max_model_len=length,
                          seed=job.spec.algorithm.seed, tensor_parallel_size=role.tensor_parallel_size)
    from rlfleet.workers.engines.torch_engine import TorchEngine

    if role.tensor_parallel_size != 1:
        raise ValueError("spec.roles.generator: engine torch runs one worker; set tensorParallelSize: 1")
    return TorchEngine(model_dir, dtype=dtype, max_model_len=length, device="cuda" if role.resources.gpu else "cpu")
