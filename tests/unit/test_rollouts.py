"""Rollouts as episodes: turns the policy sampled, a guide's and an environment's observations, and what the trainer
takes of them (training_samples)."""

from __future__ import annotations

import pytest

from rlfleet.workers.controller.rollouts import (GUIDE, OBSERVATION, Rollout, Turn, sampled_turn, split_stale,
                                                 training_samples, unsampled_turn)


def episode(*turns: Turn) -> Rollout:
    return Rollout(sample_id="0-0-0", prompt=0, prompt_ids=[1, 2], answer="", turns=list(turns))


def test_a_rollouts_staleness_ignores_unsampled_tokens():
    """Staleness is measured from the oldest sampled token: an observation's context version does not count, and a
    rollout that sampled nothing (a guide) has its context's."""
    tool = episode(sampled_turn([5, 6], [-1.0, -2.0], [4, 5]), unsampled_turn(OBSERVATION, [7, 8], 1),
                   sampled_turn([9], [-0.5], [5]))
    guide = episode(unsampled_turn(GUIDE, [5, 6, 0], 3))
    assert tool.version == 4 and guide.version == 3 and episode().version == 0
    fresh, stale = split_stale([tool, guide], step=5, max_staleness=1)
    assert fresh == [tool] and stale == [guide]


def test_training_samples_carry_which_tokens_were_sampled_and_which_train():
    rollout = episode(sampled_turn([5, 6], [-1.0, -2.0], [4, 5]), unsampled_turn(OBSERVATION, [7], 5),
                      sampled_turn([9], [-0.5], [6]))
    rollout.advantage, rollout.ref_logprobs = 0.5, [-1.5, -1.5, -9.0, -1.5]
    guide = episode(unsampled_turn(GUIDE, [8, 0], 6))
    [tool, solution] = training_samples([rollout, guide])
    assert tool.completion_ids == [5, 6, 7, 9] and tool.gen_logprobs == [-1.0, -2.0, 0.0, -0.5]
    assert tool.sampled == [True, True, False, True] and tool.trained == [True, True, False, True]
    assert tool.prompt_ids == [1, 2] and tool.ref_logprobs == [-1.5, -1.5, -9.0, -1.5] and tool.advantage == 0.5
    assert solution.sampled == [False, False] and solution.trained == [True, True]
    assert solution.gen_logprobs == [0.0, 0.0] and rollout.versions == [4, 5, 5, 6]


def test_a_later_segment_continues_the_last_sampled_turn_under_its_own_version():
    rollout = episode()
    rollout.extend([5, 6], [-1.0, -2.0], 0)
    rollout.extend([7], [-3.0], 1)
    rollout.turns.append(unsampled_turn(OBSERVATION, [8], 1))
    rollout.extend([9], [-4.0], 2)
    assert [t.kind for t in rollout.turns] == ["sampled", OBSERVATION, "sampled"]
    assert rollout.turns[0] == sampled_turn([5, 6, 7], [-1.0, -2.0, -3.0], [0, 0, 1])
    assert rollout.completion_ids == [5, 6, 7, 8, 9] and rollout.versions == [0, 0, 1, 1, 2]


def test_a_turn_refuses_logprobs_that_do_not_match_its_kind():
    with pytest.raises(ValueError, match="sampled turn of 2 tokens has 1 logprobs"):
        sampled_turn([5, 6], [-1.0], [0, 0])
    with pytest.raises(ValueError, match="guide turn of 1 tokens has 1 logprobs"):
        Turn(GUIDE, (5,), (0,), (-1.0,))
    with pytest.raises(ValueError, match="turn kind 'tool'"):
        Turn("tool", (5,), (0,))
