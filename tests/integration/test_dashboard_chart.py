"""The chart ships the dashboard as a ConfigMap Grafana's sidecar picks up, and scrapes every role."""

from __future__ import annotations

import json

import pytest

from helm_tool import CHART, template

pytestmark = pytest.mark.integration


def test_dashboard_configmap_carries_the_json_file():
    maps = [d for d in template() if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    assert len(maps) == 1
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(maps[0]["data"]["rlfleet.json"]) == json.loads((CHART / "dashboards" / "rlfleet.json").read_text())


def test_dashboard_can_go_to_grafanas_namespace_or_be_left_out():
    moved = template("--set", "dashboards.namespace=monitoring")
    assert next(d for d in moved if d["kind"] == "ConfigMap")["metadata"]["namespace"] == "monitoring"
    assert not [d for d in template("--set", "dashboards.enabled=false") if d["kind"] == "ConfigMap"]


def test_worker_servicemonitor_scrapes_every_role_keeping_the_workers_labels():
    """Every role's headless Service carries the operator's managed-by label and a port named `metrics`."""
    from rlfleet.operator.objects import build_service
    from rlfleet.workers.plan import ROLES
    from rlfleet.workers.spec import parse_job

    monitor = next(d for d in template("--set", "serviceMonitor.enabled=true")
                   if d["kind"] == "ServiceMonitor" and d["metadata"]["name"].endswith("-workers"))
    wanted = monitor["spec"]["selector"]["matchLabels"]
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["honorLabels"] is True and monitor["spec"]["namespaceSelector"] == {"any": True}
    job = parse_job({"metadata": {"name": "t"}, "spec": {}})
    for role in ROLES:
        service = build_service(job, role)
        assert wanted.items() <= service["metadata"]["labels"].items(), role
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}, role
