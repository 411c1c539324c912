"""The Kubernetes cluster of the `cluster` tests, and kubectl on it.

By default the session brings up the project's one-node cluster (scripts/kube/: Kubernetes 1.20 from Debian's
source package, built once and cached) with the project's image, built from its Dockerfile by
scripts/kube/image.sh and imported into the node, and stops it at the end.

RLFLEET_KUBECONFIG=PATH runs the same tests on an existing cluster instead (nothing is built or started):
RLFLEET_TEST_IMAGE then names an image built from this Dockerfile that its nodes can pull, and its default
StorageClass must provide the trainer's volume.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from helm_tool import kubectl_binary
from runs import wait_for

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts" / "kube"
IMAGE = "ghcr.io/rlfleet/rlfleet:0.1.0-cpu"
# Cold: ~10 min of Go on 2 cores plus the image; warm: seconds.
BUILD_SECONDS = 3600
SECONDS: dict[str, float] = {}
"""What building, starting and stopping the session's cluster took (pytest prints it at the end)."""
# kubectl's discovery cache: the tests' own, not the user's ~/.kube.
CACHE_DIR = Path(tempfile.gettempdir()) / "rlfleet-kubectl-cache"


@dataclass
class Cluster:
    kubeconfig: Path
    image: str

    def command(self, *args: str) -> list[str]:
        """kubectl on this cluster, with the tests' own discovery cache."""
        return [str(kubectl_binary()), f"--kubeconfig={self.kubeconfig}", f"--cache-dir={CACHE_DIR}", *args]

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        out = subprocess.run(self.command(*args), input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    @contextlib.contextmanager
    def followed_logs(self, pod: str, namespace: str, into: Path) -> Iterator[Path]:
        """`kubectl logs -f` into a file: every line the pod's container writes, kept after the pod is gone (a
        poll of `kubectl logs` misses what a container writes just before the job ends and deletes its pod)."""
        with open(into, "w", encoding="utf-8") as out:
            follower = subprocess.Popen(self.command("logs", "-f", pod, f"--namespace={namespace}"), stdout=out,
                                        stderr=subprocess.STDOUT)
        try:
            yield into
        finally:
            follower.kill()
            follower.wait()

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


def _script(name: str, *command: str) -> str:
    """Run a scripts/kube step, timed; returns the last line it printed (the path it made)."""
    started = time.monotonic()
    out = subprocess.run(list(command), stdout=subprocess.PIPE, text=True, timeout=BUILD_SECONDS, check=True)
    SECONDS[name] = round(time.monotonic() - started, 1)
    return (out.stdout.strip().splitlines() or [""])[-1]


@dataclass
class Build:
    """A scripts/kube build running in the background, its output in a log file."""
    script: str
    log: Path
    process: subprocess.Popen

    def result(self) -> str:
        """Wait for it; returns the last line it printed (the path it made)."""
        waited = time.monotonic()
        self.process.wait(BUILD_SECONDS)
        # What the suite did not cover; the build's own time is in its log ("built ... in N s").
        SECONDS[f"{self.script} waited for"] = round(time.monotonic() - waited, 1)
        lines = self.log.read_text().strip().splitlines()
        if self.process.returncode != 0:
            raise AssertionError(f"scripts/kube/{self.script} failed ({self.process.returncode}):\n"
                                 + "\n".join(lines[-30:]))
        return lines[-1]


BUILDS: dict[str, Build] = {}
UP = "up"
"""BUILDS' key of the cluster brought up early (start_cluster_early), until own_cluster takes it."""


def can_build() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def start_builds() -> None:
    """Start building the binaries (Go, CPU-bound) and the image (mostly downloads) now, in the background and
    at the lowest CPU priority: on a fresh machine they take ~20 minutes, which the rest of the suite covers
    (the cluster tests run last). Built already, they finish in seconds."""
    if os.environ.get("RLFLEET_KUBECONFIG") or BUILDS or not can_build():
        return
    logs = Path(tempfile.gettempdir()) / "rlfleet-kube-build"
    logs.mkdir(exist_ok=True)
    for script in ("build.sh", "image.sh"):
        log = logs / f"{script}.log"
        with log.open("w") as out:
            # The scripts print the path they made last, after their progress on stderr.
            BUILDS[script] = Build(script, log, subprocess.Popen(
                ["nice", "-n", "19", "bash", str(SCRIPTS / script)], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True))
            lowest_priority(BUILDS[script].process.pid)


def lowest_priority(session_leader: int) -> None:
    """Nice 19 for the session's whole autogroup: with autogroup scheduling (most distributions' kernels) each
    session shares the CPU equally with the others, its processes' own nice counting only among themselves, and
    the builds took 2/3 of a CPU-bound test's throughput (the killed-trainer e2e tests failed under it)."""
    try:
        Path(f"/proc/{session_leader}/autogroup").write_text("19")
    except OSError:
        pass  # no autogroup scheduling: the processes' nice is enough


def start_cluster_early() -> None:
    """Bring the cluster up in the background now, if its builds are done: the cluster tests' first ~100 s, covered
    by the tests before them (the unit tests; `pytest_runtest_setup` says when)."""
    if os.environ.get("RLFLEET_KUBECONFIG") or UP in BUILDS or not _builds_done():
        return
    log = Path(tempfile.gettempdir()) / "rlfleet-kube-build" / f"{UP}.log"
    with log.open("w") as out:
        BUILDS[UP] = Build(UP, log, subprocess.Popen(_up_command(BUILDS["image.sh"].result()), stdout=out,
                                                     stderr=subprocess.STDOUT, start_new_session=True))


def _builds_done() -> bool:
    return all(script in BUILDS and BUILDS[script].process.poll() == 0 for script in ("build.sh", "image.sh"))


def _up_command(archive: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / "cluster.py"), "up", "--image", archive]


def _down() -> None:
    _script("down", sys.executable, str(SCRIPTS / "cluster.py"), "down")


def stop_builds() -> None:
    """A session that ends before its cluster tests leaves no build running, and no cluster up."""
    for build in BUILDS.values():
        if build.process.poll() is None:
            os.killpg(build.process.pid, signal.SIGTERM)
            build.process.wait(60)
    if UP in BUILDS:
        _down()


def own_cluster() -> Iterator[Cluster]:
    """Build (once), start the project's cluster with the project's image; stop it when done."""
    if not can_build():
        raise AssertionError("the cluster tests bring up their own cluster as root on Debian bookworm (apt); "
                             "elsewhere set RLFLEET_KUBECONFIG (docs/kubernetes.md) or leave them out: "
                             "-m 'not cluster'")
    cluster = Cluster(Path(), IMAGE)
    start_builds()
    BUILDS["build.sh"].result()
    archive = BUILDS["image.sh"].result()
    early = BUILDS.pop(UP, None)  # from here on this fixture brings the cluster down
    try:
        cluster.kubeconfig = Path(early.result() if early else _script(UP, *_up_command(archive)))
        yield cluster
    finally:
        _down()


def clusters() -> Iterator[Cluster]:
    if os.environ.get("RLFLEET_KUBECONFIG"):
        yield Cluster(Path(os.environ["RLFLEET_KUBECONFIG"]), os.environ.get("RLFLEET_TEST_IMAGE", IMAGE))
    else:
        yield from own_cluster()
