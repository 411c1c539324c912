"""Calls whose messages grow with prompts x samples x tokens, split into parts that fit gRPC's message limit.

A batch of 128 prompts x 16 samples x 8,192 tokens is a 107 MiB Generate reply, past wire.MAX_MESSAGE_BYTES. Each
client gives the bytes every item adds to its request and to its reply (upper bounds, from token counts), and
`call_in_parts` makes as few calls as fit. A call refused RESOURCE_EXHAUSTED all the same (an estimate fell short,
or the peer's limit is lower) is halved and retried: it says the message was too large, never that the peer is lost.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import grpc

from rlfleet.workers import wire

log = logging.getLogger(__name__)
# A message's own fields (job id, version, step, sampling) and gRPC's framing, beyond what its items count.
HEADROOM_BYTES = 64 << 10
# Protobuf sizes: a token id is a varint of at most 5 bytes (never negative); a float is 4; a field's tag and
# length prefix are at most 6 (1 + a 5-byte varint).
ID_BYTES = 5
FLOAT_BYTES = 4
FIELD_BYTES = 6
# What shrinks one completion's message (to a scorer, the reference, the critic).
COMPLETION_FIELD = "spec.generation.maxNewTokens"
# What shrinks one sequence's Generate reply (a segment's token ids and log-probs).
SEGMENT_FIELD = "spec.generation.segmentTokens (or maxNewTokens)"


@dataclass(frozen=True)
class Size:
    """What one item adds to a call's request and to its reply, in bytes at most."""

    request: int
    reply: int


# Each part of the items and the reply to its call, in order.
Replies = Iterator[tuple[range, Any]]


class TooLarge(RuntimeError):
    """One item alone exceeds the message limit: no split can carry it."""


def ids_bytes(count: int) -> int:
    return FIELD_BYTES + ID_BYTES * count


def floats_bytes(count: int) -> int:
    return FIELD_BYTES + FLOAT_BYTES * count


def text_bytes(text: str) -> int:
    return FIELD_BYTES + len(text.encode())


def sequence_bytes(sample_id: str, prompt_tokens: int, completion_tokens: int) -> int:
    """A (sample_id, prompt_ids, completion_ids) message: Generator's Sequence, Reference's and Critic's alike."""
    return FIELD_BYTES + text_bytes(sample_id) + ids_bytes(prompt_tokens) + ids_bytes(completion_tokens)


def generate_size(sample_id: str, prompt_tokens: int, completion_tokens: int, max_tokens: int) -> Size:
    """A sequence sent to Generate, answered with a Segment of at most `max_tokens` ids and log-probs."""
    return Size(sequence_bytes(sample_id, prompt_tokens, completion_tokens),
                FIELD_BYTES + text_bytes(sample_id) + ids_bytes(max_tokens) + floats_bytes(max_tokens)
                + 2)  # finished


def per_token_size(sequence: Any) -> Size:
    """A (sample_id, prompt_ids, completion_ids) message sent whole, answered with one float per completion token
    (LogProbs, Values)."""
    completion = len(sequence.completion_ids)
    return Size(sequence_bytes(sequence.sample_id, len(sequence.prompt_ids), completion),
                FIELD_BYTES + text_bytes(sequence.sample_id) + floats_bytes(completion))


def budget() -> int:
    """Bytes of items one message may carry."""
    return wire.MAX_MESSAGE_BYTES - HEADROOM_BYTES


def plan(sizes: Sequence[Size], what: str, lower: str, limit: int | None = None,
         most: int | None = None) -> list[range]:
    """Consecutive parts of the items, as few as fit: each part's request and reply within `limit` bytes (the
    budget by default) and at most `most` items (wire.MAX_SEQUENCES by default). TooLarge names `lower`, the field
    that shrinks an item, when one alone does not fit."""
    limit = budget() if limit is None else limit
    most = wire.MAX_SEQUENCES if most is None else most
    parts, start, request, reply = [], 0, 0, 0
    for index, size in enumerate(sizes):
        if max(size.request, size.reply) > limit:
            raise _too_large(what, index, max(size.request, size.reply), lower)
        full = request + size.request > limit or reply + size.reply > limit or index - start >= most
        if full:
            parts.append(range(start, index))
            start, request, reply = index, 0, 0
        request, reply = request + size.request, reply + size.reply
    if sizes:
        parts.append(range(start, len(sizes)))
    return parts


def call_in_parts(sizes: Sequence[Size], call: Callable[[range], Any], what: str, lower: str,
                  limit: int | None = None) -> Replies:
    """(part, reply) of `call` on each planned part of the items, in order; a part refused RESOURCE_EXHAUSTED is
    halved and retried, and TooLarge names `lower` when a single item is refused."""
    waiting = collections.deque(plan(sizes, what, lower, limit))
    while waiting:
        part = waiting.popleft()
        try:
            reply = call(part)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            if len(part) == 1:
                raise _too_large(what, part.start, None, lower) from error
            half = part.start + len(part) // 2
            log.warning("%s of %d items was too large (%s); sending it in two halves", what, len(part),
                        error.details())
            waiting.extendleft([range(half, part.stop), range(part.start, half)])
            continue
        yield part, reply


def per_token_calls(sequences: Sequence[Any], call: Callable[[Sequence[Any]], Any], what: str) -> Replies:
    """call_in_parts for sequences answered one float per completion token: `call` gets each part's sequences."""
    return call_in_parts([per_token_size(s) for s in sequences], lambda part: call(sequences[part.start:part.stop]),
                         what, COMPLETION_FIELD)


def call_streamed(sizes: Sequence[Size], call: Callable[[list[range]], Any], what: str, lower: str) -> Any:
    """`call` with the planned parts of the items, one streamed message each; refused RESOURCE_EXHAUSTED, it is made
    again with parts of at most half as many items, and TooLarge names `lower` once every part is a single item."""
    most = wire.MAX_SEQUENCES
    while True:
        parts = plan(sizes, what, lower, most=most)
        try:
            return call(parts)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            most = max(len(part) for part in parts) // 2
            if most == 0:
                raise _too_large(what, None, None, lower) from error
            log.warning("%s was too large (%s); streaming it in messages of at most %d items", what,
                        error.details(), most)


def _too_large(what: str, index: int | None, size: int | None, lower: str) -> TooLarge:
    needs = f"{size} bytes, over" if size is not None else "more than"
    item = "an item" if index is None else f"item {index}"
    return TooLarge(f"{what}: {item} alone needs {needs} the {wire.MAX_MESSAGE_BYTES} bytes a gRPC message may "
                    f"carry (less {HEADROOM_BYTES} for its other fields); lower {lower}")

