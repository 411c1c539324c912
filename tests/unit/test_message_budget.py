"""Calls that grow with prompts x samples x tokens split under gRPC's message limit (message_budget): the plan, the
halving of a part refused RESOURCE_EXHAUSTED, the clear error for one item that cannot fit, and sizes that bound
the real protobuf messages."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from conftest import make_job
from fleet_fakes import RpcFailure
from rlfleet.v1 import critic_pb2, generator_pb2, reference_pb2
from rlfleet.workers import message_budget, wire
from rlfleet.workers.engines import PROMPT_BUDGET
from rlfleet.workers.message_budget import Size, TooLarge, call_in_parts, call_streamed, plan

# The largest token id an int32 field carries: the longest varint a token id can be.
WORST_ID = (1 << 31) - 1


def _covered(parts: list[range], count: int) -> list[int]:
    return [index for part in parts for index in part] == list(range(count))


def test_parts_are_as_large_as_the_budget_allows_on_both_request_and_reply():
    parts = plan([Size(10, 30)] * 10, "Generate", "spec.x", limit=100)
    assert parts == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]  # 3 replies of 30 fit in 100, 4 do not
    parts = plan([Size(30, 10)] * 10, "Generate", "spec.x", limit=100)
    assert parts == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
    assert plan([Size(1, 1)] * 10, "Generate", "spec.x", limit=100) == [range(0, 10)]
    assert plan([], "Generate", "spec.x", limit=100) == []


def test_a_part_never_carries_more_sequences_than_a_server_accepts(monkeypatch):
    monkeypatch.setattr(wire, "MAX_SEQUENCES", 4)
    parts = plan([Size(1, 1)] * 10, "Values", "spec.x", limit=1000)
    assert [len(p) for p in parts] == [4, 4, 2] and _covered(parts, 10)


def test_an_item_too_large_alone_names_the_field_to_lower():
    with pytest.raises(TooLarge, match=r"Generate on generator replica 0: item 2 alone needs 101 bytes.*"
                                       r"lower spec\.generation\.segmentTokens"):
        plan([Size(1, 1), Size(1, 1), Size(1, 101)], "Generate on generator replica 0",
             "spec.generation.segmentTokens", limit=100)


class RefusesLarge:
    """A peer whose messages fit only `most` items: larger calls fail RESOURCE_EXHAUSTED, as gRPC fails them."""

    def __init__(self, most: int):
        self.most = most
        self.calls: list[range] = []

    def __call__(self, part: range) -> list[int]:
        self.calls.append(part)
        if len(part) > self.most:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Sent message larger than max")
        return list(part)


def test_a_part_refused_as_too_large_is_halved_until_it_fits_and_every_item_is_answered_once_in_order():
    peer = RefusesLarge(most=3)
    replies = list(call_in_parts([Size(1, 1)] * 10, peer, "LogProbs", "spec.x", limit=1000))
    assert [item for _, reply in replies for item in reply] == list(range(10))
    assert all(reply == list(part) for part, reply in replies)
    assert peer.calls[0] == range(0, 10) and all(len(p) <= 3 for p, _ in replies)


def test_a_single_item_refused_as_too_large_names_the_field_to_lower():
    with pytest.raises(TooLarge, match=r"Values on the critic: item 0 alone needs more than .* lower "
                                       r"spec\.generation\.maxNewTokens"):
        list(call_in_parts([Size(1, 1)] * 4, RefusesLarge(most=0), "Values on the critic",
                           message_budget.COMPLETION_FIELD, limit=1000))


def test_a_stream_refused_as_too_large_is_sent_again_in_messages_of_half_as_many_items():
    sent: list[list[range]] = []

    def stream(parts: list[range]) -> int:
        sent.append(parts)
        if max(len(p) for p in parts) > 3:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max")
        return len(sent)

    assert call_streamed([Size(1, 0)] * 10, stream, "Train", "spec.x") == 3
    assert [max(len(p) for p in parts) for parts in sent] == [10, 5, 2]
    assert all(_covered(parts, 10) for parts in sent)


def test_a_stream_refused_item_by_item_names_the_field_to_lower():
    def refused(parts):
        raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED)

    with pytest.raises(TooLarge, match=r"Train on the critic: an item alone needs more than .* lower "
                                       r"spec\.generation\.maxNewTokens"):
        call_streamed([Size(1, 0)] * 3, refused, "Train on the critic", message_budget.COMPLETION_FIELD)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT])
def test_other_errors_pass_through_unsplit(code):
    calls = []

    def fails(part):
        calls.append(part)
        raise RpcFailure(code)

    with pytest.raises(grpc.RpcError) as raised:
        list(call_in_parts([Size(1, 1)] * 4, fails, "Score", "spec.x", limit=1000))
    assert raised.value.code() == code and calls == [range(0, 4)]


def _framed(message) -> int:
    """A message as a repeated field of its parent: its bytes plus tag and length."""
    return message.ByteSize() + message_budget.FIELD_BYTES


def test_sizes_bound_the_real_messages_with_the_longest_token_ids():
    ids, floats = [WORST_ID] * 1000, [-1.5] * 1000
    assert _framed(generator_pb2.Sequence(sample_id="0-1-2", prompt_ids=ids[:300], completion_ids=ids)) <= \
        message_budget.generate_size("0-1-2", 300, 1000, 1000).request
    assert _framed(generator_pb2.Segment(sample_id="0-1-2", token_ids=ids, logprobs=floats, finished=True)) <= \
        message_budget.generate_size("0-1-2", 300, 1000, 1000).reply
    sequence = reference_pb2.TokenSequence(sample_id="0-1-2", prompt_ids=ids[:300], completion_ids=ids)
    size = message_budget.per_token_size(sequence)
    assert _framed(sequence) <= size.request
    assert _framed(reference_pb2.TokenLogProbs(sample_id="0-1-2", logprobs=floats)) <= size.reply
    assert _framed(critic_pb2.TokenValues(sample_id="0-1-2", values=floats)) <= size.reply


def _target(sample_id: str, prompt: int, completion: int) -> critic_pb2.ValueTarget:
    """A critic's Train target of the longest token ids."""
    return critic_pb2.ValueTarget(
        sequence=critic_pb2.ValueSequence(sample_id=sample_id, prompt_ids=[WORST_ID] * prompt,
                                          completion_ids=[WORST_ID] * completion),
        returns=[1.0] * completion, old_values=[1.0] * completion)


