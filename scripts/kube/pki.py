"""Certificates, static tokens and kubeconfigs of the one-node cluster (openssl; made fresh at every start)."""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import yaml

# Identities the API server knows from its token file: (user, groups). Admin is the tests' and kubectl's.
IDENTITIES = {
    "admin": ("admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", ""),
    "scheduler": ("system:kube-scheduler", ""),
    "kube-proxy": ("system:kube-proxy", ""),
}
DAYS = "30"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _leaf(pki: Path, name: str, subject: str, extensions: str) -> None:
    """name.key and name.crt signed by the cluster's CA."""
    (pki / f"{name}.ext").write_text(extensions)
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", subject,
             "-out", f"{name}.csr", cwd=pki)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", DAYS, "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=pki)


def make_pki(pki: Path, node_ip: str, service_ip: str) -> None:
    """CA, API serving certificate, the API server's client certificate for kubelets, service-account keys."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-subj", "/CN=rlfleet-kube-ca",
             "-days", DAYS, "-out", "ca.crt", cwd=pki)
    names = ",".join(f"DNS:{n}" for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                           "kubernetes.default.svc.cluster.local"))
    _leaf(pki, "apiserver", "/CN=kube-apiserver",
          f"subjectAltName={names},IP:127.0.0.1,IP:{node_ip},IP:{service_ip}\nextendedKeyUsage=serverAuth\n")
    _leaf(pki, "kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
          "extendedKeyUsage=clientAuth\n")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def make_tokens(pki: Path, node: str) -> dict[str, str]:
    """The API server's static token file; returns identity -> token (the kubelet's is `kubelet`)."""
    identities = IDENTITIES | {"kubelet": (f"system:node:{node}", "system:nodes")}
    tokens = {name: secrets.token_hex(16) for name in identities}
    lines = [f'{tokens[name]},{user},{user},"{groups}"' for name, (user, groups) in identities.items()]
    (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
    return tokens


def admin_token(pki: Path) -> str:
    return next(line.split(",")[0] for line in (pki / "tokens.csv").read_text().splitlines() if ",admin," in line)


def kubeconfig(path: Path, server: str, ca: Path, token: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rlfleet",
        "clusters": [{"name": "rlfleet", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "rlfleet", "user": {"token": token}}],
        "contexts": [{"name": "rlfleet", "context": {"cluster": "rlfleet", "user": "rlfleet"}}],
    }))
    path.chmod(0o600)
    return path
