"""A worker as a pod runs it: its container's PID 1, which the kernel shields from signals it has no handler for.

The real cluster showed every deleted or suspended worker pod waiting out its 60 s grace period for a SIGKILL,
the trainer training on meanwhile. A PID namespace of its own reproduces that here without a cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from runs import children_of

from rlfleet.workers import wire

from conftest import make_job
from support import READY_SECONDS, plan_local

pytestmark = pytest.mark.integration
# Far under the grace period a pod gets; a worker that ignores SIGTERM never exits at all.
STOP_SECONDS = 20


@pytest.mark.parametrize("role", ["scorer", "generator"])
def test_a_worker_that_is_pid_1_of_its_namespace_stops_on_sigterm(role, tmp_path, model_cache):
    job = make_job(roles={"generator": {"engine": "torch"}})
    workers, _, _ = plan_local(job, tmp_path)
    worker = next(w for w in workers if w.role == role)
    log_path = tmp_path / "logs" / f"{worker.name}.log"
    with log_path.open("wb") as log:
        # --kill-child: if the test fails, the worker goes with unshare.
        outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m",
                                  "rlfleet.workers.cli", *worker.command[1:]],
                                 env=os.environ | worker.env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wire.wait_ready(f"127.0.0.1:{worker.ports['grpc']}", READY_SECONDS)
        (pid_1,) = children_of(outer.pid, count=1)
        # From outside its namespace, as the container runtime sends it.
        os.kill(pid_1, signal.SIGTERM)
        try:
            outer.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the {role} ignored SIGTERM as PID 1") from None
    finally:
        outer.kill()
        outer.wait()
    assert outer.returncode == 128 + signal.SIGTERM
    assert "stopping on SIGTERM" in log_path.read_text()
