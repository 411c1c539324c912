"""The CRD is generated from the pydantic spec, structural, valid, and committed exactly as generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rlfleet.operator.crd import OUTPUTS, build_crd, crd_yaml, job_schema, main
from rlfleet.workers.spec import SpecError, parse_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
# JSON Schema keywords Kubernetes rejects or a structural schema may not carry.
FORBIDDEN = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "const", "default", "title", "discriminator"}


def test_committed_copies_equal_the_generators_output():
    text = crd_yaml()
    assert OUTPUTS[0] == REPO / "manifests" / "crd.yaml"
    assert OUTPUTS[1] == REPO / "charts" / "rlfleet" / "crds" / "rljobs.yaml"
    for path in OUTPUTS:
        assert path.read_text() == text, f"{path} is stale: run `python -m rlfleet.operator.crd`"
    assert main(["--check"]) == 0


@pytest.mark.parametrize("version", ["1.30.0", "1.35.0"])
def test_crd_validates(version):
    kubernetes_validate.validate(build_crd(), version, strict=True)


def test_crd_names_subresource_and_columns():
    spec = build_crd()["spec"]
    assert build_crd()["metadata"]["name"] == "rljobs.rlfleet.io"
    assert spec["names"]["shortNames"] == ["rlj"]
    version = spec["versions"][0]
    assert set(version["subresources"]) == {"status", "scale"}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:4] == ["Phase", "Step", "Reward", "Ready"] and columns[-1] == "Age"


def test_the_scale_subresource_points_at_the_generators_replicas_in_the_schema():
    """`kubectl scale rlj` reads and writes these paths: each must be a field of the schema, of its type."""
    version = build_crd()["spec"]["versions"][0]
    scale, schema = version["subresources"]["scale"], version["schema"]["openAPIV3Schema"]

    def field(path: str) -> dict[str, Any]:
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part] if "properties" in node else node["additionalProperties"]
        return node

    assert scale["specReplicasPath"] == ".spec.roles.generator.replicas"
    assert field(scale["specReplicasPath"])["type"] == "integer"
    assert field(scale["statusReplicasPath"])["type"] == "integer"
    assert field(scale["labelSelectorPath"])["type"] == "string"


def test_schema_is_structural():
    def walk(node: dict[str, Any], path: str) -> None:
        assert not FORBIDDEN & node.keys(), f"{path}: {FORBIDDEN & node.keys()}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert not isinstance(node.get("additionalProperties"), bool), path
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], f"{path}[{key}]")

    walk(job_schema(), "<root>")


def test_unions_are_one_object_with_every_variants_fields():
    model = job_schema()["properties"]["spec"]["properties"]["model"]
    assert model["properties"]["type"]["enum"] == ["tiny", "hf", "smollm2"]
    assert {"hiddenSize", "path", "dtype"} <= model["properties"].keys()
    assert model["required"] == ["type"]


def openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI 3.0's `nullable` and boolean exclusive bounds, as JSON Schema draft 4 understands them."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: openapi_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_pass_the_crd_schema(path):
    document = yaml.safe_load(path.read_text())
    jsonschema.Draft4Validator(openapi_to_jsonschema(job_schema())).validate(document)


def test_the_crd_refuses_what_pydantic_refuses_first_line():
    bad = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
           "spec": {"algorithm": {"maxStaleness": -1}, "model": {"type": "giant"}}}
    errors = list(jsonschema.Draft4Validator(openapi_to_jsonschema(job_schema())).iter_errors(bad))
    assert len(errors) == 2
    with pytest.raises(SpecError):
        parse_job(bad)
