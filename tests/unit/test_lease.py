"""The controller's election by a Kubernetes Lease, against an API server on loopback that checks resourceVersions
as the real one does (tests/lease_server.py): one leader at a time, takeover on release and on expiry, epochs that
only grow, and a leader that cannot renew stops before a standby takes over."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Callable

import pytest

from lease_server import LeaseServer
from short_reply import short_reply_server
from rlfleet.workers.controller import lease, leadership
from rlfleet.workers.controller.lease import EPOCH_ANNOTATION, Conflict, LeaseApi, LeaseTimes, acquire
from rlfleet.workers.controller.leadership import EPOCH_STRIDE, NotLeader

# Short terms: a loaded CI machine still renews well within 0.8 s.
TIMES = LeaseTimes(duration=1.0, renew=0.2, retry=0.05)
NAME = "job-controller"


@pytest.fixture
def server():
    served = LeaseServer()
    served.create(NAME)
    yield served
    served.stop()


def api_of(server: LeaseServer) -> LeaseApi:
    return LeaseApi(server.url, "default")


def write(server: LeaseServer, change: Callable[[dict], None], tries: int = 20) -> None:
    """Another writer's read, change and update of the Lease, read again on a Conflict: the leader renews it
    meanwhile (in CI it renewed between a read and its update)."""
    for _ in range(tries):
        lease = server.lease(NAME)
        change(lease)
        try:
            api_of(server).update(lease)
            return
        except Conflict:
            continue
    raise AssertionError(f"the Lease changed under each of {tries} updates")


class CutApi(LeaseApi):
    """A leader's link to the API server, which the test can cut (a partitioned or paused pod)."""

    cut = False

    def _call(self, *args, **kwargs):
        if self.cut:
            raise ConnectionRefusedError("cut by the test")
        return super()._call(*args, **kwargs)


class Losses:
    """on_lost for tests: records why, and when, instead of ending the process."""

    def __init__(self):
        self.why: list[tuple[float, str]] = []

    def __call__(self, why: str) -> None:
        self.why.append((time.monotonic(), why))


def lead(server: LeaseServer, holder: str, timeout: float | None = None, api: LeaseApi | None = None,
         on_lost: Losses | None = None):
    return acquire(NAME, timeout, api=api or api_of(server), holder=holder, times=TIMES, on_lost=on_lost or Losses())


def test_a_contender_leads_only_once_the_leader_releases_and_then_at_once(server):
    first = lead(server, "pod-0")
    assert server.lease(NAME)["spec"]["holderIdentity"] == "pod-0"
    with pytest.raises(NotLeader, match="Lease job-controller is still held after 1.5 s by pod-0"):
        lead(server, "pod-1", timeout=1.5)  # longer than the Lease's duration: the leader renews it
    waited = {}

    def contend():
        started = time.monotonic()
        waited["leader"] = lead(server, "pod-1", timeout=10)
        waited["seconds"] = time.monotonic() - started

    standby = threading.Thread(target=contend)
    standby.start()
    time.sleep(0.3)
    first.release()
    first.release()  # a second release is harmless
    standby.join()
    second = waited["leader"]
    assert waited["seconds"] < 0.3 + TIMES.duration / 2, "a released Lease is taken without waiting for its expiry"
    assert second.epoch > first.epoch
    stored = server.lease(NAME)
    assert stored["spec"]["holderIdentity"] == "pod-1" and stored["metadata"]["annotations"][EPOCH_ANNOTATION] == \
        str(second.epoch)
    second.release()
    assert "holderIdentity" not in server.lease(NAME)["spec"]


class RacingApi(LeaseApi):
    """Every contender reads the free Lease before any of them writes: their updates race."""

    def __init__(self, url: str, barrier: threading.Barrier):
        super().__init__(url, "default")
        self.barrier, self.raced = barrier, False

    def update(self, lease, timeout=5.0):
        if not self.raced:  # the contender's first taking only, not its renewals
            self.raced = True
            self.barrier.wait(timeout=10)
        return super().update(lease, timeout)


