"""The operator reads progress from a real Controller gRPC server, and shrugs when there is none."""

from __future__ import annotations

import time

import pytest

from rlfleet.operator.progress import read_progress
from rlfleet.workers.controller.status import Progress, serve_controller
from rlfleet.workers.auth import new_token
from rlfleet.workers.plan import free_port

pytestmark = pytest.mark.integration


async def test_progress_from_the_controllers_status_call():
    port = free_port()
    progress_of_job = Progress(step=3, total_steps=10, policy_version=3, reward_mean=0.5)
    token = new_token()
    server, _ = serve_controller("job-a", progress_of_job, port, token=token)
    try:
        progress = await read_progress(f"127.0.0.1:{port}", "job-a", token)
        assert (progress.phase, progress.step, progress.total_steps) == ("Running", 3, 10)
        assert (progress.policy_version, progress.reward_mean) == (3, 0.5)
        progress_of_job.phase = "Succeeded"  # what the controller's loop sets when the last step is done
        assert (await read_progress(f"127.0.0.1:{port}", "job-a", token)).phase == "Succeeded"
        # Another job's name is refused by the controller: no progress rather than someone else's.
        assert await read_progress(f"127.0.0.1:{port}", "job-b", token) is None
        # Another job's token (or a stale one) is refused too.
        assert await read_progress(f"127.0.0.1:{port}", "job-a", new_token()) is None
    finally:
        server.stop(grace=None)


async def test_no_controller_is_no_progress_quickly():
    started = time.monotonic()
    assert await read_progress(f"127.0.0.1:{free_port()}", "job-a", new_token(), timeout=1.0) is None
    assert await read_progress("nowhere-trainer-0.nowhere-trainer.default.svc:50051", "job-a", new_token(),
                               timeout=1.0) is None
    assert time.monotonic() - started < 5
