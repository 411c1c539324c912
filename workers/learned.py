"""Train calls idempotent by step, the critic's and the trainer's.

A client retries a call whose deadline passed while the server was still learning, and a batch must be learned once.
The server keeps the last step it learned, its reply and its request's digest; a repeat gets that reply, an older
step is refused. The key is the step: one Train call carries a whole step's batch, and a call of the same step with
other contents is refused, not answered (a step sent in several calls would need its key to name the part).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import grpc
from google.protobuf.message import Message

from rlfleet.workers import wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Learned:
    """The last step a server learned (-1: none), its Train reply and the request's digest (None when it came from
    a checkpoint)."""

    step: int
    reply: Any = None
    digest: bytes | None = None

    def repeat(self, step: int, digest: bytes, context: grpc.ServicerContext, who: str, where: str = "") -> Any:
        """The reply to a Train of a step learned already (`step` <= self.step): the first call's if this one repeats
        it, or a refusal naming `who` learned and `where` its weights are."""
        if step == self.step and self.reply is not None:
            if digest == self.digest:
                log.warning("Train of step %d again (a retry): answered with what it learned, not learned twice", step)
                return self.reply
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"step {step}: {who} learned another batch under this step; a step's batch comes in one "
                          f"Train call")
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"step {step}: {who} has learned up to step {self.step}{where}; a batch is learned once, in step "
                      f"order (Restore a checkpoint to go back)")


def digest(request: Message) -> bytes:
    return hashlib.blake2b(request.SerializeToString(deterministic=True), digest_size=16).digest()


def whole_step(parts: Sequence[Any], items: str, count: str, context: grpc.ServicerContext) -> tuple[Any, list]:
    """A Train call's streamed messages as one step: its first message and the `items` of them all. INVALID_ARGUMENT
    unless they name one job and step and bring as many items as the first one's `count` (0: its own)."""
    if not parts:
        wire.invalid(context, "Train needs at least one message")
    steps = {(part.job_id, part.step) for part in parts}
    if len(steps) > 1:
        wire.invalid(context, f"one Train call is one step of one job; its messages name {sorted(steps)[:4]}")
    found = [item for part in parts for item in getattr(part, items)]
    expected = getattr(parts[0], count) or len(getattr(parts[0], items))
    if len(found) != expected:
        wire.invalid(context, f"Train of step {parts[0].step} brought {len(found)} of its {expected} {items}")
    return parts[0], found
