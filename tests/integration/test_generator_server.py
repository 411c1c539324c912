"""A real generator worker (torch engine) on a loopback port: segments, refused requests, health, reflection."""

from __future__ import annotations

import json
import math

import grpc
import pytest
from grpc_fuzz import UNDECODABLE, call_raw, oversized, unlimited_channel, wrong_answers_to_random_bytes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet.v1 import (controller_pb2, generator_pb2, generator_pb2_grpc, scorer_pb2, weight_sync_pb2,
                        weight_sync_pb2_grpc)
from rlfleet.workers import wire
from rlfleet.workers.engines import max_model_len
from rlfleet.workers.models import materialize

from conftest import make_job
from support import log_text, one_worker

pytestmark = pytest.mark.integration
SERVICE = "rlfleet.v1.Generator"
WEIGHT_SYNC = "rlfleet.v1.WeightSync"
PROMPTS = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def generator_worker(tmp_path_factory, model_cache):
    """(address, vocabulary size, max model length, child, token) of one generator process for the module's tests."""
    job = make_job(roles={"generator": {"engine": "torch"}})
    with one_worker(job, tmp_path_factory.mktemp("generator-run"), "generator") as (child, endpoints, token):
        model_dir = materialize(job.spec.model, model_cache)  # built by the worker; found here
        vocab = _vocab_size(model_dir)
        max_len = max_model_len(model_dir, job.spec.generation.max_new_tokens)
        yield endpoints.of("generator")[0], vocab, max_len, child, token


@pytest.fixture(scope="module")
def generator(generator_worker):
    address, vocab, max_len, child, token = generator_worker
    with wire.channel(address, token) as chan:
        yield chan, vocab, max_len, child


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
        # vLLM would sample it at 0.01 and report that distribution's log-probs: refused as the schema refuses it.
        "temperature-below-vllm-floor": _request(PROMPTS, temperature=0.005),
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
    for name, request in _bad_requests(vocab, max_len).items():
        with pytest.raises(grpc.RpcError) as refused:
            _generate(chan, request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, refused.value.details())
        _assert_serving(chan, child, name)


def _assert_serving(chan, child, after: str) -> None:
    """The worker is alive, healthy and still generates."""
    assert child.process.poll() is None, f"worker died on {after}:\n{log_text(child)}"
    health = health_pb2_grpc.HealthStub(chan)
    for service in ("", SERVICE):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, (after, service)
    reply = _generate(chan, _request([[4, 5]], max_tokens=2))
    assert len(reply.segments) == 1 and 1 <= len(reply.segments[0].token_ids) <= 2, after


def _assert_reflection_lists_the_services(chan):
    stub = reflection_pb2_grpc.ServerReflectionStub(chan)
    replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {SERVICE, WEIGHT_SYNC, "grpc.health.v1.Health"} <= names


# ---------------------------------------------------------------- hostile bytes (no test here joins a sync group)

METHODS = {
    "Generate": generator_pb2.GenerateRequest,
    "JoinSyncGroup": weight_sync_pb2.JoinSyncGroupRequest,
    "UpdateWeights": weight_sync_pb2.UpdateWeightsRequest,
    "Status": generator_pb2.GeneratorStatusRequest,
}


def _path(method: str) -> str:
    service = WEIGHT_SYNC if method in ("JoinSyncGroup", "UpdateWeights") else SERVICE
    return f"/{service}/{method}"


def test_random_bytes_to_every_method_are_refused_and_the_worker_keeps_serving(generator):
    chan, _, _, child = generator
    for seed, (method, request_type) in enumerate(METHODS.items(), start=10):
        assert wrong_answers_to_random_bytes(chan, _path(method), request_type, "t", seed, count=8) == [], method
        _assert_serving(chan, child, f"random bytes to {method}")


def test_oversized_messages_are_resource_exhausted_and_the_worker_keeps_serving(generator_worker, generator):
    address, *_, token = generator_worker
    payload = oversized()
    with unlimited_channel(address, token) as big:
        for method in METHODS:
            code, details = call_raw(big, _path(method), payload)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, details)
    chan, _, _, child = generator
    _assert_serving(chan, child, "oversized messages")