def _fits(parts: list[range], sizes: list[Size]) -> bool:
    budget = message_budget.budget()
    return all(sum(sizes[i].request for i in part) <= budget and sum(sizes[i].reply for i in part) <= budget
               and len(part) <= wire.MAX_SEQUENCES for part in parts)


def test_a_job_at_the_schemas_largest_sizes_plans_calls_that_each_fit():
    # The most samples a call may carry, each with the longest prompt and completion the schema allows.
    job = make_job(algorithm={"promptsPerStep": 64, "groupSize": 1024},
                   generation={"maxNewTokens": 131072, "timeoutSeconds": 86400})
    samples = job.spec.algorithm.prompts_per_step * job.spec.algorithm.group_size
    prompt, completion = PROMPT_BUDGET, job.spec.generation.max_new_tokens
    sample_id = f"{job.spec.algorithm.steps}-{samples}-{job.spec.algorithm.group_size}"
    longest = SimpleNamespace(sample_id=sample_id, prompt_ids=range(prompt), completion_ids=range(completion))
    calls = {
        "Generate, first visit": message_budget.generate_size(sample_id, prompt, 0, completion),
        "Generate, last visit": message_budget.generate_size(sample_id, prompt, completion - 1, 1),
        "LogProbs and Values": message_budget.per_token_size(longest),
        "Train": Size(_framed(_target(sample_id, prompt, completion)), 0),  # as the critic link counts it
    }
    for what, size in calls.items():
        sizes = [size] * samples
        parts = plan(sizes, what, "spec.x")
        assert _covered(parts, samples) and _fits(parts, sizes), what
        assert len(parts) > 1, what  # the batch is far past one message: without parts it would never get through
    # The largest reply (a first visit's segments), built for real from the longest token ids, fits the limit.
    part = plan([calls["Generate, first visit"]] * samples, "Generate", "spec.x")[0]
    segment = generator_pb2.Segment(sample_id=sample_id, token_ids=[WORST_ID] * completion,
                                    logprobs=[-1.0] * completion, finished=True)
    reply = generator_pb2.GenerateResponse(job_id="t" * 42, policy_version=1 << 62, segments=[segment] * len(part))
    assert reply.ByteSize() <= wire.MAX_MESSAGE_BYTES
