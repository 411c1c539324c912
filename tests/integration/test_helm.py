"""The chart lints strictly, renders for Kubernetes 1.30 and 1.35, and everything it renders validates."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helm_tool import CHART, REPO, helm, plain_manifests, template
from pod_security import pod_templates, restricted_violations

pytestmark = pytest.mark.integration
KUBERNETES = ("1.30.0", "1.35.0")
# Custom resources kubernetes-validate has no schema for; checked against their own CRDs or by shape below.
CUSTOM = {"ClusterKopfPeering", "ServiceMonitor"}
EVERYTHING = ("--set", "replicaCount=2", "--set", "serviceMonitor.enabled=true",
              "--set", "workers.storageClass=fast", "--set", "image.variant=cuda")


def test_lint_strict():
    result = helm("lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    result = helm("lint", "--strict", str(CHART), *EVERYTHING, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("values", [(), EVERYTHING], ids=["defaults", "everything"])
def test_rendered_objects_validate(version, values):
    docs = template(*values, kube_version=version)
    for doc in docs:
        if doc["kind"] not in CUSTOM:
            kubernetes_validate.validate(doc, version, strict=True)
    kinds = [doc["kind"] for doc in docs]
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
            "Service"} <= set(kinds)
    assert ("ServiceMonitor" in kinds) == bool(values)  # off by default


def test_chart_ships_the_generated_crd():
    crds = {doc["metadata"]["name"]: doc for doc in template() if doc["kind"] == "CustomResourceDefinition"}
    assert crds["rljobs.rlfleet.io"] == yaml.safe_load((REPO / "manifests" / "crd.yaml").read_text())


def test_peering_object_matches_its_crd():
    docs = template(*EVERYTHING)
    crd = next(d for d in docs if d["metadata"]["name"] == "clusterkopfpeerings.kopf.dev")
    peering = next(d for d in docs if d["kind"] == "ClusterKopfPeering")
    jsonschema.validate(peering, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert "--peering=rlfleet" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "ghcr.io/rlfleet/rlfleet:0.1.0-cuda"


def test_operator_deployment_is_hardened_and_probed():
    deployment = next(d for d in template() if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert "--peering=rlfleet" not in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert deployment["spec"]["template"]["metadata"]["labels"]["rlfleet.io/operator"] == "true"
    env = {e["name"]: e for e in container["env"]}
    assert env["RLFLEET_IMAGE"]["value"] == container["image"]
    assert env["RLFLEET_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


@pytest.mark.parametrize("values", [(), EVERYTHING], ids=["defaults", "everything"])
def test_chart_pods_meet_the_restricted_pod_security_standard(values):
    templates = pod_templates(template(*values))
    assert list(templates) == ["Deployment/rlfleet"]
    for name, pod in templates.items():
        assert restricted_violations(pod) == [], name


def test_rbac_has_no_wildcards():
    role = next(d for d in template() if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        for key in ("verbs", "resources", "apiGroups"):
            assert "*" not in rule[key], rule
    granted = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted[("apps", "statefulsets")] == {"get", "create", "patch"}
    # Token Secrets: created once and read, never patched, listed or watched.
    assert granted[("", "secrets")] == {"get", "create"}
    assert "delete" not in granted[("", "configmaps")]  # owned objects go by garbage collection


NAMESPACED = ("--set", "rbac.namespaces={team-a,team-b}")


def _grants(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    return {(group, resource): set(rule["verbs"]) for rule in rules
            for group in rule["apiGroups"] for resource in rule["resources"]}


@pytest.mark.parametrize("version", KUBERNETES)
def test_namespaced_rbac_grants_the_jobs_rights_only_in_the_listed_namespaces(version):
    cluster_wide = _grants(next(d for d in template() if d["kind"] == "ClusterRole")["rules"])
    docs = template(*NAMESPACED, kube_version=version)
    for doc in docs:
        if doc["kind"] not in CUSTOM:
            kubernetes_validate.validate(doc, version, strict=True)
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    # Cluster-wide, kopf only discovers the RLJob CRD: no pods, Secrets or anything of a job's.
    assert _grants(cluster_role["rules"]) == {("apiextensions.k8s.io", "customresourcedefinitions"):
                                              {"get", "list", "watch"}}
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    job_rights = {key: verbs for key, verbs in cluster_wide.items()
                  if key[1] not in ("customresourcedefinitions", "namespaces", "clusterkopfpeerings")}
    for namespace, role in roles.items():
        assert _grants(role["rules"]) == job_rights
        assert bindings[namespace]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                  "name": role["metadata"]["name"]}
        assert bindings[namespace]["subjects"][0]["namespace"] == "rlfleet-system"
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=team-a", "--namespace=team-b"]
    result = helm("template", "x", str(CHART), *NAMESPACED, "--set", "replicaCount=2", check=False)
    assert result.returncode != 0 and "replicaCount: 1" in result.stderr


def _policy(*values: str):
    from rlfleet.operator.config import OperatorConfig

    deployment = next(d for d in template(*values) if d["kind"] == "Deployment")
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
           if "value" in e}
    return OperatorConfig.from_env(env).policy


def test_the_pod_policy_values_reach_the_operator():
    from rlfleet.operator.policy import PodPolicy

    assert _policy() == PodPolicy()  # refuses every hostPath, hostNetwork and loader variable
    assert _policy("--set", "policy.hostPaths={/data,/mnt/models}", "--set", "policy.writableHostPaths=true",
                   "--set", "policy.hostNetwork=true", "--set", "policy.allowedEnv={LD_LIBRARY_PATH}") == PodPolicy(
        host_paths=("/data", "/mnt/models"), writable_host_paths=True, host_network=True,
        allowed_env=frozenset({"LD_LIBRARY_PATH"}))


def test_values_schema_refuses_bad_values():
    for bad in (["--set", "image.variant=rocm"], ["--set", "replicaCount=0"], ["--set", "bogus=1"],
                ["--set", "workers.shmSize=lots"], ["--set", "policy.hostPaths={data}"],
                ["--set", "rbac.namespaces={Team_A}"], ["--set", "policy.hostNetwork=yes"]):
        result = helm("template", "x", str(CHART), *bad, check=False)
        assert result.returncode != 0, bad
        assert "values don't meet the specifications" in result.stderr or "schema" in result.stderr.lower()


def test_every_value_is_documented():
    """helm-docs style: a `# --` comment right above every leaf key (sections only group them)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    schema = json.loads((CHART / "values.schema.json").read_text())

    def leaves(node: dict, prefix: str = "") -> list[str]:
        found = []
        for name, child in node.get("properties", {}).items():
            found += leaves(child, f"{prefix}{name}.") if "properties" in child else [prefix + name]
        return found

    for key in leaves(schema):
        indent = "  " * key.count(".")
        leaf = key.rsplit(".", 1)[-1]
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{indent}{leaf}:"))
        assert lines[index - 1].strip().startswith("# --"), f"values.yaml: {key} has no `# --` comment"


def test_plain_manifests_equal_the_chart():
    for name, text in plain_manifests().items():
        assert (REPO / "manifests" / name).read_text() == text, "run `python tests/helm_tool.py write-manifests`"