def test_another_jobs_id_is_refused_by_every_method(generator):
    chan, _, _, child = generator
    generation, weights = generator_pb2_grpc.GeneratorStub(chan), weight_sync_pb2_grpc.WeightSyncStub(chan)
    update = weight_sync_pb2.UpdateWeightsRequest(job_id="other", policy_version=1)
    for method, request in [(weights.JoinSyncGroup, _join(job_id="other")), (weights.UpdateWeights, update),
                            (generation.Status, generator_pb2.GeneratorStatusRequest(job_id="other"))]:
        with pytest.raises(grpc.RpcError) as refused:
            method(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, refused.value.details())
        assert "other" in refused.value.details()
    _assert_serving(chan, child, "another job's id")


def _join(**fields) -> weight_sync_pb2.JoinSyncGroupRequest:
    """A join that passes the request checks, but for the fields given (its params fit no model here)."""
    request = {"job_id": "t", "store_host": "127.0.0.1", "store_port": 9, "trainers": 1, "backend": "gloo",
               "timeout_seconds": 5.0, "dtype": "float32", "bucket_bytes": 1 << 20, "epoch": 1,
               "params": [weight_sync_pb2.ParamShape(name="lm_head.weight", shape=[4, 4])]} | fields
    return weight_sync_pb2.JoinSyncGroupRequest(**request)


BAD_JOINS = {
    "no-store-host": _join(store_host=""),
    "store-port-0": _join(store_port=0),
    "store-port-too-large": _join(store_port=70000),
    "trainers-0": _join(trainers=0),
    "trainers-negative": _join(trainers=-1),
    "backend-unknown": _join(backend="mpi"),
    "dtype-unknown": _join(dtype="int8"),
    "timeout-0": _join(timeout_seconds=0.0),
    "timeout-nan": _join(timeout_seconds=math.nan),
    "timeout-a-day": _join(timeout_seconds=86400.0),
    "bucket-0": _join(bucket_bytes=0),
    "epoch-negative": _join(epoch=-1),
    "no-params": _join(params=[]),
    "param-without-shape": _join(params=[weight_sync_pb2.ParamShape(name="w")]),
    "param-size-0": _join(params=[weight_sync_pb2.ParamShape(name="w", shape=[4, 0])]),
    "param-without-name": _join(params=[weight_sync_pb2.ParamShape(shape=[4])]),
    "params-not-this-models": _join(),  # lm_head of 4 rows: refused by the sync plan, before the store is dialled
}


def test_bad_joins_and_updates_are_refused_before_anything_waits(generator):
    chan, _, _, child = generator
    stub = weight_sync_pb2_grpc.WeightSyncStub(chan)
    for name, request in BAD_JOINS.items():
        with pytest.raises(grpc.RpcError) as refused:
            stub.JoinSyncGroup(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, refused.value.details())
    for version, code in [(-1, grpc.StatusCode.INVALID_ARGUMENT), (1, grpc.StatusCode.FAILED_PRECONDITION)]:
        with pytest.raises(grpc.RpcError) as refused:
            stub.UpdateWeights(weight_sync_pb2.UpdateWeightsRequest(job_id="t", policy_version=version), timeout=30)
        assert refused.value.code() == code, (version, refused.value.details())
    _assert_serving(chan, child, "bad joins and updates")


# Protobuf carries no type: another message decodes as the method's request whenever its fields line up. Each of
# these decodes into a request the method must refuse, or into nothing at all.
WRONG_TYPES = {
    "score-request-to-generate": ("Generate", scorer_pb2.ScoreRequest(job_id="t", items=[
        scorer_pb2.ScoreItem(sample_id="a", completion="4", answer="4")]), grpc.StatusCode.INVALID_ARGUMENT),
    "controller-status-to-generate": ("Generate", controller_pb2.ControllerStatusResponse(
        job_id="t", phase="Running", step=3), UNDECODABLE),
    "update-to-join": ("JoinSyncGroup", weight_sync_pb2.UpdateWeightsRequest(job_id="t", policy_version=1),
                       grpc.StatusCode.INVALID_ARGUMENT),
    "generate-to-join": ("JoinSyncGroup", _request([[4, 5]]), grpc.StatusCode.INVALID_ARGUMENT),
    "status-to-update": ("UpdateWeights", generator_pb2.GeneratorStatusRequest(job_id="t"),
                         grpc.StatusCode.FAILED_PRECONDITION),
    "score-request-to-status": ("Status", scorer_pb2.ScoreRequest(job_id="other"), grpc.StatusCode.INVALID_ARGUMENT),
}


def test_messages_of_other_types_are_refused(generator):
    chan, _, _, child = generator
    for name, (method, message, code) in WRONG_TYPES.items():
        got, details = call_raw(chan, _path(method), message.SerializeToString())
        assert got == code, (name, got, details)
    _assert_serving(chan, child, "messages of other types")
