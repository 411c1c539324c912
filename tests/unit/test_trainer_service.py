"""The trainer as an executor: a one-rank Trainer of the tiny model served on loopback (trainer/server.py) and driven
through TrainerLink, the client with a Trainer's interface. A step through the link is the step on the Trainer; a
retried Train is not learned twice; a deposed leader is refused; checkpoints and the best snapshot stay in the
trainer's own run directory."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rlfleet.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.models import materialize, weight_files
from rlfleet.workers.auth import sync_key
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port
from rlfleet.workers.sync import group
from rlfleet.workers.sync.shards import SyncSettings
from rlfleet.workers.controller.recovery import TrainerRecovery
from rlfleet.workers.trainer.checkpoint import BEST_DIR, STATE_FILE
from rlfleet.workers.trainer.link import TrainerLink, TrainerRestarted
from rlfleet.workers.trainer.server import start_trainer_service
from rlfleet.workers.trainer.worker import Trainer

from conftest import make_job
from support import FIXED_TOKEN
from trainer_samples import Sample

JOB = make_job(algorithm={"learningRate": 1e-2})
SAMPLES = [Sample([1, 2, 3], [4, 5], [-3.0, -3.0], 1.0), Sample([6, 7], [8, 9, 10], [-3.5, -3.0, -2.5], -1.0)]
OTHER = [Sample([1, 2, 3], [4, 6], [-3.0, -3.0], 1.0), SAMPLES[1]]
# Wall-clock fields: the only ones two runs of a step may differ in.
TIMINGS = ("train_seconds", "sync_wait_seconds")


def _trainer(run_dir, model_cache, monkeypatch) -> Trainer:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    return Trainer(_ctx(run_dir), materialize(JOB.spec.model, model_cache))


def _ctx(run_dir, epoch: int | None = None, port: int = 0) -> WorkerContext:
    return WorkerContext(job=JOB, role="trainer", rank=0, endpoints=Endpoints(""), grpc_port=port, metrics_port=0,
                         run_dir=str(run_dir), token=FIXED_TOKEN, listen_host="127.0.0.1", leader_epoch=epoch)


@pytest.fixture
def served(tmp_path, model_cache, monkeypatch):
    """(trainer, service, address, run dir): a Trainer served on loopback."""
    port = free_port()
    trainer = _trainer(tmp_path, model_cache, monkeypatch)
    server, service = start_trainer_service(_ctx(tmp_path, port=port), trainer)
    try:
        yield trainer, service, f"127.0.0.1:{port}", tmp_path
    finally:
        server.stop(None).wait(10)
        trainer.stop()


@pytest.fixture
def fresh_link(served):
    """A leader's link to the trainer, which it has not restored yet."""
    found = TrainerLink(_ctx(served[3], epoch=1), served[2])
    yield found
    found.close()


@pytest.fixture
def link(fresh_link):
    """The link once its leader restored the trainer, as every leader does first (a fresh run: nothing to load)."""
    assert fresh_link.resume()["step"] == 0
    return fresh_link


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return trainer.snapshot()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _untimed(metrics: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in metrics.items() if name not in TIMINGS}


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() == code, refused.value
    return refused.value.details()


def test_a_step_through_the_link_is_the_step_on_the_trainer(tmp_path, model_cache, monkeypatch, served, link):
    trainer, _, _, _ = served
    start = _weights(trainer)
    metrics = link.train(SAMPLES, 0)
    through_link = _weights(trainer)
    assert not _same(start, through_link), "the step changed nothing"
    trainer.stop()  # one process group at a time: the direct trainer's next
    direct = _trainer(tmp_path / "direct", model_cache, monkeypatch)
    try:
        expected = direct.train(SAMPLES, 0)
        assert _same(_weights(direct), through_link)
    finally:
        direct.stop()
    monkeypatch.setattr(trainer, "stop", lambda: None)  # stopped above
    assert _untimed(metrics) == pytest.approx(_untimed(expected), rel=0, abs=0)
    assert set(metrics) == set(expected)


