"""Every model family the README lists trains here: the real trainer (`Trainer`, as `rlfleet run` starts it) takes
a step on completions a real vLLM generator sampled, and scores them as the generator did at equal weights.

The generator samples at temperature 1 from one tiny random model per family (tests/tiny_families.py) long enough
to pass the families' sliding window; the trainer's first train step reports `logprob_gap`, the mean |log pi -
log mu| over those tokens, computed by its own forward before the update. A forward that drops any part of a
family's attention or head (Qwen2's q/k/v biases, Qwen3's q/k norms, Mistral's and Gemma 2's sliding window, Gemma
2's query_pre_attn_scalar and softcapping, Phi-3's fused projections read wrongly) moves log pi far more than float
noise. Pushes by family: test_weight_push; LoRA by family: test_lora_push.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from pathlib import Path

import pytest

from rlfleet.v1 import generator_pb2, generator_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.local import stop
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port

from conftest import make_job
from support import FIXED_TOKEN, end_trainer_rank, run_token, start_workers
from tiny_families import FAMILIES, SLIDING_WINDOW, build_family
from trainer_samples import Sample

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Prompts of 1 to 6 tokens and completions of up to 40: most positions attend past an 8-token window.
PROMPTS = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8], [20, 21], [40, 41, 42, 43], [11], [60, 61, 62], [70, 15]]
NEW_TOKENS = 40
# As test_logprob_parity's: float32 forwards of equal weights differ by ~1e-6 per log-prob; a dropped bias, norm,
# scale, softcap or window moves the mean by 1e-2 or more on these models.
MEAN_GAP = 1e-4


def _sample(stub) -> list[Sample]:
    reply = stub.Generate(generator_pb2.GenerateRequest(
        job_id="t", max_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0, seed=7,
        sequences=[generator_pb2.Sequence(sample_id=str(i), prompt_ids=p) for i, p in enumerate(PROMPTS)]),
        timeout=300)
    return [Sample(prompt, list(s.token_ids), list(s.logprobs), 1.0 if i % 2 else -1.0)
            for i, (prompt, s) in enumerate(zip(PROMPTS, reply.segments))]


def _train(job_json: dict, model_dir: str, samples: list[Sample], port: int, out: str) -> None:
    """One trainer rank: a train step on the samples; its metrics and whether every weight stayed put."""
    import torch

    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.worker import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = WorkerContext(job=parse_job(job_json), role="trainer", rank=0, endpoints=Endpoints(""),
                        grpc_port=0, metrics_port=0, run_dir=out, token=FIXED_TOKEN)
    trainer = Trainer(ctx, Path(model_dir))
    before = trainer.snapshot()
    metrics = trainer.train(samples, 0)
    after = trainer.snapshot()
    moved = sorted(name for name in before if not torch.equal(before[name], after[name]))
    Path(out, "step.json").write_text(json.dumps({"metrics": metrics, "moved": moved, "weights": sorted(before)}))
    end_trainer_rank(trainer)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trainer_steps_on_generator_samples_and_scores_them_as_the_generator(family, tmp_path):
    model_dir = build_family(family, tmp_path / family)
    job = make_job(model={"type": "hf", "path": str(model_dir)}, generation={"temperature": 1.0, "topP": 1.0},
                   roles={"generator": {"kvCacheMB": 64}}, algorithm={"learningRate": 0.01})
    children, endpoints, _ = start_workers(job, tmp_path, {"generator"})
    try:
        with wire.channel(endpoints.of("generator")[0], run_token(tmp_path)) as chan:
            samples = _sample(generator_pb2_grpc.GeneratorStub(chan))
    finally:
        stop(children)
    assert max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) > 3 * SLIDING_WINDOW, \
        "no sequence reaches past the sliding window: this test could not see it ignored"
    trainer = multiprocessing.get_context("spawn").Process(
        target=_train, args=(job.to_dict(), str(model_dir), samples, free_port(), str(tmp_path)))
    trainer.start()
    trainer.join(timeout=600)
    assert trainer.exitcode == 0, "the trainer failed"
    step = json.loads((tmp_path / "step.json").read_text())
    metrics = step["metrics"]
    print(f"\n{family}: logprob_gap {metrics['logprob_gap']:.2e} over {metrics['tokens']:.0f} tokens")
    assert metrics["tokens"] == sum(len(s.completion_ids) for s in samples)
    assert metrics["logprob_gap"] < MEAN_GAP, metrics
    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0, metrics
    assert step["moved"] == step["weights"], "the step left some weights unchanged"
