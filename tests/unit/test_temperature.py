"""generation.adaptiveTemperature: the generators sample hotter while what they sample is too alike (its entropy
below a target, or too many groups that scored alike), never colder than generation.temperature nor hotter than
maxTemperature, and a resumed run goes on from the temperature it had."""

from __future__ import annotations

import math

import pytest

from conftest import make_job, sampled
from fleet_fakes import FakeGenerator, make_parts
from rlfleet.v1 import generator_pb2
from rlfleet.workers.controller.producer import RolloutProducer
from rlfleet.workers.controller.record import uniform_groups
from rlfleet.workers.controller.rollouts import GUIDE, Rollout, sampled_entropy, unsampled_turn
from rlfleet.workers.controller.temperature import SamplingTemperature, next_temperature


def rollout(logprobs: list[float], prompt: int = 0, reward: float = 0.0) -> Rollout:
    ids = [5] * len(logprobs)
    return Rollout(sample_id=f"{prompt}-{len(logprobs)}-{reward}", prompt=prompt, prompt_ids=[1], answer="0",
                   turns=sampled(ids, logprobs), reward=reward)


def adapting(tmp_path, temperature: float = 1.0, **settings) -> SamplingTemperature:
    job = make_job(generation={"temperature": temperature, "adaptiveTemperature": settings})
    return SamplingTemperature(job.spec.generation, str(tmp_path))


def test_the_entropy_is_the_mean_negative_logprob_of_the_sampled_tokens():
    assert sampled_entropy([rollout([-1.0, -2.0]), rollout([-3.0])]) == pytest.approx(2.0)
    assert sampled_entropy([]) is None


def guide(prompt: int, reward: float) -> Rollout:
    return Rollout(sample_id=f"{prompt}-guide", prompt=prompt, prompt_ids=[1], answer="0",
                   turns=[unsampled_turn(GUIDE, [5], 0)], reward=reward)


def test_a_group_teaches_nothing_when_the_policys_own_completions_all_scored_alike():
    batch = [rollout([-1.0], 0, 1.0), rollout([-1.0, -1.0], 0, 1.0), rollout([-1.0], 1, 0.0), rollout([-1.0], 1, 1.0),
             rollout([-1.0], 2, 0.0), guide(2, 1.0)]  # a guide is not the policy's: group 2 alike
    assert uniform_groups(batch) == pytest.approx(2 / 3)


def test_the_temperature_rises_below_the_target_and_falls_above_it_within_its_bounds():
    assert next_temperature(1.0, 0.5, 1.0, 1.5) == pytest.approx(math.exp(0.25))
    assert next_temperature(1.4, -0.5, 1.0, 1.5) == pytest.approx(1.4 * math.exp(-0.25))
    assert next_temperature(1.0, -1.0, 1.0, 1.5) == 1.0  # never colder than generation.temperature
    assert next_temperature(1.4, 1.0, 1.0, 1.5) == 1.5  # nor hotter than maxTemperature


def test_the_target_is_a_share_of_the_first_steps_entropy_and_each_step_moves_towards_it(tmp_path):
    stage = adapting(tmp_path, targetRatio=0.5)
    first = stage.shape([rollout([-2.0, -2.0])])
    assert first == {"sampling_temperature": 1.0, "target_entropy": 1.0}  # its entropy, 2, is above the target
    stage.shape([rollout([-0.5])])
    assert stage.temperature() == pytest.approx(math.exp(0.25))
    assert stage.shape([]) == {"sampling_temperature": pytest.approx(math.exp(0.25)), "target_entropy": 1.0}
    stage.shape([rollout([-1.5])])
    assert stage.temperature() == pytest.approx(1.0)


def groups(solved: int, varied: int, unsolved: int = 0) -> list[Rollout]:
    """Groups of two completions: `solved` that both scored 1, then `varied` that scored 0 and 1, then `unsolved`."""
    rewards = [(1.0, 1.0)] * solved + [(0.0, 1.0)] * varied + [(0.0, 0.0)] * unsolved
    return [rollout([-1.0], p, r) for p, pair in enumerate(rewards) for r in pair]