def test_describe_gives_the_world_and_the_push_shapes(served, link):
    trainer = served[0]
    assert link.world_size == 1
    # In order: the replicas' receive plan is laid out in it, and the trainers pack their buckets in theirs.
    assert list(link.push_shapes.items()) == list(trainer.push_shapes.items()) and link.push_shapes


def test_the_trainer_which_hosts_a_replicas_store_says_whether_the_replica_waits_in_its_group(link):
    """The controller asks the trainer: its store lives in the trainer's process, never the controller's."""
    port = free_port()
    assert not link.arrived("generator", 0, "127.0.0.1", port, 1)  # hosts the store, where nobody waits yet
    settings = SyncSettings.from_job(JOB, "generator", sync_key(FIXED_TOKEN), 0)
    address = settings.address("127.0.0.1", port, 1)
    for rank in range(settings.trainers, address.world_size):  # the replica's ranks, as open_group marks them
        group._epoch_store(address, False).set(f"{group.ARRIVED}{rank}", "1")
    assert link.arrived("generator", 0, "127.0.0.1", port, 1)
    assert not link.arrived("generator", 0, "127.0.0.1", port, 2), "another epoch's rendezvous"


def test_a_retried_train_is_not_learned_twice_and_another_batch_or_an_older_step_is_refused(served, link):
    trainer = served[0]
    first = link.train(SAMPLES, 0)
    after = _weights(trainer)
    assert link.train(SAMPLES, 0) == first, "a repeat gets the first call's reply"
    assert _same(_weights(trainer), after), "a repeat was learned again"
    details = _refused(lambda: link.train(OTHER, 0), grpc.StatusCode.FAILED_PRECONDITION)
    assert "another batch under this step" in details, details
    link.train(OTHER, 1)
    stepped = _weights(trainer)
    details = _refused(lambda: link.train(SAMPLES, 0), grpc.StatusCode.FAILED_PRECONDITION)
    assert "learned up to step 1" in details, details
    assert _same(_weights(trainer), stepped)


def test_a_trainer_not_restored_since_it_started_refuses_all_that_needs_its_policy(served, fresh_link):
    """A restarted trainer holds its base weights and no sync group: it must not learn, save, snapshot or push them,
    nor join a group, before its leader restores it (ABORTED: the link's TrainerRestarted, which the leader answers
    by restoring it: controller/recovery.py)."""
    trainer, _, _, run_dir = served
    before = _weights(trainer)
    for call in (lambda: fresh_link.train(SAMPLES, 0), lambda: fresh_link.train(SAMPLES, 3),
                 lambda: fresh_link.checkpoint(1, {"step": 1}), fresh_link.snapshot,
                 lambda: fresh_link.save_best(1, {"step": 1}), lambda: fresh_link.publish("generator", [0]),
                 lambda: fresh_link.connect("generator", 0, "127.0.0.1", free_port(), 1)):
        with pytest.raises(TrainerRestarted, match="ABORTED: .*Restore first"):
            call()
    assert _same(_weights(trainer), before)
    assert not (run_dir / "checkpoints").exists()
    assert fresh_link.resume()["step"] == 0
    fresh_link.train(SAMPLES, 3)  # a run that skipped steps 0..2 (too few fresh samples) goes on
    assert not _same(_weights(trainer), before)


