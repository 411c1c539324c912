"""The critic executor as `rlfleet run` starts it: values of every completion token (0 from its zeroed head), PPO's
value loss falling as it learns GAE returns, checkpoints saved and restored exactly, bad requests refused; two ranks
(ranksPerPod 2: the value model sharded FSDP2-style over gloo) learn exactly what one does."""

from __future__ import annotations

import random

import grpc
import pytest

from rlfleet.v1 import critic_pb2, critic_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.local import stop

from conftest import make_job
from support import run_token, start_workers

pytestmark = pytest.mark.integration
RETURN = 1.0


def _sequences(count: int) -> list[critic_pb2.ValueSequence]:
    rng = random.Random(3)
    return [critic_pb2.ValueSequence(sample_id=str(i), prompt_ids=[rng.randrange(4, 60) for _ in range(3)],
                                     completion_ids=[rng.randrange(4, 60) for _ in range(rng.randrange(1, 6))])
            for i in range(count)]


def _values(stub, sequences) -> list[list[float]]:
    reply = stub.Values(critic_pb2.ValuesRequest(job_id="t", sequences=sequences), timeout=60)
    assert [s.sample_id for s in reply.sequences] == [s.sample_id for s in sequences]
    return [list(s.values) for s in reply.sequences]


def _train(stub, sequences, step: int) -> critic_pb2.TrainResponse:
    """One batch, as the controller sends it: the values the critic gave (old values), the returns to learn."""
    old = _values(stub, sequences)
    targets = [critic_pb2.ValueTarget(sequence=s, returns=[RETURN] * len(v), old_values=v)
               for s, v in zip(sequences, old)]
    return stub.Train(iter([critic_pb2.TrainRequest(job_id="t", step=step, targets=targets)]), timeout=120)


def _job():
    return make_job(algorithm={"advantage": "gae", "epochs": 2, "miniBatches": 2},
                    roles={"critic": {"learningRate": 1e-3, "valueClip": 0.5}})


def test_the_critic_learns_returns_and_restores_its_checkpoint(tmp_path, model_cache):
    children, endpoints, _ = start_workers(_job(), tmp_path, {"critic"})
    try:
        stub = critic_pb2_grpc.CriticStub(wire.channel(endpoints.of("critic")[0], run_token(tmp_path)))
        sequences = _sequences(8)
        first = _values(stub, sequences)
        assert [len(v) for v in first] == [len(s.completion_ids) for s in sequences]
        assert {x for v in first for x in v} == {0.0}  # the head starts at zero
        losses = [_train(stub, sequences, step).value_loss for step in range(12)]
        assert losses[0] == pytest.approx(0.5 * RETURN**2)  # zero values against returns of 1
        assert losses[-1] < 0.2 * losses[0], losses
        saved = stub.Save(critic_pb2.CheckpointRequest(job_id="t", step=12), timeout=60)
        assert saved.critic_version == 12
        learned = _values(stub, sequences)
        _train(stub, sequences, 12)
        assert _values(stub, sequences) != learned
        restored = stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=12), timeout=60)
        assert (restored.step, restored.critic_version) == (12, 12)
        assert _values(stub, sequences) == learned
        with pytest.raises(grpc.RpcError) as missing:  # a trainer resuming from a step the critic never saved
            stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=99), timeout=60)
        assert missing.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _values(stub, sequences) == learned  # refused: it keeps what it has
        base = stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=0), timeout=60)
        assert (base.step, base.critic_version) == (0, 0)
        assert _values(stub, sequences) == first  # step 0: the base critic, its head at zero
    finally:
        stop(children)


def _train_varied(stub, sequences, step: int) -> critic_pb2.TrainResponse:
    """Returns that differ by sequence and token: a rank that learned another rank's rows would learn other values."""
    old = _values(stub, sequences)
    targets = [critic_pb2.ValueTarget(sequence=s, returns=[(i % 3 - 1.0) + 0.25 * t for t in range(len(v))],
                                      old_values=v) for i, (s, v) in enumerate(zip(sequences, old))]
    return stub.Train(iter([critic_pb2.TrainRequest(job_id="t", step=step, targets=targets)]), timeout=120)


