"""DDMA into a running generator: real trainer ranks push their own live shards, then train on at once.

Each trainer rank is a `Trainer` holding FSDP2 shards of a perturbed model. Rank 0 publishes version 7
and then runs a train step (an optimizer step with a large learning rate) while the generator is asked
for the weights only after that step (or a few seconds): a push that read the live shards would deliver
the trained weights under version 7. Greedy output after the push must equal HF's on the published
weights, and differ from HF's on the trained ones (which the test checks, so it can fail). Over the tiny Llama, and
(slow) over a tiny model of every other family README.md lists at TP 2, each push checked by content
(weightSync.verify): Phi-3's checkpoint holds fused qkv_proj and gate_up_proj, which vLLM splits itself.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from rlfleet.v1 import generator_pb2, generator_pb2_grpc, weight_sync_pb2, weight_sync_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.local import stop
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port

from conftest import make_job
from trainer_samples import Sample
from support import end_trainer_rank, run_token, start_workers
from tiny_families import FAMILIES, GREEDY_INIT, build_family

pytestmark = pytest.mark.integration
PROMPTS = ["1+2=", "7+8=", "hello", "9*9="]
NEW_TOKENS = 8
VERSION = 7
# Rows of 512 float32 columns: the q/k/v/o/gate/up/down blocks of each trainer rank are whole-row blocks
# of 1.3-2 MiB, which travel as direct sends (views of the shards when nothing forbids it).
MODEL = {"type": "tiny", "hiddenSize": 512, "numHeads": 4, "intermediateSize": 2048}
# The same widths for the other families (two kv heads of 128: one per TP rank).
FAMILY_SHAPE = {"hidden_size": 512, "intermediate_size": 2048, "head_dim": 128}
# At TP 2 only: each family's names and layouts are mapped as at TP 1, then split across the ranks (fused qkv and
# gate_up included); the unsplit plan of TP 1 is the vllm-2-pools case's first pool. Not Llama: the tiny model is
# one (vllm-2-pools pushes it at TP 1 and 2), and Qwen2's, Qwen3's and Mistral's cases split its projections'
# names over grouped-query heads.
FAMILY_CASES = [pytest.param("vllm", 2, 2, family, marks=pytest.mark.slow, id=f"vllm-2-2-{family}")
                for family in sorted(FAMILIES) if family != "llama"]
# The generator is asked for the weights once the trainer's next optimizer step is done, or after this.
LATE_SECONDS = 5.0


def _perturbed(model_dir, out_dir: Path) -> Path:
    """The tiny model with every weight moved, saved as an HF directory (the trainers load it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 2.5 * model.config.initializer_range)
        # Peaked logits: greedy choices then do not hinge on float rounding between two kernels.
        if not model.config.tie_word_embeddings:  # a tied head is the embedding: scaled, it drowns the layers
            model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def _samples(vocab: int) -> list[Sample]:
    rng = random.Random(3)
    return [Sample([rng.randrange(4, vocab) for _ in range(4)], [rng.randrange(4, vocab) for _ in range(6)],
                   [-3.0] * 6, 1.0 if i % 2 else -1.0) for i in range(8)]


def _trainer_rank(rank: int, job_json: dict, model_dir: str, master_port: int, addresses: list[str], token: str,
                  syncs: list[str], out: str) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.worker import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    job = parse_job(job_json)
    ctx = WorkerContext(job=job, role="trainer", rank=rank, endpoints=Endpoints(""),
                        grpc_port=0, metrics_port=0, run_dir=out, token=token)
    trainer = Trainer(ctx, Path(model_dir))
    if rank > 0:
        trainer.follow()
        end_trainer_rank(trainer)
    direct = [b.name for o in trainer.publishers["generator"].of(0).outgoing for b in o.packer.direct]
    assert direct, "no direct block: this test could not see a push that reads live weights"
    replicas = [replica for replica, address in enumerate(addresses) if address]  # the pools' blocks have gaps
    stubs = {replica: weight_sync_pb2_grpc.WeightSyncStub(wire.channel(addresses[replica], token))
             for replica in replicas}
    for replica, stub in stubs.items():  # each with its own plan (its pool's TP)
        host, port = syncs[replica].rsplit(":", 1)
        joined = _join(stub, trainer, replica, host, port)
        assert trainer.connect("generator", replica, host, int(port), 1) is None
        joined.result()
    stepped = threading.Event()
    updates = [_late_update(stub, stepped) for stub in stubs.values()]
    trainer.publish("generator", replicas)
    trainer.train(_samples(trainer.model.config.vocab_size), 0)
    stepped.set()
    for update in updates:
        update.join(120)
    for replica in replicas:
        assert trainer.publishers["generator"].of(replica).wait()["failed"] == {}
    trainer.checkpoint(1, {"policy_version": VERSION + 1})
    end_trainer_rank(trainer)