def test_a_leader_restores_a_restarted_trainer_and_trains_again_the_steps_since_its_checkpoint(
        tmp_path, model_cache, monkeypatch):
    """The trainer process dies past a checkpoint; another starts with the base weights on the same address. The
    leader's next step restores it, trains again the step it learned since the checkpoint (kept for this), rejoins
    (the generators' groups: here a witness of the weights then) and learns the step: the run goes on, same leader."""
    port, rejoined = free_port(), []
    first = _trainer(tmp_path, model_cache, monkeypatch)
    servers = [start_trainer_service(_ctx(tmp_path, port=port), first)[0]]
    link = TrainerLink(_ctx(tmp_path, epoch=1), f"127.0.0.1:{port}")
    trainers = [first]
    try:
        recovery = TrainerRecovery(link, link.resume()["step"])
        recovery.train(SAMPLES, 0)
        recovery.checkpoint(1, {"step": 1, "data_position": 2, "in_flight": []})
        recovery.train(OTHER, 1)
        learned = _weights(first)
        servers.pop().stop(None).wait(10)
        first.stop()
        trainers.append(_trainer(tmp_path, model_cache, monkeypatch))  # base weights, the same run directory
        servers.append(start_trainer_service(_ctx(tmp_path, port=port), trainers[-1])[0])
        recovery.returned.append(lambda: rejoined.append(_weights(trainers[-1])))
        assert recovery.train(SAMPLES, 2)["tokens"] > 0
        assert len(rejoined) == 1, "rejoined once"
        torch.testing.assert_close(rejoined[0], learned)  # steps 0 and 1 learned, not just the checkpoint's step 0
        assert sorted(recovery.kept) == [1, 2]
    finally:
        link.close()
        for server in servers:
            server.stop(None).wait(10)
        trainers[-1].stop()


def test_a_deposed_leaders_late_call_is_refused_and_not_retried(served, link):
    trainer, _, address, run_dir = served
    link.train(SAMPLES, 0)
    successor = TrainerLink(_ctx(run_dir, epoch=2), address)
    try:
        assert successor.world_size == 1  # epoch 2 called: it leads
        before = _weights(trainer)
        started = time.monotonic()
        with pytest.raises(wire.Fenced, match="deposed controller"):
            link.train(SAMPLES, 1)
        with pytest.raises(wire.Fenced):
            link.checkpoint(1, {"step": 1})
        with pytest.raises(wire.Fenced):
            link.publish("generator", [0])
        assert time.monotonic() - started < 5, "a fenced call was retried"
        assert _same(_weights(trainer), before)
        assert not (run_dir / "checkpoints").exists()
        successor.train(SAMPLES, 1)
    finally:
        successor.close()


def test_resume_without_a_checkpoint_leaves_the_weights_and_starts_fresh(served, link):
    trainer = served[0]
    link.train(SAMPLES, 0)
    trained = _weights(trainer)
    assert link.resume() == {"step": 0, "data_position": 0, "in_flight": []}
    assert _same(_weights(trainer), trained)
    link.train(SAMPLES, 0)  # step 0 is the next to learn again
    assert not _same(_weights(trainer), trained)


def test_checkpoint_and_resume_round_trip_through_the_link(served, link):
    trainer, _, _, run_dir = served
    link.train(SAMPLES, 0)
    state = {"step": 1, "data_position": 7, "in_flight": [{"prompt": 3, "tokens": [1, 2]}]}
    link.checkpoint(1, state)
    assert (run_dir / "checkpoints" / "step-000001" / STATE_FILE).is_file(), "in the trainer's own run directory"
    saved = _weights(trainer)
    first_step_1 = link.train(OTHER, 1)
    assert not _same(_weights(trainer), saved)
    assert link.resume() == state
    assert _same(_weights(trainer), saved), "the checkpoint's weights are back"
    # Step 1 is the next to learn again, from the same weights and optimizer state: the same step.
    assert _untimed(link.train(OTHER, 1)) == pytest.approx(_untimed(first_step_1))


