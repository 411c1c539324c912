"""The reference executor as `rlfleet run` starts it: log pi_ref of given tokens equals the trainer's own log pi on
the same weights, weights pushed over DDMA (WeightReceivers, as the controller drives them) change it to the pushed
ones, a restarted replica of a moving reference rejoins with weights of the version it reports, and bad requests
are refused."""

from __future__ import annotations

import os
import random
import signal
import time

import grpc
import pytest
import torch
from torch.testing import assert_close

from rlfleet.v1 import generator_pb2, generator_pb2_grpc, reference_pb2, reference_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.controller.receivers import WeightReceivers
from rlfleet.workers.reference.stage import ReferencePolicy
from rlfleet.workers.controller.replicas import ReplicaStates
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.local import spawn, stop
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.trainer.policy import pack_samples, token_logprobs

from conftest import make_job
from support import RankZero, run_token, start_workers
from trainer_samples import Sample

pytestmark = pytest.mark.integration
TEMPERATURE, TOP_P = 0.8, 0.95


def _samples(vocab: int) -> list[Sample]:
    rng = random.Random(5)
    return [Sample([rng.randrange(4, vocab) for _ in range(rng.randrange(2, 6))],
                   [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 7))], [], 0.0) for _ in range(11)]


def _expected(model, samples: list[Sample]) -> list[list[float]]:
    """The trainer's log pi of each completion token under the sampling distribution (its own code path)."""
    for sample in samples:
        sample.gen_logprobs = [0.0] * len(sample.completion_ids)
    batch = pack_samples(samples, pad_id=0)
    with torch.no_grad():
        logprobs = token_logprobs(model, batch, TEMPERATURE, TOP_P)
    return [logprobs[row][batch.completion_mask[row]].tolist() for row in range(len(samples))]


def _logprobs(stub, samples: list[Sample]) -> tuple[list[list[float]], int]:
    reply = stub.LogProbs(reference_pb2.LogProbsRequest(job_id="t", sequences=[
        reference_pb2.TokenSequence(sample_id=str(i), prompt_ids=s.prompt_ids, completion_ids=s.completion_ids)
        for i, s in enumerate(samples)]), timeout=60)
    assert [s.sample_id for s in reply.sequences] == [str(i) for i in range(len(samples))]
    return [list(s.logprobs) for s in reply.sequences], reply.policy_version


def _moved(model) -> None:
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def test_reference_scores_as_the_trainer_and_takes_pushed_weights(tmp_path, model_cache):
    from transformers import AutoModelForCausalLM

    job = make_job(roles={"reference": {}}, generation={"temperature": TEMPERATURE, "topP": TOP_P},
                   weightSync={"backend": "gloo", "timeoutSeconds": 30})
    model = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32).eval()
    samples = _samples(model.config.vocab_size)
    children, endpoints, _ = start_workers(job, tmp_path, {"reference"})
    try:
        token = run_token(tmp_path)
        stub = reference_pb2_grpc.ReferenceStub(wire.channel(endpoints.of("reference")[0], token))
        loaded, version = _logprobs(stub, samples)
        assert version == 0
        for found, wanted in zip(loaded, _expected(model, samples)):
            assert_close(found, wanted, atol=1e-5, rtol=1e-5)

        _moved(model)  # the trainer's weights now differ from what the reference loaded
        ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=endpoints, grpc_port=0, metrics_port=0,
                            run_dir=str(tmp_path), token=token)
        receivers = WeightReceivers(ctx, RankZero(model, job, token, "reference"), ReplicaStates(1, 0),
                                    PolicyVersion(3), role="reference")
        receivers.join_all()
        assert receivers.replicas.up() == [0]
        pushed, version = _logprobs(stub, samples)
        assert version == 3
        wanted = _expected(model, samples)
        assert max(abs(a - b) for f, w in zip(loaded, wanted) for a, b in zip(f, w)) > 1e-3, "the push changed nothing"
        for found, expected in zip(pushed, wanted):
            assert_close(found, expected, atol=1e-5, rtol=1e-5)
        receivers.stop()
    finally:
        stop(children)


