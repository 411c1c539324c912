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


MODELS = {"name": "models", "claim": "weights", "mountPath": "/models", "roles": ["generator", "trainer"]}
DATA = {"name": "data", "claim": "rl-data", "mountPath": "/data", "roles": ["trainer"]}


def _job_file(tmp_path, model: dict, data: dict, volumes: list[dict]) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"metadata": {"name": "own"}, "spec": {
        "model": model, "data": data, "storage": {"volumes": volumes}}}))
    return str(path)


@pytest.mark.parametrize("model, data, volumes, refused", [
    ({"type": "hf", "path": "/models/m"}, {"type": "jsonl", "path": "/tmp/train.jsonl"}, [MODELS, DATA],
     "spec.data.path: '/tmp/train.jsonl' lies on no volume the trainer pods mount (their spec.storage.volumes: "
     "/models, /data): put it on a volume mounted for the trainer, or name it by spec.data.uri"),
    ({"type": "hf", "path": "/models/m"}, {"type": "jsonl", "path": "data/train.jsonl"}, [MODELS, DATA],
     "spec.data.path: 'data/train.jsonl' lies on no volume"),
    ({"type": "hf", "path": "/data/m"}, {"type": "jsonl", "path": "/data/train.jsonl"}, [DATA],
     "spec.model.path: '/data/m' lies on no volume the generator pods mount (their spec.storage.volumes: none)"),
    ({"type": "hf", "path": "/models/../etc/m"}, {"type": "arithmetic"}, [MODELS],
     "spec.model.path: '/models/../etc/m' lies on no volume the generator pods mount"),
    ({"type": "hf", "path": "/modelsx/m"}, {"type": "arithmetic"}, [MODELS], "spec.model.path: '/modelsx/m'"),
])
def test_render_refuses_a_path_on_no_mounted_volume_naming_the_field_and_mounts(tmp_path, model, data, volumes,
                                                                                 refused):
    with pytest.raises(SystemExit) as exited:
        main(["render", _job_file(tmp_path, model, data, volumes)])
    assert refused in str(exited.value)


@pytest.mark.parametrize("model, data, volumes", [
    ({"type": "hf", "path": "/models/m"}, {"type": "jsonl", "path": "/data/train.parquet"}, [MODELS, DATA]),
    ({"type": "hf", "path": "/models"}, {"type": "jsonl", "path": "/data/sub/../train.jsonl"}, [MODELS, DATA]),
    ({"type": "hf", "uri": "hf://owner/model"}, {"type": "jsonl", "uri": "s3://bucket/train.jsonl"}, []),
    ({"type": "tiny"}, {"type": "arithmetic"}, []),
    ({"type": "smollm2"}, {"type": "arithmetic"}, []),
])
def test_render_takes_paths_on_volumes_uris_and_built_in_models(tmp_path, capsys, model, data, volumes):
    assert main(["render", _job_file(tmp_path, model, data, volumes)]) == 0
    assert "kind: StatefulSet" in capsys.readouterr().out


async def test_the_operator_refuses_a_path_on_no_mounted_volume(monkeypatch):
    from rlfleet.operator import handlers
    from rlfleet.operator.compat import Server
    from rlfleet.operator.config import OperatorConfig

    warnings = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warnings.append((reason, message)))
    body = kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob",
                      "metadata": {"name": "own", "namespace": "default", "uid": "u", "generation": 1},
                      "spec": {"data": {"type": "jsonl", "path": "/tmp/train.jsonl"}}})
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="InvalidSpec: spec.data.path: '/tmp/train.jsonl' lies on no volume"):
        await handlers.reconcile(body=body, status=body.status, patch=patch,
                                 memo=kopf.Memo(kube=None, config=OperatorConfig(), server=Server()),
                                 logger=logging.getLogger("test"))
    [condition] = patch.status["conditions"]
    assert (patch.status["phase"], condition["reason"]) == ("Failed", "InvalidSpec")
    assert condition["message"].startswith("spec.data.path: '/tmp/train.jsonl' lies on no volume the trainer pods")
    [(reason, message)] = warnings
    assert reason == "InvalidSpec" and message == condition["message"]
