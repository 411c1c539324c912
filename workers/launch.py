"""A pod of several ranks (one per GPU; a trainer or a critic pod): its process starts the ranks, as torchrun does,
and lives as long as they all do. A rank that fails ends the others and the pod with its exit code, so the ranks
restart together (the operator's and `rlfleet run`'s failure handling see one failed worker)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Mapping

from rlfleet.workers.logs import setup_logging
from rlfleet.workers.plan import METRICS_PORT, METRICS_PORTS_ENV, POD_ENV

log = logging.getLogger(__name__)
# How long ranks get to stop after a peer failed or the pod was told to stop, before SIGKILL.
STOP_GRACE_SECONDS = 30
POLL_SECONDS = 0.5


def pod_index(environ: Mapping[str, str]) -> int:
    """Set by `rlfleet run`; in a StatefulSet, the pod's ordinal (name-trainer-N)."""
    return int(environ[POD_ENV]) if POD_ENV in environ else int(environ["HOSTNAME"].rsplit("-", 1)[1])


def rank_env(environ: Mapping[str, str], per_pod: int, local: int) -> dict[str, str]:
    """The environment of local rank `local`: its global rank, its GPU (LOCAL_RANK) and its metrics port."""
    pod = pod_index(environ)
    metrics = environ[METRICS_PORTS_ENV].split(",") if METRICS_PORTS_ENV in environ else \
        [str(METRICS_PORT + index) for index in range(per_pod)]
    return dict(environ) | {"RLFLEET_RANK": str(pod * per_pod + local), "LOCAL_RANK": str(local),
                            "LOCAL_WORLD_SIZE": str(per_pod), "RLFLEET_METRICS_PORT": metrics[local]}


def run_pod(role: str, per_pod: int) -> int:
    """Start the pod's ranks of `role` and wait for them; the exit code of the first that failed, else 0."""
    setup_logging(f"{role}-pod", pod_index(os.environ))
    ranks = [subprocess.Popen([sys.executable, "-m", "rlfleet.workers.cli", "worker", role],
                              env=rank_env(os.environ, per_pod, local)) for local in range(per_pod)]
    log.info("%s pod started ranks %s", role, ", ".join(str(p.pid) for p in ranks))
    signal.signal(signal.SIGTERM, lambda *_: _stop(ranks, signal.SIGTERM))
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None:
            log.error("a %s rank exited %s: stopping the pod's other ranks", role, failed)
            _stop(ranks, signal.SIGTERM)
            return failed if failed > 0 else 128 - failed  # killed by a signal: as a shell reports it
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_SECONDS)


def _stop(ranks: list[subprocess.Popen], signum: int) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signum)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for rank in ranks:
        try:
            rank.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()
