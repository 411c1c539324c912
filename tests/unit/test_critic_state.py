"""The critic's state across retries and restarts: a Train retried after its deadline is learned once, an older step
is refused, a restore goes to exactly the trainer's step (0: the base critic), and pruning keeps the checkpoint the
trainer resumes from. The model tests run the built-in tiny model in this process; the service tests a critic that
counts what it learns."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from rlfleet.v1 import critic_pb2, critic_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.critic.stage import CriticLink
from rlfleet.workers.controller.rollouts import Rollout
from rlfleet.workers.critic.config import CriticRole
from rlfleet.workers.critic.model import Target, ValueTrainer, saved_steps
from rlfleet.workers.critic.server import serve_critic
from rlfleet.workers.models.config import TinyModel
from rlfleet.workers.models.tiny import build_tiny
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port

from conftest import make_job, sampled

TOKEN = "test-token"
PAIRS = [([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14])]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny(TinyModel(), out)
    return out


def _critic(model_dir) -> ValueTrainer:
    return ValueTrainer(model_dir, CriticRole(learning_rate=1e-2), epochs=1, mini_batches=1, seed=0,
                        device=torch.device("cpu"))


def _learn(critic: ValueTrainer, step: int) -> None:
    critic.train([Target(p, c, [1.0] * len(c), [0.0] * len(c)) for p, c in PAIRS], step)


def test_restoring_step_0_gives_the_base_critic_back(tiny_dir, tmp_path):
    """A trainer that died before its first checkpoint restarts from the base policy: so must the critic."""
    critic = _critic(tiny_dir)
    base = {name: value.clone() for name, value in critic.model.state_dict().items()}
    for step in range(2):
        _learn(critic, step)
    assert {x for v in critic.values(PAIRS) for x in v} != {0.0}
    assert critic.load(tmp_path / "none-saved", 0) == 0
    assert critic.version == 0
    assert {x for v in critic.values(PAIRS) for x in v} == {0.0}  # the head is zero again
    for name, value in critic.model.state_dict().items():
        torch.testing.assert_close(value, base[name], rtol=0, atol=0, msg=name)
    assert critic.optimizer.state_dict()["state"] == {}  # no AdamW moments of the steps undone


def test_pruning_keeps_the_checkpoint_the_trainer_resumes_from(tiny_dir, tmp_path):
    """keep 1: the critic saves step 2 before the trainer writes its own; until then the trainer resumes from 1."""
    critic = _critic(tiny_dir)
    critic.save(tmp_path, 1, keep=1)
    critic.save(tmp_path, 2, keep=1)
    assert saved_steps(tmp_path) == [1, 2]
    critic.save(tmp_path, 3, keep=1)
    assert saved_steps(tmp_path) == [2, 3]
    assert critic.load(tmp_path, 7) is None  # no checkpoint of that step: nothing loaded


class CountingCritic:
    """What the service drives, learning nothing: counts the Train steps it ran, each taking `seconds`."""

    vocab_size = 100

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self.version = 0
        self.loaded = 0
        self.learned: list[int] = []
        self.saved: set[int] = set()

    def values(self, pairs):
        return [[0.0] * len(completion) for _, completion in pairs]

    def train(self, targets, step):
        time.sleep(self.seconds)
        self.learned.append(step)
        self.version += 1
        return {"value_loss": float(step), "value_clip_fraction": 0.0, "explained_variance": 0.0,
                "value_mean": 0.0, "train_seconds": self.seconds}

    def save(self, root, step, keep):
        self.saved.add(step)

    def load(self, root, step):
        return step if step in self.saved else None


@pytest.fixture
def served(tmp_path):
    """A CountingCritic behind the real Critic service; yields (critic, address)."""
    def start(seconds: float = 0.0):
        critic = CountingCritic(seconds)
        port = free_port()
        server, _ = serve_critic(make_job(), critic, port, 64, tmp_path, host="127.0.0.1", token=TOKEN)
        servers.append(server)
        return critic, f"127.0.0.1:{port}"

    servers: list[grpc.Server] = []
    yield start
    for server in servers:
        server.stop(grace=None)


def _link(address: str) -> CriticLink:
    job = make_job(algorithm={"advantage": "gae"}, roles={"critic": {}})
    endpoints = Endpoints("", servers={"critic": [address]})
    return CriticLink(WorkerContext(job=job, role="trainer", rank=0, endpoints=endpoints, grpc_port=0,
                                    metrics_port=0, run_dir="", token=TOKEN))


def _rollouts() -> list[Rollout]:
    return [Rollout(str(i), i, list(p), "", turns=sampled(list(c)), values=[0.0] * len(c), returns=[1.0] * len(c))
            for i, (p, c) in enumerate(PAIRS)]


def _train(stub, step: int, returned: float = 1.0) -> critic_pb2.TrainResponse:
    targets = [critic_pb2.ValueTarget(sequence=critic_pb2.ValueSequence(sample_id="0", prompt_ids=[5],
                                                                       completion_ids=[6]),
                                      returns=[returned], old_values=[0.0])]
    return stub.Train(iter([critic_pb2.TrainRequest(job_id="t", step=step, targets=targets)]), timeout=30)


def test_a_train_retried_after_its_deadline_is_learned_once(served):
    """The client's deadline passes while the server still learns; the retry gets the first call's reply."""
    critic, address = served(seconds=1.5)
    link = _link(address)
    link.deadline = 0.3  # shorter than one Train: the first call fails with DEADLINE_EXCEEDED and is retried
    try:
        link.learn(_rollouts(), step=4)
        metrics = link.after_train()
    finally:
        link.close()
    assert critic.learned == [4], "the batch was learned more than once"
    assert (metrics["value_loss"], metrics["critic_version"]) == (4.0, 1.0)


def test_train_is_idempotent_by_step_and_refuses_older_steps(served):
    critic, address = served()
    stub = critic_pb2_grpc.CriticStub(wire.channel(address, TOKEN))
    first = _train(stub, 0)
    assert _train(stub, 0) == first  # a repeat: the same reply, nothing learned again
    _train(stub, 1)
    with pytest.raises(grpc.RpcError) as refused:
        _train(stub, 0)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "learned up to step 1" in refused.value.details()
    with pytest.raises(grpc.RpcError) as other:  # the same step, another batch: not a retry
        _train(stub, 1, returned=2.0)
    assert other.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another batch under this step" in other.value.details()
    assert critic.learned == [0, 1]


def test_restore_goes_to_exactly_the_step_or_refuses(served):
    critic, address = served()
    stub = critic_pb2_grpc.CriticStub(wire.channel(address, TOKEN))
    for step in range(3):
        _train(stub, step)
    stub.Save(critic_pb2.CheckpointRequest(job_id="t", step=2), timeout=30)
    restored = stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=2), timeout=30)
    assert restored.step == 2
    with pytest.raises(grpc.RpcError) as refused:  # learned before the checkpoint: no reply to repeat
        _train(stub, 1)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    _train(stub, 2)  # the step after the checkpoint, learned again as the resumed trainer trains it again
    assert critic.learned == [0, 1, 2, 2]
    with pytest.raises(grpc.RpcError) as missing:
        stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=7), timeout=30)
    assert missing.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no critic checkpoint of step 7" in missing.value.details()
    with pytest.raises(grpc.RpcError) as negative:
        stub.Restore(critic_pb2.CheckpointRequest(job_id="t", step=-1), timeout=30)
    assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_retry_waits_for_the_call_it_repeats(served):
    """Two calls of one step at once (the retry of a call still running): one learns, both get its reply."""
    critic, address = served(seconds=0.5)
    stub = critic_pb2_grpc.CriticStub(wire.channel(address, TOKEN))
    replies: list[critic_pb2.TrainResponse] = []
    calls = [threading.Thread(target=lambda: replies.append(_train(stub, 3))) for _ in range(2)]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    assert critic.learned == [3]
    assert replies[0] == replies[1]
