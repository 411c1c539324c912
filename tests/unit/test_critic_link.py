"""A critic whose version is not one per batch sent (restarted from an older checkpoint, or a batch learned twice) ends
the run instead of valuing the policy's samples from then on; test_critic_state covers Train's idempotence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlfleet.v1 import critic_pb2
from rlfleet.workers.critic.stage import CriticLink
from rlfleet.workers.controller.rollouts import Rollout
from rlfleet.workers.plan import Endpoints

from conftest import make_full_job, sampled


class FakeCritic:
    """Learns each Train; `restart(version)` is a restart from a checkpoint of that version."""

    def __init__(self, version: int = 0):
        self.version = version

    def Train(self, requests, timeout):
        request = next(iter(requests))  # the step's stream: its first message names the job
        self.version += 1
        return critic_pb2.TrainResponse(job_id=request.job_id, critic_version=self.version)

    def Restore(self, request, timeout):
        return critic_pb2.CheckpointResponse(job_id=request.job_id, critic_version=self.version, step=request.step)

    Save = Restore  # saves what it holds, and says its version


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


@pytest.mark.parametrize("version", [1, 3])  # behind: restarted from checkpoint 1; ahead: a batch learned twice
def test_a_critic_out_of_step_with_the_batches_sent_ends_the_run(version):
    critic = FakeCritic()
    link = _link(critic)
    _learn(link, 0), _learn(link, 1)
    critic.version = version
    with pytest.raises(RuntimeError, match=f"the critic is at version {version + 1}, not 3"):
        _learn(link, 2)
    link.close()


def test_a_critic_restarted_after_its_last_batch_fails_the_checkpoint_before_the_trainers():
    """Killed after it learned the step's batch and restarted from an older checkpoint before the step's Save, it
    saves the older weights under this step: the trainer must not write a checkpoint that promises them (seen in a
    chaos run: resumed from it, the critic went on at version 5 for step 10)."""
    critic = FakeCritic()
    link = _link(critic)
    _learn(link, 0), _learn(link, 1)
    link.save(2)  # in step: nothing said
    critic.version = 1  # restarted from its checkpoint of an earlier step
    with pytest.raises(RuntimeError, match="the critic is at version 1, not 2"):
        link.save(4)
    link.close()