def test_a_moving_reference_replica_rejoins_with_the_version_it_holds(tmp_path, model_cache):
    """updateEverySteps 2, two replicas; replica 1 restarts after step 1, whose weights the references were not
    pushed. It rejoins with the trainer's weights, version 1's: it must say 1, and replica 0 gets the same, so both
    give one log pi_ref (it rejoined with them under version 0's label, and the replicas disagreed)."""
    from transformers import AutoModelForCausalLM

    job = make_job(roles={"reference": {"replicas": 2, "updateEverySteps": 2}},
                   generation={"temperature": TEMPERATURE, "topP": TOP_P},
                   weightSync={"backend": "gloo", "timeoutSeconds": 30})
    model = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32).eval()
    samples = _samples(model.config.vocab_size)
    children, endpoints, _ = start_workers(job, tmp_path, {"reference"})
    try:
        ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=endpoints, grpc_port=0, metrics_port=0,
                            run_dir=str(tmp_path), token=run_token(tmp_path))
        policy = PolicyVersion(0)
        reference = ReferencePolicy(ctx, RankZero(model, job, ctx.token, "reference"), policy)
        reference.start(0)
        _moved(model)  # step 0 trained: the trainer holds version 1, which a K = 2 reference is not pushed
        reference.after_step(policy.trained(0))
        os.killpg(children[1].process.pid, signal.SIGKILL)
        reference.receivers.mark_down(1, "killed")  # as a LogProbs that failed on it reports it
        children[1] = spawn(children[1].worker, tmp_path)
        wire.wait_ready(endpoints.of("reference")[1], 120)
        deadline = time.monotonic() + 120
        while reference.states.down():  # the controller tends the replicas between steps
            assert time.monotonic() < deadline, "replica 1 did not rejoin"
            reference.tend()
            time.sleep(0.05)
        reference.finish()
        wanted = _expected(model, samples)
        for replica in (1, 0):  # the rejoined one first
            stub = reference_pb2_grpc.ReferenceStub(wire.channel(endpoints.of("reference")[replica], ctx.token))
            found, version = _logprobs(stub, samples)
            assert version == 1, f"replica {replica} says it holds version {version}"
            for logprobs, expected in zip(found, wanted):
                assert_close(logprobs, expected, atol=1e-5, rtol=1e-5, msg=f"replica {replica}")
        reference.close()
    finally:
        stop(children)


def test_bad_requests_are_refused_and_the_reference_does_not_generate(tmp_path, model_cache):
    job = make_job(roles={"reference": {}})
    children, endpoints, _ = start_workers(job, tmp_path, {"reference"})
    try:
        channel = wire.channel(endpoints.of("reference")[0], run_token(tmp_path))
        stub = reference_pb2_grpc.ReferenceStub(channel)
        bad = {
            "empty": [],
            "no completion": [reference_pb2.TokenSequence(sample_id="a", prompt_ids=[5], completion_ids=[])],
            "token out of range": [reference_pb2.TokenSequence(sample_id="a", prompt_ids=[5],
                                                               completion_ids=[10**6])],
        }
        for what, sequences in bad.items():
            with pytest.raises(grpc.RpcError) as refused:
                stub.LogProbs(reference_pb2.LogProbsRequest(job_id="t", sequences=sequences), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert "sequences" in refused.value.details(), what
        with pytest.raises(grpc.RpcError) as other_job:
            stub.LogProbs(reference_pb2.LogProbsRequest(job_id="other", sequences=bad["token out of range"]),
                          timeout=30)
        assert other_job.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as generate:
            generator_pb2_grpc.GeneratorStub(channel).Generate(generator_pb2.GenerateRequest(
                job_id="t", max_tokens=2, temperature=1.0, top_p=1.0,
                sequences=[generator_pb2.Sequence(sample_id="a", prompt_ids=[5])]), timeout=30)
        assert generate.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        stop(children)
