"""DDMA into a running generator: trainer ranks push their own shards; greedy output then equals HF's."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rlfleet.v1 import generator_pb2, generator_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.local import stop
from rlfleet.workers.models import materialize
from rlfleet.workers.sync.plan import trainer_rows

from conftest import make_job
from support import run_token, start_workers

pytestmark = pytest.mark.integration
PROMPTS = ["1+2=", "7+8=", "hello", "9*9="]
NEW_TOKENS = 8
MODEL = {"type": "tiny", "hiddenSize": 128, "numHeads": 4, "intermediateSize": 512}


def _perturbed(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        # Peaked logits: greedy choices then do not hinge on float rounding between two kernels.
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def _trainer_rank(rank: int, job_json: dict, weights_path: str, address: str, token: str, sync: str,
                  version: int) -> None:
    """One trainer rank holding only its Shard(0) rows of every parameter, pushing them."""
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.sync.shards import ShardPublisher, SyncSettings

    job = parse_job(job_json)
    settings = SyncSettings.from_job(job)
    full = torch.load(weights_path)
    shapes = {name: tuple(t.shape) for name, t in full.items()}
    shards = {name: t[slice(*trainer_rows(t.shape[0], settings.trainers, rank))].clone() for name, t in full.items()}
    del full
    publisher = ShardPublisher(rank, settings, shapes, vocab_size=shapes["lm_head.weight"][0])
    stub = generator_pb2_grpc.GeneratorStub(wire.channel(address, token))
    host, port = sync.rsplit(":", 1)
    joined = _join(stub, settings, shapes, host, port) if rank == 0 else None
    publisher.connect(0, host, int(port), epoch=1)
    if joined is not None:
        joined.result()
    update = stub.UpdateWeights.future(generator_pb2.UpdateWeightsRequest(job_id="t", policy_version=version),
                                       timeout=60) if rank == 0 else None
    publisher.publish(shards, [0])
    assert not publisher.wait()["failed"]
    if update is not None:
        assert update.result().policy_version == version
    publisher.close()


def _join(stub, settings, shapes, host, port):
    return stub.JoinSyncGroup.future(generator_pb2.JoinSyncGroupRequest(
        job_id="t", store_host=host, store_port=int(port), trainers=settings.trainers, backend=settings.backend,
        timeout_seconds=settings.timeout, dtype=settings.dtype, bucket_bytes=settings.bucket_bytes, epoch=1,
        params=[generator_pb2.ParamShape(name=n, shape=list(s)) for n, s in shapes.items()]), timeout=60)


def _hf_greedy(model, prompt_ids, eos_id):
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                         eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("engine, trainers, tp", [("vllm", 2, 1), ("vllm", 2, 2), ("torch", 3, 1)])
def test_sharded_push_makes_greedy_output_equal_hf(engine, trainers, tp, tmp_path, model_cache):
    from transformers import AutoTokenizer

    job = make_job(model=MODEL, roles={"generator": {"engine": engine, "kvCacheMB": 64, "tensorParallelSize": tp},
                                       "trainer": {"replicas": trainers}},
                   weightSync={"backend": "gloo", "bucketMB": 1, "timeoutSeconds": 60})
    model_dir = materialize(job.spec.model, model_cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _perturbed(model_dir)
    weights = tmp_path / "weights.pt"
    torch.save(dict(model.named_parameters()), weights)
    children, endpoints, _ = start_workers(job, tmp_path, {"generator"})
    try:
        stub = generator_pb2_grpc.GeneratorStub(wire.channel(endpoints.generators[0], run_token(tmp_path)))
        before = _greedy(stub, tokenizer)
        _push(job, trainers, weights, endpoints, run_token(tmp_path), version=7)
        after = _greedy(stub, tokenizer)
        expected = [_hf_greedy(model, ids, tokenizer.eos_token_id) for ids in _prompt_ids(tokenizer)]
        assert after.policy_version == 7
        assert [list(s.token_ids) for s in after.segments] == expected
        assert [list(s.token_ids) for s in before.segments] != expected
    finally:
        stop(children)


def _push(job, trainers, weights, endpoints, token, version):
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_trainer_rank, args=(r, job.to_dict(), str(weights), endpoints.generators[0],
                                                          token, endpoints.sync[0], version)) for r in range(trainers)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=180)
        assert rank.exitcode == 0, "a trainer rank failed to push its shards"


def _prompt_ids(tokenizer):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _greedy(stub, tokenizer):
    return stub.Generate(generator_pb2.GenerateRequest(
        job_id="t", max_tokens=NEW_TOKENS, temperature=0.0, top_p=1.0, seed=0,
        sequences=[generator_pb2.Sequence(sample_id=str(i), prompt_ids=ids)
                   for i, ids in enumerate(_prompt_ids(tokenizer))],
    ))
