"""Configuration of the one node: its network namespace and addresses, containerd, CNI, the kubelet.

Everything of the cluster runs inside one network namespace of its own: the pods' bridge, kube-proxy's
iptables rules and every listening port stay there, the host's network is never changed, and pods get no
default route (only the pod and service ranges), so no pod traffic can leave the namespace. The namespace has
no link to the host either: the host reaches the API server through scripts/kube/relay.py on its loopback.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

NETNS = "rlfleet-kube"
NETNS_PATH = f"/run/netns/{NETNS}"
# The node's address, on the namespace's loopback: the kubelet refuses 127.x, and pods reach it through the
# kubernetes Service (kube-proxy), the API server reaches the kubelet on it.
NODE_IP = "10.203.0.2"
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.96.0.0/24"
API_SERVICE_IP = "10.96.0.1"
# Where pods' resolv.conf points (the usual kube-dns address): dnsmasq listens there, on the node's loopback.
DNS_IP = "10.96.0.10"
NODE = "rlfleet-node"
PAUSE_IMAGE = "localhost/rlfleet/pause:3.2"
CNI_BIN = "/usr/lib/cni"


def _ip(*args: str, netns: bool = False) -> None:
    command = ["ip", "-n", NETNS, *args] if netns else ["ip", *args]
    subprocess.run(command, check=True, capture_output=True)


def netns_exists() -> bool:
    return Path(NETNS_PATH).exists()


def make_netns() -> None:
    _ip("netns", "add", NETNS)
    _ip("link", "set", "lo", "up", netns=True)
    for address in (NODE_IP, DNS_IP):
        _ip("addr", "add", f"{address}/32", "dev", "lo", netns=True)


def delete_netns() -> None:
    """Deleting the namespace deletes its bridge and the pods' links with it."""
    if netns_exists():
        _ip("netns", "delete", NETNS)


def in_netns(command: list[str]) -> list[str]:
    # nsenter, not `ip netns exec`: that one remounts /sys, hiding the cgroup mounts the kubelet needs.
    return ["nsenter", f"--net={NETNS_PATH}", "--", *command]


def write_cni(directory: Path, ipam_dir: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    bridge = {
        "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
        # No default route: pods reach each other and the services (API server, DNS), nothing else.
        "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": SERVICE_CIDR}],
                 "dataDir": str(ipam_dir)},
    }
    config = {"cniVersion": "0.4.0", "name": "rlfleet", "plugins": [bridge]}
    (directory / "10-rlfleet.conflist").write_text(json.dumps(config, indent=2))


def write_containerd(path: Path, root: Path, state: Path, socket: Path, cni_dir: Path) -> None:
    cri = "io.containerd.grpc.v1.cri"
    path.write_text(f"""version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[plugins."{cri}"]
  sandbox_image = "{PAUSE_IMAGE}"
  # This VM drops CAP_SYS_RESOURCE: without this, runc cannot start any pod sandbox.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."{cri}".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni_dir}"
  [plugins."{cri}".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."{cri}".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
""")


def write_kubelet(path: Path, ca: Path, resolv_conf: Path) -> None:
    resolv_conf.write_text("")  # pods search the cluster's domains only, never the host's
    path.write_text(yaml.safe_dump({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [DNS_IP],
        "clusterDomain": "cluster.local",
        "resolvConf": str(resolv_conf),
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "serializeImagePulls": False,
        # ConfigMap volumes follow their object at each pod sync: a job's endpoints file (`kubectl scale`) reaches
        # the controller in seconds rather than the default minute, which only made the tests wait.
        "syncFrequency": "10s",
        # Images come from `ctr import`, not a registry: never garbage-collect them; evict only when nearly full.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "2%", "imagefs.available": "2%",
                         "nodefs.inodesFree": "2%"},
    }))
