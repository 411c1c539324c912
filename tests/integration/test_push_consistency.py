"""A generator never loads a mix of two policy versions, even when it posts its receives late.

The real trainer (`Trainer`: its train command runs the optimizer step, its publish command the real
`ShardPublisher`) pushes version after version to a receiver that posts its receives only after the
trainer's next optimizer step (or a few seconds, whichever comes first). What the receiver got is
compared, tensor by tensor and byte for byte, with what the trainer held when it published. Both ways
of keeping a push whole are checked: waiting for the sends before the step (the default) and sending
from a snapshot (weightSync.snapshot), each with the receiver checking every push by content (weightSync.verify)
as well.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from rlfleet.workers.auth import sync_key
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port

from conftest import make_job
from trainer_samples import Sample
from support import FIXED_TOKEN, end_trainer_rank

pytestmark = pytest.mark.integration
# Whole-row blocks of 40 MiB (gate/up/down rows of 10240 x 1024 float32): direct sends, each larger than
# the loopback socket buffers here (net.core.rmem_max 32 MiB), so no send can hide in a kernel buffer.
MODEL = {"type": "tiny", "hiddenSize": 1024, "numHeads": 8, "numLayers": 1, "intermediateSize": 10240}
VERSIONS = 2
# The receiver waits this long for the trainer's next optimizer step before it posts its receives.
SLOW_SECONDS = 5.0


def _samples() -> list[Sample]:
    return [Sample([5, 6, 7], [8 + i, 9, 10], [-4.0, -4.0, -4.0], 1.0 if i % 2 else -1.0) for i in range(4)]


def digests(tensors) -> dict[str, str]:
    return {name: hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
            for name, t in tensors}


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _trainer(job_json: dict, model_dir: str, port: int, sync_port: int, folder: str) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.sync.shards import local_shards
    from rlfleet.workers.trainer.worker import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = parse_job(job_json)
    snapshot = job.spec.weight_sync.snapshot
    ctx = WorkerContext(job=job, role="trainer", rank=0, endpoints=Endpoints(""),
                        grpc_port=0, metrics_port=0, run_dir=folder, token=FIXED_TOKEN)
    trainer = Trainer(ctx, Path(model_dir))
    direct = [b.name for out in trainer.publishers["generator"].of(0).outgoing for b in out.packer.direct]
    (Path(folder) / "direct.json").write_text(json.dumps(direct))
    assert trainer.connect("generator", 0, "127.0.0.1", sync_port, 1) is None
    for version in range(1, VERSIONS + 1):
        trainer.publish("generator", [0])
        assert trainer.publishers["generator"].of(0).live is not snapshot, \
            "live views are sent exactly when not sending from a snapshot"
        (Path(folder) / f"published{version}.json").write_text(json.dumps(digests(local_shards(trainer.model).items())))
        trainer.train(_samples(), 0)
        (Path(folder) / f"stepped{version}").touch()
    assert not trainer.publishers["generator"].of(0).wait()["failed"]
    end_trainer_rank(trainer)


def _receiver(job_json: dict, shapes: dict, vocab: int, sync_port: int, folder: str) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.sync.receiving import ShardReceiver
    from rlfleet.workers.sync.shards import SyncSettings

    settings = SyncSettings.from_job(parse_job(job_json), key=sync_key(FIXED_TOKEN))
    receiver = ShardReceiver(settings, settings.address("127.0.0.1", sync_port, 1), 0, shapes, vocab, "cpu")
    for version in range(1, VERSIONS + 1):
        assert _wait_for(Path(folder) / f"published{version}.json", 300)
        _wait_for(Path(folder) / f"stepped{version}", SLOW_SECONDS)  # slow to post: after the next step if it comes
        receiver.receive()
        (Path(folder) / f"received{version}.json").write_text(json.dumps(digests(receiver.weights())))


@pytest.mark.parametrize("snapshot, verify", [(False, False), (True, False), (False, True)],
                         ids=["wait", "snapshot", "wait-verified"])
def test_late_receiver_gets_exactly_the_published_version(snapshot, verify, tmp_path, model_cache):
    from transformers import AutoConfig

    job = make_job(model=MODEL, algorithm={"learningRate": 0.01}, weightSync={
        "backend": "gloo", "bucketMB": 4, "timeoutSeconds": 120, "snapshot": snapshot, "verify": verify})
    model_dir = materialize(job.spec.model, model_cache)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    context = multiprocessing.get_context("spawn")
    sync_port = free_port()
    folder, data = str(tmp_path), job.to_dict()
    procs = [context.Process(target=_trainer, args=(data, str(model_dir), free_port(), sync_port, folder)),
             context.Process(target=_receiver, args=(data, shapes, config.vocab_size, sync_port, folder))]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
    assert [p.exitcode for p in procs] == [0, 0], "the trainer or the receiver failed"
    direct = json.loads((tmp_path / "direct.json").read_text())
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= set(direct), \
        "no large direct blocks: this test could not see a push that reads live weights"
    for version in range(1, VERSIONS + 1):
        published = json.loads((tmp_path / f"published{version}.json").read_text())
        received = json.loads((tmp_path / f"received{version}.json").read_text())
        changed = sorted(name for name in published if received[name] != published[name])
        assert not changed, f"version {version}: {len(changed)} tensors are not the published ones: {changed}"


def _careless_sender(job_json: dict, shapes: dict, vocab: int, sync_port: int, folder: str) -> None:
    """Publishes live shards and overwrites them at once, as a trainer stepping without release_shards would."""
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.sync.shards import ShardPublisher, SyncSettings

    settings = SyncSettings.from_job(parse_job(job_json), key=sync_key(FIXED_TOKEN))
    shards = {name: torch.full(shape, 1.0) for name, shape in shapes.items()}
    publisher = ShardPublisher(0, settings, shapes, vocab)
    assert publisher.connect(0, "127.0.0.1", sync_port, 1) is None
    publisher.publish(shards, [0])
    assert publisher.live, "nothing travels as a live view: the change below could not reach the receiver"
    for shard in shards.values():
        shard.fill_(2.0)  # the next version, while the sends still read these tensors
    publisher.wait()
    (Path(folder) / "sent").touch()


def _verifying_receiver(job_json: dict, shapes: dict, vocab: int, sync_port: int, folder: str) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.sync.checksum import MIXED, WeightsDiffer
    from rlfleet.workers.sync.receiving import ShardReceiver
    from rlfleet.workers.sync.shards import SyncSettings

    settings = SyncSettings.from_job(parse_job(job_json), key=sync_key(FIXED_TOKEN))
    receiver = ShardReceiver(settings, settings.address("127.0.0.1", sync_port, 1), 0, shapes, vocab, "cpu")
    time.sleep(SLOW_SECONDS)  # posts late: the sender has overwritten its shards by now
    try:
        receiver.receive()
    except WeightsDiffer as error:
        assert MIXED in str(error)
        (Path(folder) / "refused").write_text(str(error))


def test_verify_refuses_a_push_whose_content_changed_in_flight(tmp_path, model_cache):
    """The check `weightSync.verify` adds, shown to catch what it is for: here the sender does change
    the weights a push still reads, and the receiver must refuse that version."""
    from transformers import AutoConfig, AutoModelForCausalLM

    job = make_job(model=MODEL, weightSync={"backend": "gloo", "bucketMB": 4, "timeoutSeconds": 60, "verify": True})
    config = AutoConfig.from_pretrained(materialize(job.spec.model, model_cache))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    context, sync_port, folder = multiprocessing.get_context("spawn"), free_port(), str(tmp_path)
    args = (job.to_dict(), shapes, config.vocab_size, sync_port, folder)
    procs = [context.Process(target=_careless_sender, args=args), context.Process(target=_verifying_receiver, args=args)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    assert (tmp_path / "refused").exists(), "a push whose content changed in flight was accepted"
