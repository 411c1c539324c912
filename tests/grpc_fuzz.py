"""Hostile requests for the workers' gRPC servers, sent as raw bytes: what each must answer, and with which code.

gRPC decodes a request before the servicer sees it: bytes that are not a message of the method's type get
INTERNAL ("Exception deserializing request!") from grpc itself, a message over the size cap gets
RESOURCE_EXHAUSTED, and anything that decodes must be refused by the servicer (INVALID_ARGUMENT or
FAILED_PRECONDITION). UNKNOWN would mean the servicer raised: a crash, never an answer.
"""

from __future__ import annotations

import random

import grpc
from google.protobuf.message import DecodeError, Message

from rlfleet.workers import wire

UNDECODABLE = grpc.StatusCode.INTERNAL


def call_raw(chan: grpc.Channel, method: str, payload: bytes, timeout: float = 60) -> tuple[grpc.StatusCode, str]:
    """Send payload as the request body of method (e.g. "/rlfleet.v1.Scorer/Score"), no serializer in between."""
    try:
        chan.unary_unary(method)(payload, timeout=timeout)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def random_payloads(seed: int, count: int = 16, longest: int = 4096) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(1, longest)) for _ in range(count)]


def code_for_random(request_type: type[Message], payload: bytes, job_id: str) -> grpc.StatusCode:
    """What a server of job_id must answer to payload: bytes that happen to decode name another job."""
    try:
        request = request_type.FromString(payload)
    except DecodeError:
        return UNDECODABLE
    assert request.job_id != job_id, "the seed made a request of the server's own job: pick another seed"
    return grpc.StatusCode.INVALID_ARGUMENT


def wrong_answers_to_random_bytes(chan: grpc.Channel, method: str, request_type: type[Message], job_id: str,
                                  seed: int, count: int = 16) -> list[tuple[int, grpc.StatusCode, str]]:
    """Random payloads sent to method; (index, code, details) of every answer that is not the due one."""
    wrong = []
    for index, payload in enumerate(random_payloads(seed, count)):
        code, details = call_raw(chan, method, payload)
        if code != code_for_random(request_type, payload, job_id):
            wrong.append((index, code, details))
    return wrong


def oversized() -> bytes:
    """One byte over the servers' cap (the bytes need not decode: the size is checked first)."""
    return b"\0" * (wire.MAX_MESSAGE_BYTES + 1)


def unlimited_channel(address: str, token: str) -> grpc.Channel:
    """A client that sends past the cap (wire.channel would refuse such a message itself, before the server);
    with the job's token, so that the size, not the missing token, is what the server refuses."""
    unlimited = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    return grpc.intercept_channel(unlimited, wire.AttachToken(token))
