"""The critic learns each batch once: a Train retried after its deadline is not learned twice, and a critic whose
version is not one per batch sent (restarted from an older checkpoint) ends the run instead of valuing the policy's
samples from then on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlfleet.v1 import critic_pb2
from rlfleet.workers.controller.critic import CriticLink
from rlfleet.workers.controller.rollouts import Rollout
from rlfleet.workers.critic.server import CriticService

from conftest import make_full_job


class FakeCritic:
    """Learns each Train; `restart(version)` is a restart from a checkpoint of that version."""

    def __init__(self, version: int = 0):
        self.version = version

    def Train(self, request, timeout):
        self.version += 1
        return critic_pb2.TrainResponse(job_id=request.job_id, critic_version=self.version)

    def Restore(self, request, timeout):
        return critic_pb2.CheckpointResponse(job_id=request.job_id, critic_version=self.version, step=request.step)


def _link(critic: FakeCritic) -> CriticLink:
    ctx = SimpleNamespace(job=make_full_job(), endpoints=SimpleNamespace(critics=["127.0.0.1:1"]), token="t")
    link = CriticLink(ctx)
    link.stub = critic
    return link


def _learn(link: CriticLink, step: int, samples: int = 1) -> dict:
    rollouts = [Rollout(sample_id=str(i), prompt=0, prompt_ids=[1], answer="", completion_ids=[2], returns=[1.0],
                        values=[0.0]) for i in range(samples)]
    link.learn(rollouts, step)
    return link.wait()


def test_a_critic_that_learns_each_batch_once_goes_on():
    link = _link(FakeCritic(10))
    link.restore(10)
    assert [_learn(link, step)["critic_version"] for step in (10, 11)] == [11.0, 12.0]
    assert _learn(link, 12, samples=0) == {}  # a step none of whose samples trained sends the critic nothing
    assert _learn(link, 13)["critic_version"] == 13.0
    link.stop()


@pytest.mark.parametrize("version", [1, 3])  # behind: restarted from checkpoint 1; ahead: a batch learned twice
def test_a_critic_out_of_step_with_the_batches_sent_ends_the_run(version):
    critic = FakeCritic()
    link = _link(critic)
    _learn(link, 0), _learn(link, 1)
    critic.version = version
    with pytest.raises(RuntimeError, match=f"the critic is at version {version + 1}, not 3"):
        _learn(link, 2)
    link.stop()


class FakeValueTrainer:
    """The critic's model as the service drives it: each "train" command is one version."""

    vocab_size = 100

    def __init__(self):
        self.version = 0

    def commands(self):
        return self

    def command(self, name, *args):
        if name == "train":
            self.version += 1
            return {"value_loss": 0.5}
        return args[1]  # "load": the step asked for


def _train(service: CriticService, step: int) -> critic_pb2.TrainResponse:
    target = critic_pb2.ValueTarget(sequence=critic_pb2.ValueSequence(sample_id="a", prompt_ids=[1], completion_ids=[2]),
                                    returns=[1.0], old_values=[0.0])
    return service.Train(critic_pb2.TrainRequest(job_id="t", step=step, targets=[target]), None)


def test_a_train_retried_after_its_deadline_is_answered_not_learned_twice(tmp_path):
    critic = FakeValueTrainer()
    service = CriticService(make_full_job(), critic, 64, tmp_path)
    assert [_train(service, step).critic_version for step in (0, 0, 1)] == [1, 1, 2]
    service.Restore(critic_pb2.CheckpointRequest(job_id="t", step=1), None)
    assert _train(service, 1).critic_version == 3, "after a restore, its steps are learned again"
