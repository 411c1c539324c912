"""An agent session's recorded calls become training samples: the prefix rule, per-token log mu and versions, and
observation tokens unsampled."""

from __future__ import annotations

from rlfleet.workers.controller.rollouts import OBSERVATION, SAMPLED
from rlfleet.workers.environment.record import Call, assemble


def _call(prompt, tokens, version, first_logprob=-0.5):
    return Call(prompt, tokens, [first_logprob - 0.25 * i for i in range(len(tokens))], version)


def test_a_call_that_repeats_the_chat_continues_the_sample_with_an_unsampled_observation():
    first = _call([1, 2, 3], [10, 11], version=4)
    # The agent sends the chat back with a tool's answer [20, 21, 22] and the next assistant header [23].
    second = _call([1, 2, 3, 10, 11, 20, 21, 22, 23], [12, 13, 14], version=5, first_logprob=-1.0)
    [sample] = assemble([first, second])
    assert sample.prompt_ids == [1, 2, 3]
    assert [turn.kind for turn in sample.turns] == [SAMPLED, OBSERVATION, SAMPLED]
    policy, observation, again = sample.turns
    assert (policy.token_ids, policy.logprobs, policy.versions) == ((10, 11), (-0.5, -0.75), (4, 4))
    assert (observation.token_ids, observation.logprobs, observation.versions) == ((20, 21, 22, 23), (), (4,) * 4)
    assert not observation.sampled and not observation.trained
    assert (again.token_ids, again.logprobs, again.versions) == ((12, 13, 14), (-1.0, -1.25, -1.5), (5, 5, 5))
    assert sample.ids == second.prompt_ids + [12, 13, 14]


def test_a_prompt_that_no_longer_starts_with_the_sample_starts_a_new_one():
    first = _call([1, 2, 3], [10, 11, 2], version=0)
    # The template wrote the reply without its end token 2: the sampled tokens are not this prompt's prefix.
    second = _call([1, 2, 3, 10, 11, 20, 21], [12], version=1)
    third = _call([1, 2, 3, 10, 11, 20, 21, 12, 30], [13, 14], version=1)
    old, new = assemble([first, second, third])
    assert old.prompt_ids == [1, 2, 3]
    assert [(t.kind, t.token_ids, t.versions) for t in old.turns] == [(SAMPLED, (10, 11, 2), (0, 0, 0))]
    assert new.prompt_ids == [1, 2, 3, 10, 11, 20, 21]
    assert [(t.kind, t.token_ids, t.versions) for t in new.turns] == [
        (SAMPLED, (12,), (1,)), (OBSERVATION, (30,), (1,)), (SAMPLED, (13, 14), (1, 1))]
    assert new.turns[2].logprobs == (-0.5, -0.75)


def test_a_call_that_only_continues_the_reply_adds_no_observation_and_an_empty_completion_no_turn():
    first = _call([5, 6], [7], version=2)
    cont = _call([5, 6, 7], [8, 9], version=3)
    empty = _call([5, 6, 7, 8, 9, 40], [], version=3)
    [sample] = assemble([first, cont, empty])
    assert [(t.kind, t.token_ids) for t in sample.turns] == [(SAMPLED, (7,)), (SAMPLED, (8, 9)),
                                                              (OBSERVATION, (40,))]
    assert sample.turns[2].versions == (3,)


def test_a_session_without_calls_has_no_samples_and_calls_round_trip_through_json():
    assert assemble([]) == []
    call = Call([1], [2], [-0.1], 7, temperature=0.5, top_p=0.9, finish_reason="stop")
    assert Call.from_json(call.to_json()) == call
