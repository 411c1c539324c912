"""The generator's staged weights: a rejoin discards what the old sync group staged, so no load ever swaps
in buffers a new receiver has not filled."""

from __future__ import annotations

import threading

from rlfleet.v1 import generator_pb2, weight_sync_pb2
from rlfleet.workers.engines.base import SegmentOut
from rlfleet.workers.generator.server import GeneratorService


class StagingEngine:
    """Records which receiver's buffers every load swapped in, and whether they had been filled."""

    max_model_len = 64
    vocab_size = 10
    concurrent_receive = True

    def __init__(self):
        self.receivers: list[dict] = []
        self.loaded: list[dict] = []

    def join_sync_group(self, join):
        self.receivers.append({"epoch": join["epoch"], "filled": False})

    def receive_weights(self) -> float:
        self.receivers[-1]["filled"] = True
        return 0.0

    def load_weights(self) -> float:
        self.loaded.append(dict(self.receivers[-1]))
        return 0.0

    def generate(self, sequences, sampling):
        return [SegmentOut([1], [-0.5], True) for _ in sequences]


def _join(epoch: int):
    return weight_sync_pb2.JoinSyncGroupRequest(
        job_id="t", store_host="127.0.0.1", store_port=1234, trainers=1, backend="gloo", timeout_seconds=5,
        dtype="float32", bucket_bytes=1 << 20, epoch=epoch, params=[weight_sync_pb2.ParamShape(name="w", shape=[2])])


def _update(version: int):
    return weight_sync_pb2.UpdateWeightsRequest(job_id="t", policy_version=version)


def _generate():
    return generator_pb2.GenerateRequest(job_id="t", max_tokens=1, temperature=1.0, top_p=1.0, seed=0,
                                         sequences=[generator_pb2.Sequence(sample_id="a", prompt_ids=[1])])


def test_a_rejoin_discards_weights_staged_by_the_old_group():
    engine = StagingEngine()
    service = GeneratorService("t", engine)
    weights = service.weights
    weights.JoinSyncGroup(_join(1), None)
    weights.UpdateWeights(_update(1), None)  # idle: loaded at once
    # Version 2 arrives while a Generate holds the engine: it is received and staged, not loaded.
    with weights.lock:
        received = threading.Thread(target=weights.UpdateWeights, args=(_update(2), None))
        received.start()
        received.join(10)
    assert weights.staged == 2
    weights.JoinSyncGroup(_join(2), None)  # the trainer restarted, or this replica was marked down
    reply = service.Generate(_generate(), None)
    assert all(receiver["filled"] for receiver in engine.loaded), f"unfilled buffers were loaded: {engine.loaded}"
    assert reply.policy_version == 1, "the version staged by the old group must not be claimed"
