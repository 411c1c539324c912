"""The operator against an API server that reports Kubernetes 1.20 (KMock): it builds what that server accepts
and logs what differs. On the real 1.20 cluster the generator and scorer StatefulSets were refused until it did."""

from __future__ import annotations

import pytest

from kmock_cluster import JOBS, Api, Operator, eventually, prepare, rljob

pytestmark = pytest.mark.integration
STS = "apps/v1/statefulsets"


async def test_operator_on_a_1_20_server_uses_tcp_probes_and_says_so(kmock, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(prepare(kmock, tmp_path, minor=20)))
    api = Api(kmock)
    async with Operator() as operator:
        await api.create(JOBS, rljob("old", {"roles": {"generator": {"engine": "torch"}}}))
        generator = await eventually(lambda: api.get(STS, "old-generator"), what="generator StatefulSet")
        trainer = await eventually(lambda: api.get(STS, "old-trainer"), what="trainer StatefulSet")
    probe = generator["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert "tcpSocket" in probe and "grpc" not in probe
    assert "persistentVolumeClaimRetentionPolicy" not in trainer["spec"]
    assert "Kubernetes 1.20 lacks gRPC probes" in operator.output