def test_the_best_checkpoint_is_written_from_the_snapshot_the_trainer_keeps(served, link):
    trainer, _, _, run_dir = served
    first = link.snapshot()
    link.train(SAMPLES, 0)
    kept = _weights(trainer)
    second = link.snapshot()
    details = _refused(lambda: link.save_best(first, {"step": 0}), grpc.StatusCode.FAILED_PRECONDITION)
    assert f"snapshot {first} is not the one the trainer keeps ({second})" in details
    link.train(OTHER, 1)
    assert link.best() == {}, "no best checkpoint yet"
    link.save_best(second, {"step": 1, "eval_accuracy": 0.5})
    # What a new leader's evaluation must beat, wherever that leader runs (its own run folder holds no best).
    assert link.best() == {"step": 1, "eval_accuracy": 0.5}
    best = run_dir / "checkpoints" / BEST_DIR
    assert json.loads((best / STATE_FILE).read_text())["eval_accuracy"] == 0.5
    written = {name: tensor for file in weight_files(best) for name, tensor in load_file(file).items()}
    assert written and all(torch.equal(tensor, kept[name]) for name, tensor in written.items()), \
        "best holds the snapshot's weights, not the trainer's now"


def test_idle_attributes_the_trainers_waiting(served, link):
    clock = served[0].clock
    assert clock.state == "starting"
    link.clock.started()
    assert clock.state == "bookkeeping"
    with link.clock.idle("waiting_for_rollouts"):
        assert clock.state == "waiting_for_rollouts"
    assert clock.state == "bookkeeping"
    details = _refused(lambda: link.clock.idle("napping").__enter__(), grpc.StatusCode.INVALID_ARGUMENT)
    assert "'napping' is no idle reason" in details


def _stub(address: str):
    return trainer_pb2_grpc.TrainerStub(wire.channel(address, FIXED_TOKEN, 1))


def _message(samples, **fields) -> trainer_pb2.TrainerTrainRequest:
    from rlfleet.workers.trainer.link import _sample

    return trainer_pb2.TrainerTrainRequest(job_id="t", step=0, samples=[_sample(s) for s in samples], **fields)


@pytest.mark.parametrize("samples, field", [
    ([Sample([1, 2], [4, 5], [-3.0], 1.0)], "gen_logprobs"),
    ([Sample([1, 2], [4, 5], [-3.0, -3.0], 1.0, sampled=[True])], "sampled"),
    ([Sample([1, 2], [4, 5], [-3.0, -3.0], 1.0, token_advantages=[1.0, 2.0, 3.0])], "token_advantages"),
    ([Sample([1, 2], [4, 5], [-3.0, -3.0], 1.0, ref_logprobs=[-1.0])], "ref_logprobs"),
    ([Sample([], [4, 5], [-3.0, -3.0], 1.0)], "empty prompt"),
    ([Sample([1, 2], [4, 1 << 20], [-3.0, -3.0], 1.0)], "completion_ids must be in"),
    ([], "samples: need 1.."),
])
def test_a_malformed_train_is_an_invalid_argument_naming_the_field(served, samples, field):
    trainer = served[0]
    before = _weights(trainer)
    details = _refused(lambda: _stub(served[2]).Train(iter([_message(samples)]), timeout=30),
                       grpc.StatusCode.INVALID_ARGUMENT)
    assert field in details, details
    assert _same(_weights(trainer), before)


def test_a_step_that_came_short_is_refused(served):
    details = _refused(lambda: _stub(served[2]).Train(iter([_message(SAMPLES[:1], step_samples=2)]), timeout=30),
                       grpc.StatusCode.INVALID_ARGUMENT)
    assert "brought 1 of its 2 samples" in details, details


def test_a_step_streamed_in_several_messages_is_learned_as_one(served, link):
    trainer = served[0]
    stub = _stub(served[2])  # of the restored link's epoch
    parts = [_message(SAMPLES[:1], step_samples=2), _message(SAMPLES[1:], step_samples=2)]
    reply = stub.Train(iter(parts), timeout=60)
    assert reply.step == 1 and reply.metrics["tokens"] > 0
    # The same step sent whole is a repeat of it.
    assert stub.Train(iter([_message(SAMPLES)]), timeout=60) == reply
    assert trainer.optimizer.state, "learned"