def test_two_critic_ranks_learn_exactly_what_one_does(tmp_path, model_cache):
    """7 sequences in 4 mini-batches (2, 2, 2, 1 rows): rank 1 has no row in the last step and runs padding."""
    seen = {}
    for ranks in (1, 2):
        job = make_job(algorithm={"advantage": "gae", "epochs": 2, "miniBatches": 4},
                       roles={"critic": {"learningRate": 1e-3, "valueClip": 0.5, "ranksPerPod": ranks}})
        run_dir = tmp_path / f"ranks-{ranks}"
        children, endpoints, _ = start_workers(job, run_dir, {"critic"})
        try:
            stub = critic_pb2_grpc.CriticStub(wire.channel(endpoints.of("critic")[0], run_token(run_dir)))
            sequences = _sequences(7)
            replies = [_train_varied(stub, sequences, step) for step in range(4)]
            learned = _values(stub, sequences)
            stub.Save(critic_pb2.CheckpointRequest(job_id="t", step=4), timeout=60)
            _train_varied(stub, sequences, 4)
            restored = stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=4), timeout=60)
            assert (restored.step, restored.critic_version) == (4, 4)
            assert _values(stub, sequences) == learned  # the gathered checkpoint restores every rank's shard
            stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=0), timeout=60)
            assert {x for v in _values(stub, sequences) for x in v} == {0.0}  # every rank's shard back to base
            seen[ranks] = ([(r.value_loss, r.value_clip_fraction, r.explained_variance) for r in replies], learned)
        finally:
            stop(children)
    (one_metrics, one_values), (two_metrics, two_values) = seen[1], seen[2]
    assert one_metrics[-1][0] < 0.5 * one_metrics[0][0], one_metrics  # it learns at all
    assert two_metrics == [pytest.approx(m, rel=1e-4, abs=1e-6) for m in one_metrics]
    assert [x for v in two_values for x in v] == pytest.approx([x for v in one_values for x in v], abs=1e-4)


def test_bad_critic_requests_are_refused(tmp_path, model_cache):
    children, endpoints, _ = start_workers(_job(), tmp_path, {"critic"})
    try:
        stub = critic_pb2_grpc.CriticStub(wire.channel(endpoints.of("critic")[0], run_token(tmp_path)))
        good = _sequences(1)[0]
        out_of_range = critic_pb2.ValueSequence(sample_id="a", prompt_ids=[5], completion_ids=[10**6])
        calls = {
            "no sequences": lambda: stub.Values(critic_pb2.ValuesRequest(job_id="t"), timeout=30),
            "token out of range": lambda: stub.Values(critic_pb2.ValuesRequest(job_id="t", sequences=[out_of_range]),
                                                      timeout=30),
            "other job": lambda: stub.Values(critic_pb2.ValuesRequest(job_id="other", sequences=[good]), timeout=30),
            "returns": lambda: stub.Train(iter([critic_pb2.TrainRequest(job_id="t", targets=[critic_pb2.ValueTarget(
                sequence=good, returns=[1.0] * (len(good.completion_ids) + 1),
                old_values=[0.0] * len(good.completion_ids))])]), timeout=30),
            "no messages": lambda: stub.Train(iter([]), timeout=30),
            "one call, two steps": lambda: stub.Train(iter([critic_pb2.TrainRequest(job_id="t", step=step)
                                                             for step in (1, 2)]), timeout=30),
            "a step that came short": lambda: stub.Train(iter([critic_pb2.TrainRequest(
                job_id="t", step=1, step_targets=2, targets=[critic_pb2.ValueTarget(
                    sequence=good, returns=[1.0] * len(good.completion_ids),
                    old_values=[0.0] * len(good.completion_ids))])]), timeout=30),
        }
        for what, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        assert len(_values(stub, [good])[0]) == len(good.completion_ids)  # and it still serves
    finally:
        stop(children)
