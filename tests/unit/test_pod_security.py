"""Every pod `rlfleet render` produces meets the "restricted" Pod Security Standard (the chart's operator pod is
checked in tests/integration/test_helm.py), and the checker itself catches each rule it enforces."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from pod_security import pod_templates, restricted_violations
from runs import on_a_claim
from rlfleet.workers.cli import main
from rlfleet.workers.generator.pools import generator_pools
from rlfleet.workers.plan import job_roles
from rlfleet.workers.spec import load_job

EXAMPLES = sorted(Path(__file__).resolve().parents[2].glob("manifests/examples/*.yaml"))


def rendered(path: Path, capsys) -> list[dict]:
    assert main(["render", str(path)]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_rendered_pods_meet_the_restricted_standard(example, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(example.parents[2])  # the examples' relative paths (reward files) are from the repository
    templates = pod_templates(rendered(on_a_claim(example, tmp_path), capsys))
    job = load_job(str(example))
    sets = len(job_roles(job)) - 1 + len(generator_pools(job.spec))  # one per role, the generators' per pool
    assert [name.split("/")[0] for name in templates] == ["StatefulSet"] * sets
    for name, template in templates.items():
        assert restricted_violations(template) == [], name


def _worker_pod(capsys) -> dict:
    return next(iter(pod_templates(rendered(EXAMPLES[0], capsys)).values()))


BREAKS = {
    "hostNetwork": lambda pod, c: pod.update(hostNetwork=True),
    "hostPID": lambda pod, c: pod.update(hostPID=True),
    "hostIPC": lambda pod, c: pod.update(hostIPC=True),
    "hostPath volume": lambda pod, c: pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "nfs volume": lambda pod, c: pod["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
    "privileged": lambda pod, c: c["securityContext"].update(privileged=True),
    "escalation allowed": lambda pod, c: c["securityContext"].update(allowPrivilegeEscalation=True),
    "escalation unset": lambda pod, c: c["securityContext"].pop("allowPrivilegeEscalation"),
    "root container": lambda pod, c: c["securityContext"].update(runAsNonRoot=False),
    "non-root unset": lambda pod, c: pod["securityContext"].pop("runAsNonRoot"),
    "uid 0 pod": lambda pod, c: pod["securityContext"].update(runAsUser=0),
    "uid 0 container": lambda pod, c: c["securityContext"].update(runAsUser=0),
    "no seccomp": lambda pod, c: pod["securityContext"].pop("seccompProfile"),
    "unconfined container": lambda pod, c: c["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    "capabilities kept": lambda pod, c: c["securityContext"].pop("capabilities"),
    "capability added": lambda pod, c: c["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
    "hostPort": lambda pod, c: c["ports"][0].update(hostPort=8080),
    "unsafe sysctl": lambda pod, c: pod["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "procMount": lambda pod, c: c["securityContext"].update(procMount="Unmasked"),
    "SELinux user": lambda pod, c: c["securityContext"].update(seLinuxOptions={"user": "root"}),
    "AppArmor unconfined": lambda pod, c: pod["securityContext"].update(appArmorProfile={"type": "Unconfined"}),
    "privileged init container": lambda pod, c: pod.setdefault("initContainers", []).append(
        {"name": "init", "image": "x", "securityContext": {"privileged": True}}),
}


@pytest.mark.parametrize("rule", list(BREAKS))
def test_the_checker_catches_each_broken_rule(rule, capsys):
    template = copy.deepcopy(_worker_pod(capsys))
    pod = template["spec"]
    BREAKS[rule](pod, pod["containers"][0])
    assert restricted_violations(template), f"{rule} was not caught"


def test_capability_net_bind_service_and_localhost_seccomp_are_allowed(capsys):
    template = copy.deepcopy(_worker_pod(capsys))
    context = template["spec"]["containers"][0]["securityContext"]
    context["capabilities"]["add"] = ["NET_BIND_SERVICE"]
    context["seccompProfile"] = {"type": "Localhost", "localhostProfile": "profiles/rlfleet.json"}
    assert restricted_violations(template) == []


def test_environment_pods_may_run_under_the_nodes_own_profiles_for_the_sandbox():
    from conftest import make_job
    from rlfleet.operator.render import build_all

    job = make_job(roles={"environment": {"type": "tools", "seccompProfile": "rlfleet/sandbox.json",
                                          "appArmorProfile": "rlfleet-sandbox"}})
    templates = {o["metadata"]["name"]: o["spec"]["template"] for o in build_all(job) if o["kind"] == "StatefulSet"}
    context = templates["t-env"]["spec"]["securityContext"]
    assert context["seccompProfile"] == {"type": "Localhost", "localhostProfile": "rlfleet/sandbox.json"}
    assert context["appArmorProfile"] == {"type": "Localhost", "localhostProfile": "rlfleet-sandbox"}
    assert templates["t-generator"]["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert all(restricted_violations(template) == [] for template in templates.values())
