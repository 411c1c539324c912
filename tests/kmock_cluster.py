"""A Kubernetes API emulator (KMock) prepared for the operator: resources declared, the CRD installed,
a kubeconfig pointing at it, and helpers to act on it over HTTP like kubectl would."""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import aiohttp
import jsonpatch
import kmock as km
import yaml

from rlfleet.operator.crd import build_crd
from rlfleet.workers.plan import free_port

# Read by the operator's handlers at import (the kopf timer's interval is fixed then); every operator started here
# inherits it. Short, so status moves show within a second.
os.environ.setdefault("RLFLEET_STATUS_INTERVAL_SECONDS", "1")
NAMESPACE = "default"
JOBS = "/apis/rlfleet.io/v1alpha1/namespaces/default/rljobs"
NAMESPACED = {
    "v1/configmaps": "ConfigMap",
    "v1/secrets": "Secret",
    "v1/services": "Service",
    "v1/pods": "Pod",
    "v1/events": "Event",
    "apps/v1/statefulsets": "StatefulSet",
    "networking.k8s.io/v1/networkpolicies": "NetworkPolicy",
    "v1/serviceaccounts": "ServiceAccount",
    "rbac.authorization.k8s.io/v1/roles": "Role",
    "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
    "coordination.k8s.io/v1/leases": "Lease",
}
VERBS = {"get", "list", "watch", "create", "patch", "delete"}
# Kubernetes' default grace period: a pod's operator has this long after SIGTERM before it is killed.
STOP_SECONDS = 30


_VERSIONS = itertools.count(2)


class VersionedEmulator(km.KubernetesEmulator):
    """KMock whose resourceVersion moves on every write, as a real API server's does (pyproject.toml's kmock_cls).

    KMock's own keeps it fixed: kopf then cannot tell the echoes of its own patches from newer states and handles
    each again, writing again. Under load the operator fell more than 30 s behind the emulator's state (seen in CI:
    the swapped pools' refusal never came within the test's wait)."""

    async def _handle(self, request: Any) -> Any:
        if request.action in (km.action.CREATE, km.action.UPDATE) and isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = str(next(_VERSIONS))
        return await super()._handle(request)

    async def _render_error(self, error: Exception) -> Any:
        # A JSON patch's failed test (kopf's, of the resourceVersion) is the real server's 422: kopf then patches
        # again on its next cycle; as KMock's 500 it retried the same stale test until it gave up.
        if isinstance(error, jsonpatch.JsonPatchTestFailed):
            error = km.KubernetesError(status=422, reason="Invalid", message=str(error))
        return await super()._render_error(error)


def prepare(kmock: km.KubernetesEmulator, tmp_path: Path, minor: int = 35) -> Path:
    """Declare what kopf discovers and watches (it starts no watcher without namespaces and CRDs), and the
    server version 1.<minor> the operator builds for (KMock's own default is 1.26); returns a kubeconfig
    for the emulator."""
    kmock["get /version"] << {"major": "1", "minor": str(minor), "gitVersion": f"v1.{minor}.0"}
    kmock.resources["v1/namespaces"] = km.ResourceInfo(kind="Namespace", namespaced=False, verbs=VERBS)
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = km.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=VERBS)
    kmock.resources["rlfleet.io/v1alpha1/rljobs"] = km.ResourceInfo(
        kind="RLJob", namespaced=True, verbs=VERBS, subresources={"status"}, shortnames={"rlj"})
    for resource, kind in NAMESPACED.items():
        kmock.resources[resource] = km.ResourceInfo(kind=kind, namespaced=True, verbs=VERBS)
    # Kueue's Workload (Kueue itself does not run: tests admit and evict as it would).
    kmock.resources["kueue.x-k8s.io/v1beta1/workloads"] = km.ResourceInfo(
        kind="Workload", namespaced=True, verbs=VERBS, subresources={"status"})
    crd = build_crd()
    crd["metadata"]["resourceVersion"] = "1"
    kmock.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]] = crd
    kmock.objects["v1/namespaces", None, NAMESPACE] = {"metadata": {"name": NAMESPACE, "resourceVersion": "1"}}
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url)}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
    }))
    return config


def rljob(name: str, spec: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
    return {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid or f"uid-{name}", "resourceVersion": "1"},
            "spec": spec}


class Api:
    """kubectl-like calls against the emulator, from the test's own event loop."""

    def __init__(self, kmock: km.KubernetesEmulator):
        self.kmock = kmock

    async def call(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> Any:
        headers = {"Content-Type": content_type} if content_type else {}
        async with aiohttp.ClientSession(base_url=str(self.kmock.url)) as session:
            async with session.request(method, path, json=body, headers=headers) as reply:
                assert reply.status < 400, f"{method} {path}: {reply.status} {await reply.text()}"
                return await reply.json(content_type=None)

    async def create(self, collection: str, obj: dict[str, Any]) -> None:
        await self.call("POST", collection, obj)

    async def merge(self, path: str, patch: dict[str, Any]) -> None:
        await self.call("PATCH", path, patch, "application/merge-patch+json")

    def get(self, resource: str, name: str) -> dict[str, Any] | None:
        key = (km.resource(resource), NAMESPACE, name)
        if key not in self.kmock.objects or self.kmock.objects[key].deleted:
            return None
        return copy.deepcopy(self.kmock.objects[key].raw)

    def versions(self, resource: str, name: str) -> int:
        """How many times the object was written (created counts as one)."""
        return len([v for v in self.kmock.objects[km.resource(resource), NAMESPACE, name].history if v is not None])


async def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll check() until it returns something truthy; asyncio.sleep keeps the emulator serving."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


class Operator:
    """The operator as its pod runs it (`python -m rlfleet.operator`), in its own process against the emulator, and
    stopped as Kubernetes stops the pod: SIGTERM, then STOP_SECONDS to exit cleanly.

    Not kopf's KopfRunner: that runs kopf in a thread of this process, and its exit joins the thread from the test's
    event loop, which is the emulator's too; in full suites kopf then at times never stopped (seen twice, once with
    120 s given)."""

    def __init__(self) -> None:
        # Next to the kubeconfig it uses: the test's own tmp_path.
        handle, name = tempfile.mkstemp(".log", "operator-", Path(os.environ["KUBECONFIG"]).parent)
        os.close(handle)
        self.log = Path(name)
        self.process: asyncio.subprocess.Process | None = None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def _ending(self) -> str:
        return f"; its log ends:\n{self.output[-6000:]}"

    async def __aenter__(self) -> "Operator":
        liveness = f"http://127.0.0.1:{free_port()}/healthz"
        with self.log.open("wb") as out:
            # -X faulthandler: SIGABRT makes it write every thread's stack to the log before it dies.
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-X", "faulthandler", "-m", "rlfleet.operator", "--liveness", liveness,
                stdout=out, stderr=subprocess.STDOUT)
        return self

    async def __aexit__(self, error: type[BaseException] | None, *_: Any) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            code = await asyncio.wait_for(self.process.wait(), STOP_SECONDS)
        except TimeoutError:
            self.process.send_signal(signal.SIGABRT)
            await self.process.wait()
            if error is not None:
                return  # the test's own failure comes first
            raise AssertionError(f"the operator did not stop within {STOP_SECONDS} s of SIGTERM"
                                 f"{self._ending()}") from None
        assert error is not None or code == 0, f"the operator exited {code}{self._ending()}"