def test_following_solved_groups_the_share_of_the_newest_groups_solved_in_every_sample_moves_it(tmp_path):
    stage = adapting(tmp_path, follows="solvedGroups", solvedShare=0.25)
    assert stage.shape(groups(3, 1)) == {"sampling_temperature": pytest.approx(math.exp(0.5 * 0.5)),
                                         "solved_groups": 0.75}
    stage.shape(groups(0, 4))  # the window: 3 of 8 solved
    assert stage.temperature() == pytest.approx(math.exp(0.5 * 0.5) * math.exp(0.5 * 0.125))
    for _ in range(8):  # 32 groups unsolved: the first batch has left the window
        stage.shape(groups(0, 0, 4))
    assert stage.solved.count(True) == 0
    assert stage.temperature() == 1.0


def test_groups_that_all_scored_0_cool_it_so_samples_a_hotter_policy_fails_do_not_heat_it(tmp_path):
    stage = adapting(tmp_path, follows="solvedGroups", solvedShare=0.25)
    stage.current = 1.4
    stage.shape(groups(0, 0, 4))
    assert stage.temperature() == pytest.approx(1.4 * math.exp(0.5 * -0.25))


def test_a_resumed_run_samples_at_the_temperature_of_its_checkpoint(tmp_path):
    stage = adapting(tmp_path, maxTemperature=2.0)
    stage.shape([rollout([-2.0])])
    stage.save(1)
    stage.shape([rollout([-0.1])])
    stage.save(2)
    stage.shape([rollout([-0.1])])  # after the last checkpoint: lost with the run
    resumed = adapting(tmp_path, maxTemperature=2.0)
    resumed.start(2)
    assert (resumed.current, resumed.target) == (pytest.approx(1.0 * math.exp(0.5 * 0.9)), 1.0)
    fresh = adapting(tmp_path)
    fresh.start(0)
    assert (fresh.current, fresh.target) == (1.0, None)


def test_a_resumed_run_keeps_the_groups_its_share_was_taken_over(tmp_path):
    stage = adapting(tmp_path, follows="solvedGroups")
    stage.shape(groups(1, 2, 1))
    stage.save(1)
    resumed = adapting(tmp_path, follows="solvedGroups")
    resumed.start(1)
    assert (resumed.current, list(resumed.solved)) == (stage.current, [True, False, False, False])


class HotterIsFlatter(FakeGenerator):
    """Says each token's logprob is -temperature, so that the entropy the stage sees rises with the temperature of
    the call, and keeps the temperature of every call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.temperatures: list[float] = []

    def Generate(self, request, timeout=None):
        self.temperatures.append(request.temperature)
        reply = super().Generate(request, timeout)
        return generator_pb2.GenerateResponse(job_id=reply.job_id, policy_version=reply.policy_version, segments=[
            generator_pb2.Segment(sample_id=s.sample_id, token_ids=s.token_ids, finished=s.finished,
                                  logprobs=[-request.temperature] * len(s.token_ids)) for s in reply.segments])


def test_every_generate_call_samples_at_the_temperature_the_last_step_set(tmp_path):
    job = make_job(algorithm={"groupSize": 2, "promptsPerStep": 2, "steps": 3, "maxStaleness": 4},
                   generation={"maxNewTokens": 1, "adaptiveTemperature": {"targetRatio": 1.0}})
    generator = HotterIsFlatter(tokens=1)
    parts, _ = make_parts(job, tmp_path, [generator])
    stage = SamplingTemperature(job.spec.generation, str(tmp_path))
    parts.stages.append(stage)
    producer = RolloutProducer(parts, generator, 0)
    producer._produce(parts.dispatch.claim(0))
    stage.shape(parts.buffer.take(0, timeout=1).rollouts)  # the target: entropy 1, at temperature 1
    stage.current = 1.25  # as if the policy had sharpened
    producer._produce(parts.dispatch.claim(0))
    stage.shape(parts.buffer.take(1, timeout=1).rollouts)  # entropy 1.25 at 1.25: above the target, cooler
    assert generator.temperatures == pytest.approx([1.0, 1.25])
    assert parts.temperature() == pytest.approx(1.25 * math.exp(-0.5 * 0.25))
