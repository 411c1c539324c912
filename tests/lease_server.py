"""A Kubernetes API server for Leases only, on loopback: get, create and update with the real server's optimistic
concurrency (every write bumps resourceVersion; an update naming an older one, or a create of an existing name, is
409 Conflict; an update naming none replaces unconditionally). KMock keeps resourceVersion fixed and has no update
(PUT), so it cannot show that two contenders never both win."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PREFIX = "/apis/coordination.k8s.io/v1/namespaces/"


class LeaseServer:
    """Serves on 127.0.0.1 (a free port) until stop(); `down` answers every call 503, as an unreachable server."""

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 0
        self.down = False
        self.lock = threading.Lock()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def lease(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        with self.lock:
            return copy.deepcopy(self.leases.get((namespace, name)))

    def create(self, name: str, annotations: dict[str, str] | None = None, namespace: str = "default") -> None:
        """The Lease as the operator creates it with the job: no holder."""
        self.answer("POST", f"{PREFIX}{namespace}/leases", {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "annotations": annotations or {}}, "spec": {}})

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        namespace, _, rest = path.removeprefix(PREFIX).partition("/leases")
        name = rest.strip("/")
        with self.lock:
            if self.down:
                return 503, {"reason": "ServiceUnavailable"}
            live = self.leases.get((namespace, name or body["metadata"]["name"]))
            if method == "GET":
                return (200, live) if live else (404, {"reason": "NotFound"})
            if (method == "POST") != (live is None):
                return (409, {"reason": "AlreadyExists"}) if live else (404, {"reason": "NotFound"})
            named = body["metadata"].get("resourceVersion")  # none: an unconditional update, as the real server does
            if method == "PUT" and named is not None and named != live["metadata"]["resourceVersion"]:
                return 409, {"reason": "Conflict"}
            self.version += 1
            stored = copy.deepcopy(body)
            stored["metadata"] |= {"namespace": namespace, "resourceVersion": str(self.version)}
            self.leases[namespace, stored["metadata"]["name"]] = stored
            return (201 if method == "POST" else 200), copy.deepcopy(stored)


def _handler(server: LeaseServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, reply = server.answer(self.command, self.path, body)
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = _serve

        def log_message(self, *args: Any) -> None:
            pass

    return Handler
