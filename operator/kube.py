"""A small async Kubernetes API client (aiohttp): only the calls the operator makes.

Why not the `kubernetes` package: it is synchronous (handlers would block kopf's loop or need threads) and
large; kopf already brings aiohttp and knows how to log in (in-cluster service account or kubeconfig).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import kopf

from rlfleet.operator import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)
# The API server answers in milliseconds; a slow call should fail the handler (kopf retries it).
REQUEST_TIMEOUT_SECONDS = 30
COLLECTIONS = {
    (f"{GROUP}/{VERSION}", "RLJob"): f"apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}",
    ("v1", "ConfigMap"): "api/v1/namespaces/{ns}/configmaps",
    ("v1", "Secret"): "api/v1/namespaces/{ns}/secrets",
    ("v1", "Service"): "api/v1/namespaces/{ns}/services",
    ("v1", "Pod"): "api/v1/namespaces/{ns}/pods",
    ("v1", "ServiceAccount"): "api/v1/namespaces/{ns}/serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"):
        "apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    ("coordination.k8s.io/v1", "Lease"): "apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
    ("apps/v1", "StatefulSet"): "apis/apps/v1/namespaces/{ns}/statefulsets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    ("kueue.x-k8s.io/v1beta1", "Workload"): "apis/kueue.x-k8s.io/v1beta1/namespaces/{ns}/workloads",
}


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str):
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {message[:500]}")


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    return COLLECTIONS[(api_version, kind)].format(ns=namespace)


def object_path(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{collection_path(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}"


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The same credentials kopf uses: the pod's service account in a cluster, else the kubeconfig."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig: cannot reach the Kubernetes API")
    return info


class Kube:
    def __init__(self, info: kopf.ConnectionInfo, settings: kopf.OperatorSettings | None = None):
        self.settings = settings
        self.session = self._session(info)

    @staticmethod
    def _session(info: kopf.ConnectionInfo) -> aiohttp.ClientSession:
        ssl = info.as_ssl_context() if info.server.startswith("https") else False
        return aiohttp.ClientSession(
            base_url=info.server.rstrip("/") + "/",
            headers=info.as_http_headers(),
            connector=aiohttp.TCPConnector(ssl=ssl),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS),
        )

    async def close(self) -> None:
        await self.session.close()

    async def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                      params: dict[str, str] | None = None) -> dict[str, Any] | None:
        """The decoded reply; None for 404. Service-account tokens rotate: a 401 logs in again once."""
        for attempt in range(2):
            headers = {"Content-Type": content_type} if content_type else {}
            async with self.session.request(method, path, json=body, headers=headers, params=params) as reply:
                if reply.status == 401 and attempt == 0 and self.settings is not None:
                    await self.session.close()
                    self.session = self._session(login(self.settings))
                    continue
                if reply.status == 404:
                    return None
                if reply.status >= 400:
                    raise ApiError(reply.status, method, path, await reply.text())
                return await reply.json(content_type=None)
        raise AssertionError("unreachable")

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self.request("GET", path)

    async def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", collection, obj) or {}

    async def json_patch(self, path: str, ops: list[dict[str, Any]]) -> None:
        await self.request("PATCH", path, ops, content_type="application/json-patch+json")

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> None:
        await self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    async def delete(self, path: str) -> None:
        await self.request("DELETE", path)

    async def list(self, collection: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        reply = await self.request("GET", collection, params={"labelSelector": selector}) or {}
        # Filtered here as well: cheap, and correct against API emulators that ignore selectors.
        return [item for item in reply.get("items", [])
                if labels.items() <= (item.get("metadata", {}).get("labels") or {}).items()]
