"""A peer that stops answering keeps its TCP connection open: only the channels' keepalive pings notice it,
long before a generous call deadline (wire.KEEPALIVE_SECONDS)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import grpc
import pytest

from rlfleet.v1 import scorer_pb2, scorer_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.local import stop

from conftest import make_job
from support import run_token, start_workers

pytestmark = pytest.mark.integration
DEADLINE = 600.0


def _score(stub) -> scorer_pb2.ScoreResponse:
    return stub.Score(scorer_pb2.ScoreRequest(job_id="t", items=[
        scorer_pb2.ScoreItem(sample_id="a", prompt="1+1=", completion="2", answer="2")]), timeout=DEADLINE)


def test_a_call_to_a_stopped_process_fails_by_keepalive_not_its_deadline(tmp_path):
    children, endpoints, _ = start_workers(make_job(), tmp_path, {"scorer"})
    process = children[0].process
    try:
        stub = scorer_pb2_grpc.ScorerStub(wire.channel(endpoints.of("scorer")[0], run_token(tmp_path)))
        assert _score(stub).scores[0].reward == 1.0  # the connection is up and used
        os.killpg(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            _score(stub)
        waited = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM until continued
        stop(children)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    limit = wire.KEEPALIVE_SECONDS + wire.KEEPALIVE_TIMEOUT_SECONDS
    assert waited < limit + 10, f"the call waited {waited:.0f} s; keepalive should end it in about {limit} s"
