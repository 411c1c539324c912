"""One call to some healthy replica of an executor, with a deadline, retried elsewhere while replicas are away.

Every caller's calls are safe to repeat (read-only, or idempotent by their request), so a call that failed, even
one whose answer was lost after its deadline, is sent again. A replica that is restarting or stopped
(wire.TRANSIENT) gets a grace period, counted from the first failure; any other code fails at once, and a call
refused for its credentials or its method (wire.MISCONFIGURED), or by the fence of a newer controller (wire.Fenced),
stops the run as Misconfigured.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

import grpc

from rlfleet.workers import wire

log = logging.getLogger(__name__)


def call_replica(stubs: list[Any], method: Callable[[Any], Callable[..., Any]], request: Any, *, what: str,
                 deadline: float, grace: float, start: int = 0, up: Callable[[], list[int]] | None = None,
                 failed: Callable[[int, str], None] | None = None) -> Any:
    """`method(stub)(request, timeout=deadline)` on replica `start` of those `up` (all by default), then on the next
    while they fail with a TRANSIENT code, for `grace` seconds. A streamed request (a list of messages) is iterated
    anew by every attempt. `failed(replica, reason)` hears of each replica that failed (to mark it down)."""
    give_up, last = None, None
    for attempt in itertools.count():
        replicas = up() if up else list(range(len(stubs)))
        if replicas:
            replica = replicas[(start + attempt) % len(replicas)]
            try:
                sent = iter(request) if isinstance(request, list) else request
                return method(stubs[replica])(sent, timeout=deadline)
            except grpc.RpcError as error:
                wire.raise_if_misconfigured(error, f"{what} on replica {replica}")
                if error.code() not in wire.TRANSIENT:
                    raise
                log.warning("%s on replica %d failed (%s): trying another", what, replica, error.code().name)
                if failed:
                    failed(replica, f"{what} failed: {error.code().name}")
                last = error
        give_up = give_up or time.monotonic() + grace
        if time.monotonic() > give_up:
            raise last or RuntimeError(f"no replica was up to answer {what} within {grace:.0f} s")
        time.sleep(min(1.0, 0.1 * (attempt + 1)))
