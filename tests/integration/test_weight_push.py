"""A weight push into a running vLLM generator: its greedy output must equal HF transformers' on the pushed weights."""

from __future__ import annotations

import pytest
import torch

from rlfleet.v1 import generator_pb2, generator_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.local import stop
from rlfleet.workers.models import materialize
from rlfleet.workers.sync.publisher import WeightPublisher

from conftest import make_job
from support import start_workers

pytestmark = pytest.mark.integration
PROMPTS = ["1+2=", "7+8=", "hello", "9*9="]
NEW_TOKENS = 8


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


def _hf_greedy(model, prompt_ids, eos_id):
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                         eos_token_id=eos_id, pad_token_id=eos_id)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("engine", ["vllm", "torch"])
def test_pushed_weights_change_greedy_output_to_hf(engine, tmp_path, model_cache):
    from transformers import AutoTokenizer

    job = make_job(model={"type": "tiny", "hiddenSize": 128, "numHeads": 4, "intermediateSize": 512},
                   roles={"generator": {"engine": engine, "kvCacheMB": 64}},
                   weightSync={"backend": "gloo", "bucketMB": 1, "timeoutSeconds": 60})
    model_dir = materialize(job.spec.model, model_cache)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    children, endpoints, _ = start_workers(job, tmp_path, {"generator"})
    try:
        stub = generator_pb2_grpc.GeneratorStub(wire.channel(endpoints.generators[0]))
        model = _perturbed(model_dir)
        publisher = WeightPublisher(model, "t", [stub], endpoints.sync, backend="gloo", timeout=60,
                                    bucket_bytes=1 << 20, dtype="float32")
        assert len(publisher.buckets) > 1, "the test must exercise several buckets"
        before = _greedy(stub, tokenizer)
        publisher.publish(model, 7)
        publisher.wait()
        after = _greedy(stub, tokenizer)
        expected = [_hf_greedy(model, ids, tokenizer.eos_token_id) for ids in _prompt_ids(tokenizer)]
        assert after.policy_version == 7
        assert [list(s.token_ids) for s in after.segments] == expected
        assert [list(s.token_ids) for s in before.segments] != expected
        publisher.close()
    finally:
        stop(children)


def _prompt_ids(tokenizer):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _greedy(stub, tokenizer):
    return stub.Generate(generator_pb2.GenerateRequest(
        job_id="t", max_tokens=NEW_TOKENS, temperature=0.0, top_p=1.0, seed=0,
        sequences=[generator_pb2.Sequence(sample_id=str(i), prompt_ids=ids)
                   for i, ids in enumerate(_prompt_ids(tokenizer))],
    ))
