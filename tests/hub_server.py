"""A Hugging Face Hub on loopback for the hf:// tests: the part of the Hub's HTTP API that huggingface_hub's
snapshot_download and hf_hub_download use (repository info, the recursive tree, HEAD and GET of a file at
/resolve/), serving in-memory repositories at one commit. Not the Hub: no auth, no LFS or Xet, no pagination."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubServer:
    """`repos[(kind, "owner/name")] = {path: bytes}`, kind "models" or "datasets"; `url` is HF_ENDPOINT."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], dict[str, bytes]] = {}
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                server.requests.append(f"{self.command} {self.path}")

            def do_GET(self) -> None:
                self._answer(*server.answer(unquote(urlparse(self.path).path)), head=False)

            def do_HEAD(self) -> None:
                self._answer(*server.answer(unquote(urlparse(self.path).path)), head=True)

            def _answer(self, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def answer(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 6:  # /api/{kind}/{owner}/{name}/{revision|tree}/{rev}
            return self._api(parts[1], "/".join(parts[2:4]), parts[4])
        kind = parts.pop(0) if parts[0] in ("datasets", "spaces") else "models"
        if len(parts) >= 5 and parts[2] == "resolve":  # /{owner}/{name}/resolve/{rev}/{file}
            data = self.repos.get((kind, "/".join(parts[:2])), {}).get("/".join(parts[4:]))
            if data is not None:
                return 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            return 404, b"", {"X-Error-Code": "EntryNotFound"}
        return 404, b"", {}

    def _api(self, kind: str, repo_id: str, what: str) -> tuple[int, bytes, dict[str, str]]:
        files = self.repos.get((kind, repo_id))
        if files is None:
            return 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}
        if what == "revision":
            body = {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": name} for name in files]}
        else:
            body = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in files.items()]
        return 200, json.dumps(body).encode(), {"Content-Type": "application/json"}
