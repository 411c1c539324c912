"""What the operator uses that older API servers lack, decided from the server's version when it starts.

The default `Server()` is any cluster the product targets (1.30+): the objects are then exactly what
`rlfleet render` prints. An older server gets a fallback where one keeps the job working, and a logged
notice for every difference either way (docs/kubernetes.md: "Older clusters").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Feature:
    name: str
    since: tuple[int, int]
    """The first Kubernetes minor version that has it on by default."""
    without: str
    """What changes on an older server: the notice the operator logs."""


GRPC_PROBES = Feature(
    "gRPC probes", (1, 24),
    "older servers drop the probes' grpc field and refuse the StatefulSet (a probe without a handler): "
    "generators and scorers get TCP probes on the same port instead (ready once the gRPC server listens)")
PVC_RETENTION = Feature(
    "StatefulSet persistentVolumeClaimRetentionPolicy", (1, 27),
    "not set: trainer volumes outlive their job; delete them with "
    "`kubectl delete pvc -l rlfleet.io/job=NAME` after `kubectl delete rlj NAME`")
NAMESPACE_NAME_LABEL = Feature(
    "the kubernetes.io/metadata.name namespace label", (1, 21),
    "namespaces lack it, so where NetworkPolicies are enforced a job's policy admits no operator pod: label the "
    "operator's namespace with kubernetes.io/metadata.name=<its name>")
FEATURES = (GRPC_PROBES, PVC_RETENTION, NAMESPACE_NAME_LABEL)


@dataclass(frozen=True)
class Server:
    version: tuple[int, int] = (1, 30)
    """(major, minor) of the API server."""

    def has(self, feature: Feature) -> bool:
        return self.version >= feature.since

    def notices(self) -> list[str]:
        major, minor = self.version
        return [f"Kubernetes {major}.{minor} lacks {f.name} ({f.since[0]}.{f.since[1]}+): {f.without}"
                for f in FEATURES if not self.has(f)]


def server_of(version: dict[str, Any] | None) -> Server:
    """From the API's /version reply; None (no reply) is taken for a current server. Providers append to the
    minor version ("27+"): only its digits count."""
    major, minor = (re.match(r"\d*", str((version or {}).get(key, ""))).group() for key in ("major", "minor"))
    return Server((int(major), int(minor))) if major and minor else Server()