def test_of_contenders_racing_for_a_free_lease_exactly_one_leads(server):
    lead(server, "pod-9").release()  # a free Lease, as a released leader leaves it
    contenders = 4
    barrier = threading.Barrier(contenders)
    leaders, refused = [], []

    def contend(rank):
        try:
            leaders.append(lead(server, f"pod-{rank}", timeout=0.5, api=RacingApi(server.url, barrier)))
        except NotLeader:
            refused.append(rank)

    threads = [threading.Thread(target=contend, args=(rank,)) for rank in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(leaders) == 1 and len(refused) == contenders - 1
    (winner,) = set(range(contenders)) - set(refused)
    assert server.lease(NAME)["spec"]["holderIdentity"] == f"pod-{winner}"
    leaders[0].release()


def test_a_controller_waits_for_the_lease_the_operator_creates_and_never_creates_one(server):
    with pytest.raises(NotLeader, match="Lease other does not exist after 0.3 s: the operator creates it with the job"):
        acquire("other", 0.3, api=api_of(server), holder="pod-0", times=TIMES, on_lost=Losses())
    assert server.lease("other") is None
    threading.Timer(0.3, server.create, args=("other",)).start()
    leader = acquire("other", 10, api=api_of(server), holder="pod-0", times=TIMES, on_lost=Losses())
    assert server.lease("other")["spec"]["holderIdentity"] == "pod-0"
    leader.release()


def test_a_leader_that_cannot_renew_stops_before_a_standby_takes_over(server):
    cut_api, losses = CutApi(server.url, "default"), Losses()
    first = lead(server, "pod-0", api=cut_api, on_lost=losses)
    time.sleep(2 * TIMES.duration)
    assert losses.why == [], "a leader that renews keeps its Lease"
    cut_api.cut = True
    cut_at = time.monotonic()
    second = lead(server, "pod-1", timeout=10)
    taken_at = time.monotonic()
    assert taken_at - cut_at >= TIMES.duration - TIMES.renew, "the standby waits for the Lease to expire"
    assert second.epoch > first.epoch
    assert len(losses.why) == 1, "the old leader has stopped by the time the new one leads"
    ((lost_at, why),) = losses.why
    assert lost_at < taken_at
    assert why == f"Lease {NAME} lost as epoch {first.epoch}: not renewed for 0.8 s"
    first.release()  # unreachable: nothing happens, and nothing is raised
    time.sleep(2 * TIMES.duration)
    assert server.lease(NAME)["spec"]["holderIdentity"] == "pod-1", "the new leader renews its Lease"
    second.release()


def test_a_leader_whose_lease_another_took_stops_but_not_for_another_writer(server):
    losses = Losses()
    first = lead(server, "pod-0", on_lost=losses)
    write(server, lambda lease: lease["metadata"].update(labels={"team": "a"}))  # its resourceVersion moves on
    time.sleep(3 * TIMES.renew)
    assert losses.why == [] and server.lease(NAME)["metadata"]["labels"] == {"team": "a"}
    write(server, lambda lease: lease["spec"].update(holderIdentity="intruder"))
    time.sleep(3 * TIMES.renew)
    assert [why for _, why in losses.why] == [f"Lease {NAME} lost as epoch {first.epoch}: taken by intruder "
                                              f"(epoch {first.epoch})"]
    assert server.lease(NAME)["spec"]["holderIdentity"] == "intruder", "a lost leader writes nothing more"


def test_the_epoch_counts_on_from_the_lease_even_ahead_of_the_clock(server):
    ahead = time.time_ns() // 1_000 + 3_600_000_000
    created = server.lease(NAME)
    created["metadata"]["annotations"] = {EPOCH_ANNOTATION: str(ahead)}
    api_of(server).update(created)
    first = lead(server, "pod-0")
    assert first.epoch == ahead + EPOCH_STRIDE
    first.release()
    second = lead(server, "pod-1")
    assert second.epoch == ahead + 2 * EPOCH_STRIDE
    second.release()


# A leader in a worker's process: the worker's SIGTERM handler, a Lease that cannot expire within the test.
LEADER = """
import signal, sys, time
from rlfleet.workers import cli
from rlfleet.workers.controller import leadership
from rlfleet.workers.controller.lease import LeaseApi, LeaseTimes, acquire
signal.signal(signal.SIGTERM, cli._exit_at_once)
leader = acquire(sys.argv[2], None, api=LeaseApi(sys.argv[1], "default"), holder="pod-0",
                 times=LeaseTimes(duration=600, renew=0.2, retry=0.05))
with leadership.released_on_sigterm(leader):
    print("leading", flush=True)
    time.sleep(600)
"""


def test_a_leader_ended_by_sigterm_releases_its_lease_first(server):
    """`kubectl delete pod` of the leader: the standby leads at once, not once the Lease expires."""
    process = subprocess.Popen([sys.executable, "-c", LEADER, server.url, NAME], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "leading\n"
        assert server.lease(NAME)["spec"]["holderIdentity"] == "pod-0"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM, "the worker's own handler ends it"
    finally:
        process.kill()
        process.wait()
    assert not server.lease(NAME)["spec"].get("holderIdentity"), "the Lease is still held by the ended leader"
    lead(server, "pod-1", timeout=1).release()


def test_leadership_leads_by_the_lease_the_operator_names(server, tmp_path, monkeypatch):
    monkeypatch.setenv(lease.LEASE_ENV, NAME)
    monkeypatch.setenv("POD_NAME", "job-control-1")
    monkeypatch.setattr(LeaseApi, "in_cluster", classmethod(lambda cls: api_of(server)))
    leader = leadership.acquire(tmp_path)
    assert server.lease(NAME)["spec"]["holderIdentity"] == "job-control-1"
    assert not (tmp_path / leadership.LOCK_FILE).exists(), "the run directory's lock file plays no part"
    leader.release()


def test_a_reply_cut_short_reads_as_an_unreachable_api_server_which_is_waited_out():
    """IncompleteRead is no OSError: it ended a standby's wait for the Lease, and a leader's release."""
    with short_reply_server() as url, pytest.raises(ConnectionError, match="cut short"):
        LeaseApi(url, "default").get(NAME)


def test_in_a_pod_the_client_calls_its_namespaces_api_with_the_current_token(tmp_path, monkeypatch):
    import certifi

    (tmp_path / "namespace").write_text("team-a\n")
    (tmp_path / "token").write_text("first\n")
    (tmp_path / "ca.crt").write_bytes(open(certifi.where(), "rb").read())
    monkeypatch.setattr(lease, "SERVICE_ACCOUNT_DIR", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    api = LeaseApi.in_cluster()
    assert api.collection == "https://[fd00::1]:443/apis/coordination.k8s.io/v1/namespaces/team-a/leases"
    assert api.token() == "first"
    (tmp_path / "token").write_text("rotated\n")  # the kubelet rotates projected tokens
    assert api.token() == "rotated"
