"""Leader election by a Kubernetes Lease (coordination.k8s.io/v1): leadership.acquire's choice for a controller in a
pod, where the operator names the Lease in RLFLEET_LEASE.

The operator creates the Lease, without a holder, with the job's other objects (owned by the RLJob, so it goes with
the job); a controller only reads and updates it, and its Role grants nothing more.

The leader is the Lease's holderIdentity (its pod's name). It renews the Lease every `renew` seconds from a daemon
thread. A contender takes the Lease when it is free (no holder: the leader released it) or expired: unchanged, by
its resourceVersion, for a whole `duration` of the contender's own watching. Watching, not the Lease's renewTime,
so that nodes whose clocks disagree cannot take a Lease early. Every write is an update that names the
resourceVersion it read: of two contenders only the first update succeeds, the other gets 409 Conflict.

Each taking writes the next epoch (leadership.next_epoch of the one the Lease keeps in its annotation) in the same
update, so every leader's epoch exceeds all earlier ones'. A leader that has not renewed for `duration - renew`
seconds (from the start of its last successful renewal, before any contender's watching can end) or finds the Lease
taken by another has lost it: `on_lost` runs, by default ending the process (os._exit(1)), and meanwhile the
executors' fence refuses its late calls, which carry the older epoch.

A small client of the API server over urllib with the pod's service-account token and CA: workers carry no
Kubernetes client library.
"""

from __future__ import annotations

import datetime
import http.client
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlfleet.workers.controller.leadership import NotLeader, next_epoch

log = logging.getLogger(__name__)
LEASE_ENV = "RLFLEET_LEASE"
"""Names the Lease to lead by (set by the operator on the controller pods); unset, the lock file decides."""
EPOCH_ANNOTATION = "rlfleet.io/epoch"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# An API server answers in milliseconds; a call that hangs must not outlast a renewal deadline.
REQUEST_SECONDS = 5.0


@dataclass(frozen=True)
class LeaseTimes:
    duration: float = 15.0
    """Seconds a Lease unchanged stands for a lost leader: how long a standby waits at most to take over. client-go's
    default: with 10, one renewal that timed out on a busy API server (seen on the project's one-node cluster) left
    too little time for the next, and the leader stopped."""
    renew: float = 2.0
    """Seconds between the leader's renewals; also the margin by which a leader that cannot renew stops first."""
    retry: float = 1.0
    """Seconds between a contender's looks at the Lease."""


class Conflict(Exception):
    """409: the Lease changed since it was read, or was created meanwhile."""


class LeaseApi:
    """get and update one namespace's Leases."""

    def __init__(self, server: str, namespace: str, token: Callable[[], str] | None = None,
                 context: ssl.SSLContext | None = None):
        self.collection = f"{server.rstrip('/')}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.token = token
        self.context = context

    @classmethod
    def in_cluster(cls) -> LeaseApi:
        """The pod's own namespace, as its service account; the token is read at each call (the kubelet rotates it)."""
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        host = f"[{host}]" if ":" in host else host
        namespace = (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
        return cls(f"https://{host}:{port}", namespace, lambda: (SERVICE_ACCOUNT_DIR / "token").read_text().strip(),
                   context)

    def get(self, name: str) -> dict[str, Any] | None:
        return self._call("GET", f"{self.collection}/{name}")

    def update(self, lease: dict[str, Any], timeout: float = REQUEST_SECONDS) -> dict[str, Any]:
        """Replace the Lease if it still has the resourceVersion `lease` names, else Conflict."""
        return self._call("PUT", f"{self.collection}/{lease['metadata']['name']}", lease, timeout)

    def _call(self, method: str, url: str, body: Any = None, timeout: float = REQUEST_SECONDS) -> Any:
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token()}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self.context) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            if error.code == 404 and method == "GET":
                return None
            if error.code == 409:
                raise Conflict(f"{method} {url}") from error
            raise
        except http.client.HTTPException as error:  # a reply cut short (IncompleteRead): waited out as unreachable
            raise ConnectionError(f"{method} {url}: the reply was cut short ({error!r})") from error


def acquire(name: str, timeout: float | None = None, *, api: LeaseApi | None = None, holder: str | None = None,
            times: LeaseTimes = LeaseTimes(), on_lost: Callable[[str], None] | None = None) -> LeaseLeadership:
    """Lead by the Lease `name`: blocks until this holder (default: the pod's name) takes it (up to `timeout`
    seconds, or NotLeader), then renews it until release() or until it is lost (`on_lost(why)`, default: end the
    process)."""
    api = api or LeaseApi.in_cluster()
    holder = holder or os.environ.get("POD_NAME") or socket.gethostname()
    give_up = None if timeout is None else time.monotonic() + timeout
    watched: tuple[str, float] | None = None  # (resourceVersion, when first seen)
    absent = False
    while True:
        lease, taken = _look(api, name), None
        sent = time.monotonic()
        if lease is None and not absent:
            log.info("controller: Lease %s does not exist yet; the operator creates it with the job", name)
        absent = lease is None
        if lease is not None:
            version = lease["metadata"].get("resourceVersion", "")
            if watched is None or watched[0] != version:
                watched = (version, sent)
            if not _holder(lease) or sent - watched[1] >= times.duration:
                taken = _try(lambda: api.update(_taken(lease, holder, times)))
        if taken is not None:
            leader = LeaseLeadership(api, taken, times, on_lost or _end_process, sent)
            log.info("controller: leading by Lease %s as %s, epoch %d", name, holder, leader.epoch)
            return leader
        if give_up is not None and time.monotonic() >= give_up:
            raise NotLeader(_not_taken(name, timeout, lease))
        time.sleep(times.retry)


