"""`rlfleet render`, `python -m rlfleet.operator` and the handlers' parsing: thin entry points over the builders."""

from __future__ import annotations

import logging
from pathlib import Path

import kopf
import pytest
import yaml

from rlfleet.operator.objects import secret_token
from rlfleet.operator.render import build_all
from rlfleet.workers.cli import main
from rlfleet.workers.spec import SpecError, load_job

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-local.yaml"


def test_render_prints_what_the_operator_creates(capsys):
    assert main(["render", str(EXAMPLE)]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    # The same objects, the token Secret holding a new random token.
    token = secret_token(printed[1])
    assert printed == build_all(load_job(str(EXAMPLE)), token=token)
    assert [o["kind"] for o in printed] == ["ConfigMap", "Secret"] + ["Service"] * 3 + ["StatefulSet"] * 3 + [
        "NetworkPolicy"]
    assert printed[1]["metadata"]["name"] == "tiny-local-token" and len(token) >= 32
    for sts in printed[5:8]:
        pod = sts["spec"]["template"]["spec"]
        assert {"name": "token", "secret": {"secretName": "tiny-local-token", "defaultMode": 0o440,
                                            "items": [{"key": "token", "path": "token"}]}} in pod["volumes"]
        assert {"name": "token", "mountPath": "/var/run/secrets/rlfleet", "readOnly": True} in \
            pod["containers"][0]["volumeMounts"]


def test_render_overrides_namespace_and_image(capsys):
    assert main(["render", str(EXAMPLE), "--namespace", "research", "--image", "registry.local/rlfleet:dev"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {o["metadata"]["namespace"] for o in printed} == {"research"}
    images = {o["spec"]["template"]["spec"]["containers"][0]["image"] for o in printed if o["kind"] == "StatefulSet"}
    assert images == {"registry.local/rlfleet:dev"}
    assert '"namespace": "research"' in printed[0]["data"]["job.json"]


def test_render_refuses_an_invalid_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("metadata: {name: x}\nspec: {algorithm: {maxStaleness: -1}}\n")
    with pytest.raises(SystemExit) as exited:
        main(["render", str(bad)])
    assert "spec.algorithm.maxStaleness" in str(exited.value)


def test_handlers_parse_the_live_object_with_pydantic():
    from rlfleet.operator.handlers import load

    body = kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
                      "metadata": {"name": "j", "namespace": "ns", "uid": "u", "managedFields": [{}],
                                   "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
                      "spec": {"algorithm": {"loss": {"type": "aipo", "rho": 2}}}, "status": {"phase": "Running"}})
    job = load(body)
    assert (job.metadata.name, job.metadata.namespace, job.spec.algorithm.loss.rho) == ("j", "ns", 2.0)
    with pytest.raises(SpecError):
        load(kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
                        "metadata": {"name": "j", "namespace": "ns"}, "spec": {"bogus": 1}}))


def test_operator_entry_point_runs_kopf_cluster_wide(monkeypatch):
    from rlfleet.operator.__main__ import main as operator_main

    calls = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert operator_main(["--peering", "rlfleet"]) == 0
        assert operator_main([]) == 0
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    assert calls[0]["clusterwide"] is True and calls[0]["peering_name"] == "rlfleet"
    assert calls[0]["standalone"] is False and calls[1]["standalone"] is True