def _late_update(stub, stepped: threading.Event) -> threading.Thread:
    """UpdateWeights once the trainer stepped (or LATE_SECONDS passed): the generator posts its receives late."""
    def update():
        stepped.wait(LATE_SECONDS)
        request = weight_sync_pb2.UpdateWeightsRequest(job_id="t", policy_version=VERSION)
        assert stub.UpdateWeights(request, timeout=120).policy_version == VERSION

    thread = threading.Thread(target=update)
    thread.start()
    return thread


def _join(stub, trainer, replica, host, port):
    settings = trainer.publishers["generator"].of(replica).settings
    return stub.JoinSyncGroup.future(weight_sync_pb2.JoinSyncGroupRequest(
        job_id="t", store_host=host, store_port=int(port), trainers=settings.trainers, backend=settings.backend,
        timeout_seconds=settings.timeout, dtype=settings.dtype, bucket_bytes=settings.bucket_bytes, epoch=1,
        verify=settings.verify, pipeline_stages=settings.stages,
        params=[weight_sync_pb2.ParamShape(name=n, shape=list(s)) for n, s in trainer.push_shapes.items()]),
        timeout=120)


def _hf_greedy(model_dir, tokenizer) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # Eager: HF's reference attention; SDPA drops Gemma 2's attention softcap, which vLLM applies.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    eos = tokenizer.eos_token_id
    return [model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                           pad_token_id=eos)[0, len(ids):].tolist() for ids in _prompt_ids(tokenizer)]


@pytest.mark.parametrize("engine, trainers, tp, family",
                         [pytest.param("torch", 3, 1, None, id="torch-3-1"),
                          # 2 pipeline stages of 2 ranks each (trainers as (stages, ranks a stage)): each stage's
                          # ranks push the shards of their own layers, none gathers another's.
                          pytest.param("torch", (2, 2), 1, None, id="torch-2-stages-x-2"),
                          # Two generator pools of TP 1 and 2: the trainers push each replica by its pool's plan. It
                          # holds the tiny model's cases of one pool at TP 1 and at TP 2; FAMILY_CASES push to one
                          # pool (the role's own fields) at each TP.
                          pytest.param("vllm", 2, (1, 2), None, id="vllm-2-pools")] + FAMILY_CASES)