class LeaseLeadership:
    """A term held by the Lease, renewed by a daemon thread until release() or its loss."""

    def __init__(self, api: LeaseApi, lease: dict[str, Any], times: LeaseTimes, on_lost: Callable[[str], None],
                 taken_at: float):
        self.epoch = _epoch(lease)
        self._api, self._lease, self._times, self._on_lost = api, lease, times, on_lost
        self._holder = _holder(lease)
        # Deadlines count from before each write was sent: no contender's watching of it can have begun earlier.
        self._renewed = taken_at
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="lease-renewal", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and clear the holder, so a standby takes over at once rather than after `duration`."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        lease = _copy(self._lease)
        lease["spec"].pop("holderIdentity", None)
        try:
            self._api.update(lease)
        except (Conflict, OSError) as error:  # taken already, or unreachable: it expires by itself
            log.warning("controller: Lease %s not released (%s): a standby takes it once it expires",
                        lease["metadata"]["name"], error)

    def _keep(self) -> None:
        deadline = self._times.duration - self._times.renew
        while True:
            left = self._renewed + deadline - time.monotonic()
            if self._stop.wait(max(0.0, min(self._times.renew, left))):
                return
            left = self._renewed + deadline - time.monotonic()
            if left <= 0:
                return self._lose(f"not renewed for {deadline:g} s")
            sent = time.monotonic()
            try:
                self._lease = self._renew(left)
                self._renewed = sent
            except _Lost as lost:
                return self._lose(str(lost))
            except Exception as error:  # unreachable, refused, garbled, written meanwhile: again until the deadline
                log.warning("controller: Lease %s not renewed, %.1f s left: %s", self._lease["metadata"]["name"],
                            left, error)

    def _renew(self, timeout: float) -> dict[str, Any]:
        """The Lease renewed. A conflict is looked into: a new holder is a loss; another writer (a label, say) is
        not, and the next renewal starts from what it wrote."""
        renewed = _copy(self._lease)
        renewed["spec"]["renewTime"] = _now()
        try:
            return self._api.update(renewed, timeout)
        except Conflict:
            found = self._api.get(renewed["metadata"]["name"]) or {"metadata": {}, "spec": {}}
            if _holder(found) != self._holder or _epoch(found) != self.epoch:
                raise _Lost(f"taken by {_holder(found) or 'nobody'} (epoch {_epoch(found)})") from None
            self._lease = found
            raise

    def _lose(self, why: str) -> None:
        self._stop.set()
        self._on_lost(f"Lease {self._lease['metadata']['name']} lost as epoch {self.epoch}: {why}")


class _Lost(Exception):
    pass


def _end_process(why: str) -> None:
    """A leader that lost its Lease must stop acting at once: a standby leads, or is about to."""
    log.critical("controller: %s; ending this process so the new leader alone acts", why)
    logging.shutdown()
    os._exit(1)


def _look(api: LeaseApi, name: str) -> dict[str, Any] | None:
    """The Lease (None: none yet); an unreachable API server is waited out, a refusal (403: no RBAC) is raised."""
    while True:
        try:
            return api.get(name)
        except OSError as error:
            _unless_transient(error, f"Lease {name} unreadable")
        time.sleep(1.0)


def _try(write: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """The written Lease, or None when another contender wrote first or the API server did not answer."""
    try:
        return write()
    except Conflict:
        return None
    except OSError as error:
        _unless_transient(error, "Lease not written")
        return None


def _unless_transient(error: OSError, what: str) -> None:
    """Raises `error` unless it may pass (unreachable, overloaded): a refusal says what to fix."""
    if isinstance(error, urllib.error.HTTPError) and error.code < 500 and error.code != 429:
        raise error
    log.warning("controller: %s: %s", what, error)


def _not_taken(name: str, timeout: float, lease: dict[str, Any] | None) -> str:
    if lease is None:
        return f"Lease {name} does not exist after {timeout:g} s: the operator creates it with the job"
    return (f"Lease {name} is still held after {timeout:g} s by {_holder(lease) or 'a controller starting'}: "
            "another controller leads this job")


def _taken(lease: dict[str, Any], holder: str, times: LeaseTimes) -> dict[str, Any]:
    """`lease` as `holder` takes it: the next epoch and a new term, in one write that names the version read."""
    taken = _copy(lease)
    now = _now()
    taken["metadata"].setdefault("annotations", {})[EPOCH_ANNOTATION] = str(next_epoch(_epoch(lease)))
    taken["spec"] |= {"holderIdentity": holder, "leaseDurationSeconds": max(1, round(times.duration)),
                      "acquireTime": now, "renewTime": now,
                      "leaseTransitions": lease["spec"].get("leaseTransitions", -1) + 1}
    return taken


def _holder(lease: dict[str, Any]) -> str:
    return (lease.get("spec") or {}).get("holderIdentity") or ""


def _epoch(lease: dict[str, Any]) -> int:
    text = ((lease.get("metadata") or {}).get("annotations") or {}).get(EPOCH_ANNOTATION, "0")
    if not text.isdigit():
        raise ValueError(f"Lease {lease['metadata'].get('name')} annotation {EPOCH_ANNOTATION} holds {text[:40]!r}, "
                         f"not a leader epoch: set it to the highest epoch any executor of this job has seen")
    return int(text)


def _copy(lease: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(lease))


def _now() -> str:
    """A MicroTime, as Lease fields hold it."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
