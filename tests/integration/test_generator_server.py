"""A real generator worker (torch engine) on a loopback port: segments, refused requests, health, reflection."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet.v1 import generator_pb2, generator_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.engines import max_model_len
from rlfleet.workers.local import stop
from rlfleet.workers.models import materialize

from conftest import make_job
from support import log_text, start_workers

pytestmark = pytest.mark.integration
SERVICE = "rlfleet.v1.Generator"
PROMPTS = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def generator(tmp_path_factory, model_cache):
    job = make_job(roles={"generator": {"engine": "torch"}})
    run_dir = tmp_path_factory.mktemp("generator-run")
    children, endpoints, _ = start_workers(job, run_dir, {"generator"})
    try:
        model_dir = materialize(job.spec.model, model_cache)  # built by the worker; found here
        vocab = _vocab_size(model_dir)
        with wire.channel(endpoints.generators[0]) as chan:
            yield chan, vocab, max_model_len(model_dir, job.spec.generation.max_new_tokens), children[0]
    finally:
        stop(children)


def _vocab_size(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _request(prompts, job_id="t", max_tokens=8, temperature=1.0, top_p=1.0, seed=1):
    return generator_pb2.GenerateRequest(
        job_id=job_id, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
        sequences=[generator_pb2.Sequence(sample_id=f"s{i}", prompt_ids=p) for i, p in enumerate(prompts)])


def _generate(chan, request):
    return generator_pb2_grpc.GeneratorStub(chan).Generate(request, timeout=120)


def test_generates_one_segment_per_sequence_and_lists_its_services(generator):
    chan, vocab, _, _ = generator
    reply = _generate(chan, _request(PROMPTS, max_tokens=8))
    assert reply.job_id == "t"
    assert reply.policy_version == 0
    assert [s.sample_id for s in reply.segments] == ["s0", "s1", "s2"]
    for segment in reply.segments:
        assert 1 <= len(segment.token_ids) <= 8
        assert len(segment.logprobs) == len(segment.token_ids)
        assert all(0 <= t < vocab for t in segment.token_ids)
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in segment.logprobs)
        assert segment.finished or len(segment.token_ids) == 8

    greedy = [list(s.token_ids) for s in _generate(chan, _request(PROMPTS, temperature=0.0)).segments]
    assert greedy == [list(s.token_ids) for s in _generate(chan, _request(PROMPTS, temperature=0.0, seed=9)).segments]

    _assert_reflection_lists_the_services(chan)


def _bad_requests(vocab: int, max_len: int):
    return {
        "wrong-job": _request(PROMPTS, job_id="other"),
        "no-sequences": _request([]),
        "max-tokens-0": _request(PROMPTS, max_tokens=0),
        "max-tokens-negative": _request(PROMPTS, max_tokens=-3),
        "max-tokens-whole-context": _request(PROMPTS, max_tokens=max_len),
        "temperature-negative": _request(PROMPTS, temperature=-1.0),
        "temperature-nan": _request(PROMPTS, temperature=math.nan),
        "top-p-0": _request(PROMPTS, top_p=0.0),
        "token-past-vocab": _request([[1, 2], [1, vocab]]),
        "token-negative": _request([[1, -1]]),
        "empty-prompt": _request([[1, 2], []]),
        "prompt-too-long": _request([[1] * (max_len - 4)], max_tokens=8),
        "completion-too-long": generator_pb2.GenerateRequest(
            job_id="t", max_tokens=8, temperature=1.0, top_p=1.0,
            sequences=[generator_pb2.Sequence(sample_id="a", prompt_ids=[1], completion_ids=[2] * (max_len - 4))]),
    }


def test_refuses_bad_requests_and_keeps_serving(generator):
    chan, vocab, max_len, child = generator
    health = health_pb2_grpc.HealthStub(chan)
    for name, request in _bad_requests(vocab, max_len).items():
        with pytest.raises(grpc.RpcError) as refused:
            _generate(chan, request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, refused.value.details())
        assert child.process.poll() is None, f"worker died on {name}:\n{log_text(child)}"
        for service in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, (name, service)
        reply = _generate(chan, _request([[4, 5]], max_tokens=2))
        assert len(reply.segments) == 1 and 1 <= len(reply.segments[0].token_ids) <= 2, name


def _assert_reflection_lists_the_services(chan):
    stub = reflection_pb2_grpc.ServerReflectionStub(chan)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
