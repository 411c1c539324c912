"""A one-node Kubernetes cluster on this machine, from Debian's packages (see scripts/kube/build.sh).

    .venv/bin/python scripts/kube/cluster.py up [--image ARCHIVE]...   # prints the admin kubeconfig's path
    .venv/bin/python scripts/kube/cluster.py down

`up` builds the binaries once (cached), starts etcd, the API server, controller manager, scheduler, containerd,
the kubelet, kube-proxy and a DNS stand-in (scripts/kube/dns.py) in a network namespace of their own
(scripts/kube/node.py) that the host reaches only through a loopback relay (scripts/kube/relay.py), imports image archives into the node's containerd (kept across starts), and offers
local PersistentVolumes. `down` stops exactly the processes `up` recorded, after the pods they ran, and
removes the namespace, mounts and cgroups they left. Needs root. State (logs, certificates, kubeconfigs):
$RLFLEET_KUBE_STATE, default /tmp/rlfleet-kube.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import signal
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import node
import pki
from dns import dnsmasq_command

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("RLFLEET_KUBE_CACHE") or
             Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlfleet" / "kubernetes")
STATE = Path(os.environ.get("RLFLEET_KUBE_STATE", "/tmp/rlfleet-kube"))
# Images survive restarts: importing the project's image takes a minute, starting the cluster seconds.
CONTAINERD_ROOT = CACHE / "containerd"
IMPORTED = CONTAINERD_ROOT / "rlfleet-imported.json"
ETCD_DATA = Path("/dev/shm/rlfleet-kube-etcd")
VOLUMES = 6
VOLUME_SIZE = "20Gi"
# Stopped last to first: nothing recreates pods while they are deleted, the API outlives its clients.
ORDER = ["relay", "etcd", "kube-apiserver", "containerd", "kubelet", "kube-proxy", "kube-controller-manager",
         "kube-scheduler", "dnsmasq", "dns"]


def log(message: str) -> None:
    print(f"rlfleet kube: {message}", file=sys.stderr, flush=True)


class Api:
    """The few admin calls `up` and `down` make (urllib: the script needs no client library), through the relay."""

    def __init__(self, state: Path):
        self.server = f"https://127.0.0.1:{(state / 'relay.port').read_text()}"
        self.token = pki.admin_token(state / "pki")
        self.context = ssl.create_default_context(cafile=str(state / "pki" / "ca.crt"))

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=self.context, timeout=10) as reply:
            return json.load(reply) if reply.headers.get("Content-Type", "").startswith("application/json") else {}

    def ok(self, path: str) -> bool:
        try:
            self.call("GET", path)
            return True
        except (OSError, ValueError):
            return False


def wait(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {seconds:.0f} s (logs in {STATE / 'logs'})")
        time.sleep(0.2)


# --- processes ----------------------------------------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None once it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _records(state: Path) -> dict[str, dict]:
    path = state / "processes.json"
    return json.loads(path.read_text()) if path.exists() else {}


def start(state: Path, name: str, command: list[str], netns: bool = True) -> None:
    """Start a daemon in its own session (its group is what `down` signals) and record it."""
    with open(state / "logs" / f"{name}.log", "ab") as out:
        process = subprocess.Popen(node.in_netns(command) if netns else command, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    records = _records(state)
    records[name] = {"pid": process.pid, "start": _start_time(process.pid)}
    (state / "processes.json").write_text(json.dumps(records))


def alive(state: Path, name: str) -> bool:
    record = _records(state).get(name)
    # The start time guards against a recycled pid: never signal a process this script did not start.
    return record is not None and record["start"] is not None and _start_time(record["pid"]) == record["start"]


def stop(state: Path, name: str, grace: float = 10.0) -> None:
    if not alive(state, name):
        return
    pid = _records(state)[name]["pid"]
    for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + seconds
        while alive(state, name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not alive(state, name):
            return


def _shims(socket: Path) -> list[int]:
    """containerd shims started by this cluster's containerd (they outlive it by design)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"containerd-shim" in command[0] and str(socket).encode() in command:
                found.append(int(entry.name))
    return found


# --- up -----------------------------------------------------------------------------------------------------

