"""Cluster DNS for the one-node test cluster, which has no CoreDNS: dnsmasq answers from a hosts file that
this loop rewrites from the API's Services and Endpoints (what CoreDNS's kubernetes plugin reads).

Names served, under cluster.local:
  <svc>.<ns>.svc              the ClusterIP, or for a headless Service every address of its Endpoints
  <hostname>.<svc>.<ns>.svc   an Endpoints address that has a hostname (StatefulSet pods of a headless Service)
Limits (none matter to RLFleet, all differ from CoreDNS): A records only (AAAA, SRV and PTR queries get no
answer), every other name is NXDOMAIN and nothing is forwarded, records follow the API by polling (up to
POLL_SECONDS late), and a pod's own <ip-with-dashes>.<ns>.pod names are not served.

    python scripts/kube/dns.py KUBECONFIG HOSTS_DIR
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.request
from pathlib import Path

import yaml

POLL_SECONDS = 0.5
DOMAIN = "cluster.local"


def dnsmasq_command(address: str, hosts_dir: Path) -> list[str]:
    """dnsmasq on `address`: the hosts files in hosts_dir (re-read on change), NXDOMAIN for anything else."""
    return ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--pid-file", "--user=root",
            f"--listen-address={address}", "--bind-interfaces", "--no-resolv", "--no-hosts", "--no-poll",
            f"--hostsdir={hosts_dir}", "--address=/#/", "--local-ttl=1", "--log-facility=-"]


def records(services: list[dict], endpoints: list[dict]) -> list[tuple[str, str]]:
    """(ip, name) pairs of every Service and Endpoints address, as CoreDNS would answer them."""
    found = []
    headless = set()
    for service in services:
        meta, spec = service["metadata"], service.get("spec") or {}
        base = f"{meta['name']}.{meta['namespace']}.svc.{DOMAIN}"
        if spec.get("clusterIP") == "None":
            headless.add((meta["namespace"], meta["name"]))
        elif spec.get("clusterIP"):
            found.append((spec["clusterIP"], base))
    for item in endpoints:
        meta = item["metadata"]
        if (meta["namespace"], meta["name"]) not in headless:
            continue
        base = f"{meta['name']}.{meta['namespace']}.svc.{DOMAIN}"
        for subset in item.get("subsets") or []:
            for address in subset.get("addresses") or []:
                found.append((address["ip"], base))
                if address.get("hostname"):
                    found.append((address["ip"], f"{address['hostname']}.{base}"))
    return sorted(found)


def _client(kubeconfig: Path):
    config = yaml.safe_load(kubeconfig.read_text())
    cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
    context = ssl.create_default_context(cafile=cluster["certificate-authority"])

    def get(path: str) -> list[dict]:
        request = urllib.request.Request(cluster["server"] + path, headers={"Authorization": f"Bearer {user['token']}"})
        with urllib.request.urlopen(request, context=context, timeout=10) as reply:
            return json.load(reply)["items"]

    return get


def sync(kubeconfig: Path, hosts_dir: Path) -> None:
    get = _client(kubeconfig)
    hosts, written = hosts_dir / "cluster.hosts", None
    while True:
        try:
            text = "".join(f"{ip} {name}\n" for ip, name in records(get("/api/v1/services"), get("/api/v1/endpoints")))
        except OSError as error:  # the API server restarting or not up yet: keep the last records
            print(f"dns: {error}", file=sys.stderr, flush=True)
            text = written
        if text != written:
            # Written aside and renamed: dnsmasq re-reads the file on the rename and never sees half of it.
            (hosts_dir / ".cluster.hosts").write_text(text)
            os.replace(hosts_dir / ".cluster.hosts", hosts)
            written = text
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    sync(Path(sys.argv[1]), Path(sys.argv[2]))
