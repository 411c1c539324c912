"""Leader election for the controller, and its fencing token: the leader's epoch.

A controller leads a run while it holds an exclusive lock (flock) on `<run_dir>/controller.lock`: held for its
life and released by the kernel when its process ends, however it ends, so a crash leaves no stale leader and
there is no lease to renew. A contender blocks until the lock is free. Each acquisition takes the next epoch, kept
in `<run_dir>/controller.epoch` (written under the lock, atomically and durably), so every leader's epoch exceeds
those of all leaders before it. The leader sends its epoch on every call (wire.channel) and executors refuse the
state-changing calls of an older epoch than the newest they have seen (wire.Fence): a deposed leader's late calls
cannot act beside its successor's.

Locally the lock cannot be lost while its holder lives; the fence refuses what a dead or released leader still
had on its way. On a cluster (RLFLEET_LEASE set by the operator) the election is a Kubernetes Lease (lease.py),
which can expire while its holder still runs (a paused or partitioned pod): there the fence is what keeps two
leaders from both acting. It implements the same interface: a function that blocks until its caller leads and
returns a `Leadership` whose epoch exceeds every earlier leader's.

The lock belongs to the open file: a child forked (not exec'd) while leading would hold it past its parent's
death; the controller forks none (subprocesses exec, and their descriptors close).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Iterator, Protocol

from rlfleet.workers.wire import store_epoch

log = logging.getLogger(__name__)
LOCK_FILE = "controller.lock"
EPOCH_FILE = "controller.epoch"
# A leader numbers the sync groups it asks replicas to join from its own epoch up (controller/receivers.py), so that
# its groups never meet an earlier leader's in the stores trainer rank 0 hosts, which outlive a controller of its own:
# consecutive epochs are at least this far apart, more than the rejoins of one replica in one leader's term.
EPOCH_STRIDE = 1 << 20
# How often a contender with a timeout tries the lock (one without waits in the kernel).
POLL_SECONDS = 0.2


class Leadership(Protocol):
    """A controller's term as leader, as any election (this lock file, a Kubernetes Lease) hands it over."""

    epoch: int
    """The fencing token: larger than the epoch of every leader before."""

    def release(self) -> None:
        """End the term: a contender may lead next."""


@contextlib.contextmanager
def released_on_sigterm(leader: Leadership) -> Iterator[None]:
    """While leading in the main thread: a SIGTERM (`kubectl delete pod`, a drain, a rolling update) releases the
    leadership before the process's own handler ends it, so a standby leads at once, not once a Lease expires."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def release_then_end(signum: int, _frame: object) -> None:
        leader.release()
        signal.signal(signum, previous)
        os.kill(os.getpid(), signum)  # the handler that was there acts next, as if it had been called

    signal.signal(signal.SIGTERM, release_then_end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class LockFileLeadership:
    """A term held by the flock on the run directory's lock file."""

    def __init__(self, fd: int, epoch: int):
        self._fd = fd
        self.epoch = epoch

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor of the open file drops its lock
            self._fd = -1


class NotLeader(TimeoutError):
    """Another controller still led when the wait for leadership ran out."""


def acquire(run_dir: str | os.PathLike[str], timeout: float | None = None) -> Leadership:
    """Lead the run in `run_dir`: blocks until no other controller does (up to `timeout` seconds, or NotLeader),
    then takes the next epoch. In a pod the operator names a Lease for the job's controllers, which decides instead
    (their run directories are their own)."""
    from rlfleet.workers.controller import lease

    if os.environ.get(lease.LEASE_ENV):
        return lease.acquire(os.environ[lease.LEASE_ENV], timeout)
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if not _try_lock(fd):
            log.info("controller: waiting to lead %s: %s", run_dir, _holder(fd))
            _wait_for_lock(fd, path, timeout)
        epoch = _next_epoch(Path(run_dir) / EPOCH_FILE)
        _name_holder(fd, epoch)
    except BaseException:
        os.close(fd)
        raise
    log.info("controller: leading %s as epoch %d", run_dir, epoch)
    return LockFileLeadership(fd, epoch)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_for_lock(fd: int, path: Path, timeout: float | None) -> None:
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    give_up = time.monotonic() + timeout
    while not _try_lock(fd):
        if time.monotonic() >= give_up:
            raise NotLeader(f"{path} is still held after {timeout:g} s by {_holder(fd)}: another controller leads "
                            f"this run directory; stop it, or give this run a directory of its own")
        time.sleep(POLL_SECONDS)


def _next_epoch(path: Path) -> int:
    """The next epoch after the one stored at `path` (next_epoch), or the wall clock in microseconds if that is larger, stored there
    before it is returned: a crash between the write and the first call fenced with it loses nothing, and no two
    leaders ever share an epoch. The clock is for a run directory that did not survive (a new trainer pod's
    emptyDir): its leader still outranks every earlier one, whose executors live on, unless the nodes' clocks
    disagree by more than the time between the two."""
    text = path.read_text(encoding="utf-8").strip() if path.exists() else "0"
    if not text.isdigit():
        raise ValueError(f"{path} holds {text[:40]!r}, not a leader epoch: restore it, or write the highest epoch any "
                         f"executor of this run has seen (their logs name it, 'fence: controller epoch N leads')")
    epoch = next_epoch(int(text))
    store_epoch(path, epoch)
    return epoch


def next_epoch(stored: int) -> int:
    """The epoch after `stored`: EPOCH_STRIDE more, or the wall clock in microseconds if that is larger
    (_next_epoch: why)."""
    return max(stored + EPOCH_STRIDE, time.time_ns() // 1_000)


def _name_holder(fd: int, epoch: int) -> None:
    """Write who leads into the lock file, for the log lines of those who wait."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, epoch {epoch}\n".encode(), 0)


def _holder(fd: int) -> str:
    return os.pread(fd, 256, 0).decode(errors="replace").strip() or "a controller starting"