def test_sharded_push_of_live_shards_makes_greedy_output_equal_hf(engine, trainers, tp, family, tmp_path, model_cache):
    from transformers import AutoTokenizer

    model = MODEL if family is None else {"type": "hf", "path": str(build_family(
        family, tmp_path / family, **FAMILY_SHAPE, **GREEDY_INIT.get(family, {})))}
    parallel = ({"pools": [{"name": f"tp{size}", "tensorParallelSize": size} for size in tp]}
                if isinstance(tp, tuple) else {"tensorParallelSize": tp})
    stages, per_stage = trainers if isinstance(trainers, tuple) else (1, trainers)
    trainers = stages * per_stage
    job = make_job(model=model, roles={"generator": {"engine": engine, "kvCacheMB": 64, **parallel},
                                       "trainer": {"replicas": trainers, "pipelineParallel": stages}},
                   algorithm={"learningRate": 0.05},
                   weightSync={"backend": "gloo", "bucketMB": 1, "timeoutSeconds": 120, "verify": family is not None})
    model_dir = materialize(job.spec.model, model_cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    published = _perturbed(model_dir, tmp_path / "published")
    children, endpoints, _ = start_workers(job, tmp_path, {"generator"})
    try:
        stubs = [generator_pb2_grpc.GeneratorStub(wire.channel(address, run_token(tmp_path)))
                 for address in endpoints.of("generator") if address]
        before = [_greedy(stub, tokenizer) for stub in stubs]
        _push(job, trainers, published, endpoints, run_token(tmp_path), tmp_path / "trained")
        expected = _hf_greedy(published, tokenizer)
        for stub, earlier in zip(stubs, before):
            after = _greedy(stub, tokenizer)
            assert after.policy_version == VERSION
            assert [list(s.token_ids) for s in after.segments] == expected
            assert [list(s.token_ids) for s in earlier.segments] != expected
        assert _hf_greedy(tmp_path / "trained" / "checkpoints" / "step-000001", tokenizer) != expected, \
            "the train step did not change greedy output: a push of trained weights would go unseen"
    finally:
        stop(children)


def _push(job, trainers, model_dir, endpoints, token, out: Path) -> None:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    generators, stores = endpoints.of("generator"), endpoints.sync_of("generator")
    ranks = [context.Process(target=_trainer_rank, args=(r, job.to_dict(), str(model_dir), port, generators, token,
                                                          stores, str(out)))
             for r in range(trainers)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=300)
        assert rank.exitcode == 0, "a trainer rank failed"


def _prompt_ids(tokenizer):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _greedy(stub, tokenizer):
    return stub.Generate(generator_pb2.GenerateRequest(
        job_id="t", max_tokens=NEW_TOKENS, temperature=0.0, top_p=1.0, seed=0,
        sequences=[generator_pb2.Sequence(sample_id=str(i), prompt_ids=ids)
                   for i, ids in enumerate(_prompt_ids(tokenizer))],
    ))


def test_a_quantized_generator_quantizes_each_push_as_a_fresh_engine_of_those_weights(tmp_path, model_cache):
    """roles.generator.quantization int8: after a push, greedy tokens and log-probs are a fresh int8 engine's on the
    pushed weights, so the push was quantized anew (its scales those of the new weights), not into the old ones."""
    from transformers import AutoTokenizer

    generator = {"engine": "vllm", "kvCacheMB": 64, "quantization": "int8"}
    job = make_job(model=MODEL, roles={"generator": generator}, algorithm={"learningRate": 0.05},
                   weightSync={"backend": "gloo", "bucketMB": 1, "timeoutSeconds": 120, "verify": True})
    model_dir = materialize(job.spec.model, model_cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    published = _perturbed(model_dir, tmp_path / "published")
    fresh_job = make_job(model={"type": "hf", "path": str(published)}, roles={"generator": generator})
    pushed_children, endpoints, _ = start_workers(job, tmp_path / "pushed", {"generator"})
    fresh_children, fresh_endpoints, _ = start_workers(fresh_job, tmp_path / "fresh", {"generator"})
    try:
        pushed = generator_pb2_grpc.GeneratorStub(wire.channel(endpoints.of("generator")[0],
                                                               run_token(tmp_path / "pushed")))
        fresh = generator_pb2_grpc.GeneratorStub(wire.channel(fresh_endpoints.of("generator")[0],
                                                              run_token(tmp_path / "fresh")))
        before = _greedy(pushed, tokenizer)
        _push(job, 1, published, endpoints, run_token(tmp_path / "pushed"), tmp_path / "trained")
        after, expected = _greedy(pushed, tokenizer), _greedy(fresh, tokenizer)
        assert after.policy_version == VERSION
        assert [list(s.token_ids) for s in after.segments] == [list(s.token_ids) for s in expected.segments]
        for got, want in zip(after.segments, expected.segments):
            assert list(got.logprobs) == pytest.approx(list(want.logprobs), abs=1e-5)
        assert [list(s.token_ids) for s in before.segments] != [list(s.token_ids) for s in expected.segments]
    finally:
        stop(pushed_children + fresh_children)
