"""Controllers in separate processes contend for one run directory: one leads; the next leads only once the
leader's process is killed (SIGKILL: no chance to release anything), and with a larger epoch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
CONTENDER = """
import logging, sys, time
from rlfleet.workers.controller.leadership import acquire
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
print(acquire(sys.argv[1]).epoch, flush=True)
time.sleep(600)
"""


class Contender:
    """A process that waits to lead `run_dir`, then prints its epoch and holds on until killed."""

    def __init__(self, run_dir: Path, name: str):
        self.out, self.err = run_dir.parent / f"{name}.out", run_dir.parent / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen([sys.executable, "-c", CONTENDER, str(run_dir)], stdout=out, stderr=err)

    def wait_for(self, what: str, seconds: float = 60.0) -> str:
        """The file's text ("out" or "err") once it is not empty."""
        path = self.out if what == "out" else self.err
        deadline = time.monotonic() + seconds
        while not path.read_text():
            assert self.process.poll() is None, f"contender exited {self.process.returncode}: {self.err.read_text()}"
            assert time.monotonic() < deadline, f"nothing on {what} after {seconds} s: {self.err.read_text()}"
            time.sleep(0.05)
        return path.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


def test_the_next_controller_leads_only_after_the_leader_dies_and_with_a_larger_epoch(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    contenders: list[Contender] = []
    try:
        leader = Contender(run_dir, "first")
        contenders.append(leader)
        epoch = int(leader.wait_for("out"))
        for name in ("second", "third"):
            contender = Contender(run_dir, name)
            contenders.append(contender)
            waiting = contender.wait_for("err")  # it found the lock held, by the leader
            assert f"waiting to lead {run_dir}: pid {leader.process.pid} on " in waiting, waiting
            assert f"epoch {epoch}" in waiting, waiting
            assert contender.out.read_text() == "", "two controllers lead at once"
            leader.kill()
            following = int(contender.wait_for("out"))
            assert following > epoch
            leader, epoch = contender, following
    finally:
        for contender in contenders:
            contender.kill()
