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


def check_tensor_parallel(job: RLJob, model_dir: Path) -> None:
    """Refuse, before any engine loads, a tensorParallelSize that does not divide the model's heads: vLLM would
    replicate kv heads across ranks, which the weight sync's plan does not model."""
    from rlfleet.workers.sync.plan import GeneratorLayout

    tp_size = job.spec.roles.generator.tensor_parallel_size
    config = json.loads((model_dir / "config.json").read_text())
    try:
        GeneratorLayout.of_model(config, tp_size)
    except ValueError as err:
        raise ValueError(f"spec.roles.generator.tensorParallelSize {tp_size} must divide the model's attention "
                         f"heads ({config['num_attention_heads']}) and kv heads "
                         f"({config.get('num_key_value_heads') or config['num_attention_heads']}): {err}") from None


def create_engine(job: RLJob, model_dir: Path) -> Engine:
    role = job.spec.roles.generator
    check_tensor_parallel(job, model_dir)
    length = max_model_len(model_dir, job.spec.generation.max_new_tokens)
    dtype = weights_dtype(job)
    if role.engine == "vllm":
        from rlfleet.workers.engines.vllm_engine import VllmEngine

        return VllmEngine(model_dir, dtype=dtype, kv_cache_mb=role.kv_cache_mb, max_model_len=length,
                          seed=job.spec.algorithm.seed, tensor_parallel_size=role.tensor_parallel_size,
                          quantization=role.quantization, kv_cache_dtype=role.kv_cache_dtype)
    from rlfleet.workers.engines.torch_engine import TorchEngine

    if role.tensor_parallel_size != 1:
        raise ValueError("spec.roles.generator: engine torch runs one worker; set tensorParallelSize: 1")
    return TorchEngine(model_dir, dtype=dtype, max_model_len=length, device="cuda" if role.resources.gpu else "cpu")
