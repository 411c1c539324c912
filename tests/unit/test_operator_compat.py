"""Older API servers: the operator builds what they accept and says what differs (found on a real 1.20 cluster:
its API server refused the generator and scorer StatefulSets, whose probes had lost their only handler)."""

from __future__ import annotations

import pytest

from rlfleet.operator.compat import FEATURES, GRPC_PROBES, PVC_RETENTION, Server, server_of
from rlfleet.operator.render import build_all
from rlfleet.operator.workload import build_statefulset
from rlfleet.workers.plan import GRPC_PORT

from conftest import make_job

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# Every handler a Kubernetes 1.20 probe may have (core/v1 Probe): exactly one must be set.
HANDLERS_1_20 = {"exec", "httpGet", "tcpSocket"}
OLD = Server((1, 20))


@pytest.mark.parametrize("reply, version", [
    ({"major": "1", "minor": "20", "gitVersion": "v1.20.2"}, (1, 20)),
    ({"major": "1", "minor": "27+", "gitVersion": "v1.27.3-eks"}, (1, 27)),
    (None, Server().version),
    ({"major": "", "minor": ""}, Server().version),
])
def test_server_version_from_the_version_reply(reply, version):
    assert server_of(reply).version == version


def test_a_current_server_gets_every_feature_and_no_notice():
    assert all(Server().has(feature) for feature in FEATURES) and Server().notices() == []
    assert build_all(make_job(), token="t" * 43) == build_all(make_job(), token="t" * 43, server=Server((1, 35)))


@pytest.mark.parametrize("role", ["generator", "scorer"])
def test_servers_without_grpc_probes_get_tcp_probes_on_the_grpc_port(role):
    container = build_statefulset(make_job(), role, server=OLD)["spec"]["template"]["spec"]["containers"][0]
    for name in PROBES:
        handlers = set(container[name]) & (HANDLERS_1_20 | {"grpc"})
        assert handlers == {"tcpSocket"} and container[name]["tcpSocket"] == {"port": GRPC_PORT}
    current = build_statefulset(make_job(), role)["spec"]["template"]["spec"]["containers"][0]
    assert {name: {k: v for k, v in current[name].items() if k != "grpc"} for name in PROBES} == \
        {name: {k: v for k, v in container[name].items() if k != "tcpSocket"} for name in PROBES}


def test_servers_without_pvc_retention_get_no_retention_policy():
    assert "persistentVolumeClaimRetentionPolicy" not in build_statefulset(make_job(), "trainer", server=OLD)["spec"]
    assert "persistentVolumeClaimRetentionPolicy" in build_statefulset(make_job(), "trainer")["spec"]


def test_every_missing_feature_is_one_notice_naming_the_version():
    notices = OLD.notices()
    assert len(notices) == len(FEATURES) and all(n.startswith("Kubernetes 1.20 lacks") for n in notices)
    assert len(Server((1, 24)).notices()) == 1 and PVC_RETENTION.name in Server((1, 24)).notices()[0]
    assert Server(GRPC_PROBES.since).has(GRPC_PROBES) and not Server((1, 23)).has(GRPC_PROBES)
