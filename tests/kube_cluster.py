"""The Kubernetes cluster of the `cluster` tests, and kubectl on it.

By default the session brings up the project's one-node cluster (scripts/kube/: Kubernetes 1.20 from Debian's
source package, built once and cached) with the project's image, built from its Dockerfile by
scripts/kube/image.sh and imported into the node, and stops it at the end.

RLFLEET_KUBECONFIG=PATH runs the same tests on an existing cluster instead (nothing is built or started):
RLFLEET_TEST_IMAGE then names an image built from this Dockerfile that its nodes can pull, and its default
StorageClass must provide the trainer's volume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from helm_tool import kubectl_binary
from runs import wait_for

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts" / "kube"
IMAGE = "ghcr.io/rlfleet/rlfleet:0.1.0-cpu"
# Cold: ~10 min of Go on 2 cores plus the image; warm: seconds.
BUILD_SECONDS = 3600
# kubectl's discovery cache: the tests' own, not the user's ~/.kube.
CACHE_DIR = Path(tempfile.gettempdir()) / "rlfleet-kubectl-cache"


@dataclass
class Cluster:
    kubeconfig: Path
    image: str
    seconds: dict[str, float] = field(default_factory=dict)
    """How long building and starting took (printed at the end of the session)."""

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run([str(kubectl_binary()), f"--kubeconfig={self.kubeconfig}", f"--cache-dir={CACHE_DIR}",
                              *args], input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def get(self, kind: str, name: str | None = None, namespace: str | None = None) -> Any:
        """The object (None if absent) or, without a name, the list's items."""
        where = [f"--namespace={namespace}"] if namespace else ["--all-namespaces"] if name is None else []
        out = self.kubectl("get", kind, *([name] if name else []), *where, "-o", "json", check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise AssertionError(f"kubectl get {kind} {name or ''}: {out.stderr.strip()}")
        found = json.loads(out.stdout)
        return found if name else found["items"]

    def apply(self, document: dict[str, Any], *flags: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.kubectl("apply", "-f", "-", *flags, stdin=json.dumps(document), check=check)

    def server_minor(self) -> int:
        version = json.loads(self.kubectl("version", "-o", "json").stdout)["serverVersion"]
        return int("".join(ch for ch in version["minor"] if ch.isdigit()))


def eventually(check: Callable[[], Any], seconds: float, what: str) -> Any:
    """Poll check() every second (each poll runs kubectl) until it returns something truthy; returns that."""
    return wait_for(check, seconds, what, every=1.0)


def _script(cluster: Cluster, name: str, *command: str) -> str:
    """Run a scripts/kube step, timed; returns the last line it printed (the path it made)."""
    started = time.monotonic()
    out = subprocess.run(list(command), stdout=subprocess.PIPE, text=True, timeout=BUILD_SECONDS, check=True)
    cluster.seconds[name] = round(time.monotonic() - started, 1)
    return (out.stdout.strip().splitlines() or [""])[-1]


def own_cluster() -> Iterator[Cluster]:
    """Build (once), start the project's cluster with the project's image; stop it when done."""
    cluster = Cluster(Path(), IMAGE)
    # The Go build is CPU-bound, the image mostly downloads: build both at once.
    binaries = subprocess.Popen(["bash", str(SCRIPTS / "build.sh")], stdout=subprocess.DEVNULL)
    try:
        archive = _script(cluster, "image", "bash", str(SCRIPTS / "image.sh"))
    finally:
        binaries.wait(BUILD_SECONDS)
    up = [sys.executable, str(SCRIPTS / "cluster.py")]
    try:
        cluster.kubeconfig = Path(_script(cluster, "up (build included)", *up, "up", "--image", archive))
        yield cluster
    finally:
        _script(cluster, "down", *up, "down")
        print(f"\nrlfleet cluster seconds: {json.dumps(cluster.seconds)}", file=sys.stderr)


def clusters() -> Iterator[Cluster]:
    if os.environ.get("RLFLEET_KUBECONFIG"):
        yield Cluster(Path(os.environ["RLFLEET_KUBECONFIG"]), os.environ.get("RLFLEET_TEST_IMAGE", IMAGE))
    else:
        yield from own_cluster()
