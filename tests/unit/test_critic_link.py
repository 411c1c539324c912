"""A critic whose version is not one per batch sent (restarted from an older checkpoint, or a batch learned twice) is
restored to its last checkpoint and learns the batches since again, so it values the policy's samples as the critic of
this policy; one whose checkpoint does not hold what was saved ends the run. test_critic_state covers Train's
idempotence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlfleet.v1 import critic_pb2
from rlfleet.workers.critic.stage import CriticLink
from rlfleet.workers.controller.rollouts import Rollout
from rlfleet.workers.plan import Endpoints

from conftest import make_full_job, sampled


class FakeCritic:
    """Learns each Train once per step, saves and restores its version by step; setting `version` is a restart from
    a checkpoint of that version."""

    def __init__(self, version: int = 0):
        self.version = version
        self.saved = {0: version}
        self.trained: list[int] = []

    def Train(self, requests, timeout):
        request = next(iter(requests))  # the step's stream: its first message names the job
        self.version += 1
        self.trained.append(request.step)
        return critic_pb2.TrainResponse(job_id=request.job_id, critic_version=self.version)

    def Restore(self, request, timeout):
        self.version = self.saved.get(request.step, self.version)
        return critic_pb2.CheckpointResponse(job_id=request.job_id, critic_version=self.version, step=request.step)

    def Save(self, request, timeout):
        self.saved[request.step] = self.version
        return critic_pb2.CheckpointResponse(job_id=request.job_id, critic_version=self.version, step=request.step)


def _link(critic: FakeCritic) -> CriticLink:
    endpoints = Endpoints("", servers={"critic": ["127.0.0.1:1"]})
    ctx = SimpleNamespace(job=make_full_job(), endpoints=endpoints, token="t", leader_epoch=None)
    link = CriticLink(ctx)
    link.stub = critic
    return link


def _learn(link: CriticLink, step: int, samples: int = 1) -> dict:
    rollouts = [Rollout(sample_id=str(i), prompt=0, prompt_ids=[1], answer="", turns=sampled([2]), returns=[1.0],
                        values=[0.0]) for i in range(samples)]
    link.learn(rollouts, step)
    return link.after_train()


def test_a_critic_that_learns_each_batch_once_goes_on():
    link = _link(FakeCritic(10))
    link.restore(10)
    assert [_learn(link, step)["critic_version"] for step in (10, 11)] == [11.0, 12.0]
    assert _learn(link, 12, samples=0) == {}  # a step none of whose samples trained sends the critic nothing
    assert _learn(link, 13)["critic_version"] == 13.0
    link.close()


@pytest.mark.parametrize("version", [1, 4])  # behind: restarted from checkpoint 1; ahead: a batch learned twice
def test_a_critic_out_of_step_with_the_batches_sent_is_restored_and_learns_them_again(version):
    critic = FakeCritic()
    link = _link(critic)
    link.start(0)
    _learn(link, 0), _learn(link, 1)
    link.save(2)
    _learn(link, 2)
    critic.version = version
    assert _learn(link, 3)["critic_version"] == 4.0, "the critic of this policy: version 2 at step 2, two batches since"
    assert critic.trained == [0, 1, 2, 3, 2, 3] and critic.version == 4
    assert _learn(link, 4)["critic_version"] == 5.0
    link.close()


def test_a_critic_restarted_after_its_last_batch_is_recovered_before_it_saves():
    """Killed after it learned the step's batch and restarted from an older checkpoint before the step's Save, it
    would save the older weights under this step, which the trainer's checkpoint then promises (seen in a chaos run:
    resumed from it, the critic went on at version 5 for step 10). It is restored and learns again first."""
    critic = FakeCritic()
    link = _link(critic)
    link.start(0)
    _learn(link, 0), _learn(link, 1)
    link.save(2)
    _learn(link, 2), _learn(link, 3)
    critic.version = 1  # restarted from its checkpoint of an earlier step
    link.save(4)
    assert critic.saved[4] == 4 and critic.trained[-2:] == [2, 3]
    assert link.kept == {} and link.saved == 4
    link.close()


def test_a_critic_whose_checkpoint_is_not_what_it_saved_ends_the_run():
    critic = FakeCritic()
    link = _link(critic)
    link.start(0)
    _learn(link, 0)
    link.save(1)
    critic.saved[1] = 7  # its checkpoint of step 1 holds another critic
    critic.version = 0
    with pytest.raises(RuntimeError, match="the critic is at version 8, not 2 .* after a restore to step 1"):
        _learn(link, 1)
    link.close()