def build() -> Path:
    out = subprocess.run(["bash", str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def pause_archive(bin_dir: Path) -> Path:
    """A docker-archive of the pod sandbox image: one layer holding the `pause` binary built with the rest."""
    path = bin_dir.parent / "pause.tar"
    if path.exists():
        return path
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        tar.add(bin_dir / "pause", arcname="pause")
    layer_bytes = layer.getvalue()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Entrypoint": ["/pause"]},
                         "rootfs": {"type": "layers",
                                    "diff_ids": [f"sha256:{hashlib.sha256(layer_bytes).hexdigest()}"]}}).encode()
    manifest = json.dumps([{"Config": "config.json", "RepoTags": [node.PAUSE_IMAGE], "Layers": ["layer.tar"]}])
    with tarfile.open(path.with_suffix(".part"), "w") as tar:
        for name, data in (("layer.tar", layer_bytes), ("config.json", config), ("manifest.json", manifest.encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.with_suffix(".part").rename(path)
    return path


def import_images(socket: Path, archives: list[Path]) -> None:
    """ctr-import each archive unless this containerd already holds that build (its .id file, else its hash)."""
    done = json.loads(IMPORTED.read_text()) if IMPORTED.exists() else {}
    for archive in archives:
        marker = archive.with_name(archive.name + ".id")
        build_id = marker.read_text().strip() if marker.exists() else hashlib.sha256(archive.read_bytes()).hexdigest()
        if done.get(str(archive)) == build_id:
            continue
        started = time.monotonic()
        subprocess.run(["ctr", "--address", str(socket), "-n", "k8s.io", "images", "import", str(archive)],
                       check=True, capture_output=True)
        log(f"imported {archive.name} in {time.monotonic() - started:.0f} s")
        done[str(archive)] = build_id
        IMPORTED.write_text(json.dumps(done))


def local_volume(index: int, path: Path) -> dict:
    """A node-local PersistentVolume (the kubelet applies fsGroup to it, unlike hostPath)."""
    hostname = {"key": "kubernetes.io/hostname", "operator": "In", "values": [node.NODE]}
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"local-{index}"},
            "spec": {"capacity": {"storage": VOLUME_SIZE}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "local": {"path": str(path)},
                     "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [hostname]}]}}}}


def node_ready(api: Api) -> bool:
    try:
        conditions = api.call("GET", f"/api/v1/nodes/{node.NODE}")["status"].get("conditions") or []
    except (OSError, ValueError, KeyError):
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def control_plane(state: Path, bins: Path, tokens: dict[str, str]) -> None:
    p = state / "pki"
    # Inside the namespace: the API server on the node's address; the DNS loop reads with the admin's token.
    server = f"https://{node.NODE_IP}:6443"
    configs = {name: pki.kubeconfig(state / f"{name}.kubeconfig", server, p / "ca.crt", tokens[name])
               for name in tokens if name != "admin"}
    pki.kubeconfig(state / "dns.kubeconfig", server, p / "ca.crt", tokens["admin"])
    start(state, "etcd", ["etcd", "--name", "node", "--data-dir", str(ETCD_DATA),
                          "--listen-client-urls", "http://127.0.0.1:2379",
                          "--advertise-client-urls", "http://127.0.0.1:2379",
                          "--listen-peer-urls", "http://127.0.0.1:2380",
                          "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                          "--initial-cluster", "node=http://127.0.0.1:2380"])
    start(state, "kube-apiserver", [
        str(bins / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379", "--bind-address=0.0.0.0",
        f"--advertise-address={node.NODE_IP}", "--secure-port=6443", "--insecure-port=0",
        f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
        f"--client-ca-file={p / 'ca.crt'}", f"--token-auth-file={p / 'tokens.csv'}",
        f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--api-audiences=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={node.SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
        f"--kubelet-client-certificate={p / 'kubelet-client.crt'}",
        f"--kubelet-client-key={p / 'kubelet-client.key'}", "--kubelet-preferred-address-types=InternalIP"])
    start(state, "kube-controller-manager", [
        str(bins / "kube-controller-manager"), f"--kubeconfig={configs['controller-manager']}",
        "--controllers=*,-nodeipam,-cloud-node-lifecycle", "--use-service-account-credentials",
        f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
        f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
        "--leader-elect=false", "--bind-address=127.0.0.1", "--port=0"])
    start(state, "kube-scheduler", [str(bins / "kube-scheduler"), f"--kubeconfig={configs['scheduler']}",
                                    "--leader-elect=false", "--bind-address=127.0.0.1", "--port=0"])


def worker_node(state: Path, bins: Path, images: list[Path]) -> None:
    socket = state / "containerd.sock"
    node.write_cni(state / "cni", state / "cni-ipam")
    node.write_containerd(state / "containerd.toml", CONTAINERD_ROOT, state / "containerd", socket, state / "cni")
    node.write_kubelet(state / "kubelet.yaml", state / "pki" / "ca.crt", state / "resolv.conf")
    start(state, "containerd", ["containerd", "--config", str(state / "containerd.toml")])
    wait(socket.exists, 30, "containerd")
    import_images(socket, [pause_archive(bins), *images])
    start(state, "kubelet", [
        str(bins / "kubelet"), f"--kubeconfig={state / 'kubelet.kubeconfig'}", f"--config={state / 'kubelet.yaml'}",
        "--container-runtime=remote", f"--container-runtime-endpoint=unix://{socket}",
        f"--hostname-override={node.NODE}", f"--node-ip={node.NODE_IP}", f"--root-dir={state / 'kubelet'}",
        f"--cert-dir={state / 'kubelet-pki'}", f"--pod-infra-container-image={node.PAUSE_IMAGE}"])
    start(state, "kube-proxy", [
        str(bins / "kube-proxy"), f"--kubeconfig={state / 'kube-proxy.kubeconfig'}",
        f"--hostname-override={node.NODE}", "--proxy-mode=iptables", f"--cluster-cidr={node.POD_CIDR}",
        "--healthz-bind-address=127.0.0.1:10256", "--metrics-bind-address=127.0.0.1:10249",
        # 0: leave the kernel's conntrack limits and timeouts as they are (some are machine-wide).
        "--conntrack-max-per-core=0", "--conntrack-min=0", "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0"])
    hosts = state / "dns"
    hosts.mkdir()
    start(state, "dnsmasq", dnsmasq_command(node.DNS_IP, hosts))
    start(state, "dns", [sys.executable, str(HERE / "dns.py"), str(state / "dns.kubeconfig"), str(hosts)])


def up(state: Path, images: list[Path]) -> Path:
    started = time.monotonic()
    bins = build()
    if state.exists():
        down(state)  # a cluster left by a killed run
    if node.netns_exists():
        raise RuntimeError(f"network namespace {node.NETNS} exists: another cluster runs (stop it first)")
    subprocess.run(["rm", "-rf", str(state), str(ETCD_DATA)], check=True)
    (state / "logs").mkdir(parents=True)
    CONTAINERD_ROOT.mkdir(parents=True, exist_ok=True)
    pki.make_pki(state / "pki", node.NODE_IP, node.API_SERVICE_IP)
    tokens = pki.make_tokens(state / "pki", node.NODE)
    node.make_netns()
    start(state, "relay", [sys.executable, str(HERE / "relay.py"), node.NETNS_PATH, node.NODE_IP, "6443",
                           str(state / "relay.port")], netns=False)
    wait((state / "relay.port").exists, 30, "the API relay")
    admin = pki.kubeconfig(state / "admin.kubeconfig", f"https://127.0.0.1:{(state / 'relay.port').read_text()}",
                           state / "pki" / "ca.crt", tokens["admin"])
    control_plane(state, bins, tokens)
    api = Api(state)
    wait(lambda: api.ok("/readyz"), 60, "the API server")
    worker_node(state, bins, images)
    for index in range(VOLUMES):
        path = state / "volumes" / f"local-{index}"
        path.mkdir(parents=True)
        api.call("POST", "/api/v1/persistentvolumes", local_volume(index, path))
    wait(lambda: node_ready(api), 120, f"node {node.NODE}")
    # Pods are refused until the service-account controllers have made the namespace's account.
    wait(lambda: api.ok("/api/v1/namespaces/default/serviceaccounts/default"), 60, "the default service account")
    log(f"cluster up in {time.monotonic() - started:.1f} s")
    return admin


# --- down ---------------------------------------------------------------------------------------------------

def delete_pods(state: Path) -> None:
    """Every pod, at once: the kubelet stops its containers and tears down its network namespace."""
    api = Api(state)
    try:
        pods = api.call("GET", "/api/v1/pods")["items"]
        for pod in pods:
            meta = pod["metadata"]
            api.call("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}?gracePeriodSeconds=0")
    except (OSError, ValueError) as error:
        log(f"could not delete the pods: {error}")


def running_tasks(socket: Path) -> bool:
    out = subprocess.run(["ctr", "--address", str(socket), "-n", "k8s.io", "tasks", "ls", "-q"],
                         capture_output=True, text=True)
    return out.returncode == 0 and bool(out.stdout.strip())


def unmount_below(*roots: Path) -> None:
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted(mounts, key=len, reverse=True):
        if any(point == str(root) or point.startswith(f"{root}/") for root in roots):
            subprocess.run(["umount", "-l", point], capture_output=True)


def remove_pod_cgroups() -> None:
    """The kubelet's empty kubepods cgroups, deepest first (rmdir refuses any still in use)."""
    for top in Path("/sys/fs/cgroup").glob("*/kubepods"):
        for directory in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [top]:
            if directory.is_dir():
                try:
                    directory.rmdir()
                except OSError:
                    pass


def down(state: Path) -> None:
    started = time.monotonic()
    socket = state / "containerd.sock"
    for name in ("dns", "dnsmasq", "kube-scheduler", "kube-controller-manager"):
        stop(state, name)
    if alive(state, "kube-apiserver") and alive(state, "kubelet"):
        delete_pods(state)
        deadline = time.monotonic() + 60
        while running_tasks(socket) and time.monotonic() < deadline:
            time.sleep(0.5)
    started_kubelet = "kubelet" in _records(state)
    for name in reversed(ORDER):
        stop(state, name)
    for pid in _shims(socket):
        os.kill(pid, signal.SIGKILL)
    unmount_below(state, CONTAINERD_ROOT)
    node.delete_netns()
    if started_kubelet:
        remove_pod_cgroups()
    subprocess.run(["rm", "-rf", str(ETCD_DATA)], check=True)
    (state / "processes.json").unlink(missing_ok=True)
    log(f"cluster down in {time.monotonic() - started:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--image", action="append", default=[], type=Path,
                        help="a docker-archive to import into the node's containerd (repeatable)")
    args = parser.parse_args(argv)
    if args.action == "up":
        print(up(STATE, args.image))
    else:
        down(STATE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
