"""Weight sync survives a generator that dies mid-sync: reported within the deadline, the others go on,
and the restarted generator rejoins with the current weights before it generates."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rlfleet.v1 import generator_pb2, generator_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.controller.links import GeneratorLinks
from rlfleet.workers.local import spawn, stop
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.sync.shards import ShardPublisher, SyncSettings, global_shapes, local_shards

from conftest import make_job
from support import start_workers

pytestmark = pytest.mark.integration
DEADLINE = 5.0


class RankZero:
    """Trainer rank 0 of a one-rank job, without training: its model and its shard publisher."""

    def __init__(self, model, job):
        self.model = model
        self.world_size = 1
        self.publisher = ShardPublisher(0, SyncSettings.from_job(job), global_shapes(model), model.config.vocab_size)

    def command(self, name, *args):
        if name == "connect":
            return self.publisher.connect(*args)
        assert name == "publish"
        return self.publisher.publish(local_shards(self.model), *args)


def _version(stub) -> int:
    return stub.Status(generator_pb2.GeneratorStatusRequest(job_id="t"), timeout=10).policy_version


def test_dead_generator_is_reported_others_continue_and_it_rejoins(tmp_path, model_cache):
    from transformers import AutoModelForCausalLM

    job = make_job(roles={"generator": {"engine": "torch", "replicas": 2}},
                   weightSync={"backend": "gloo", "timeoutSeconds": DEADLINE})
    model = AutoModelForCausalLM.from_pretrained(materialize(job.spec.model, model_cache), dtype=torch.float32)
    children, endpoints, ports = start_workers(job, tmp_path, {"generator"})
    try:
        ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=endpoints, grpc_port=0, metrics_port=0,
                            run_dir=str(tmp_path))
        stubs = [generator_pb2_grpc.GeneratorStub(wire.channel(a)) for a in endpoints.generators]
        links = GeneratorLinks(ctx, RankZero(model, job), stubs, version=0)
        links.join_all()
        links.publish(1)
        links.wait()
        assert [_version(s) for s in stubs] == [1, 1]

        os.killpg(children[1].process.pid, signal.SIGKILL)
        started = time.monotonic()
        links.publish(2)
        links.wait()
        links.publish(3)  # waits for the failed send to the dead replica: bounded by the deadline
        links.wait()
        assert time.monotonic() - started < 2 * DEADLINE + 5
        assert links.down == {1}
        assert _version(stubs[0]) == 3, "the live replica must keep receiving"

        children[1] = spawn(children[1].worker, tmp_path)
        wire.wait_ready(endpoints.generators[1], 120)
        links.rejoin_returned()
        assert links.down == set()
        assert _version(stubs[1]) == 3, "a rejoined replica gets the current version before it generates"
        links.publish(4)
        links.wait()
        assert [_version(s) for s in stubs] == [4, 4]
    finally:
        stop(children)
