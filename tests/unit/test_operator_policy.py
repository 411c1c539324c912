"""The operator's pod policy (Helm values policy.*): what a job may ask of the node unless the cluster admin allows
it, and the reconcile handler refusing such a job with nothing created."""

from __future__ import annotations

import kopf
import pytest

from conftest import make_job
from rlfleet.operator import handlers
from rlfleet.operator.assess import REFUSED_BY_POLICY, Observed, assess
from rlfleet.operator.compat import Server
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.policy import PodPolicy


def _volume(host_path: str, read_only: bool = True) -> dict:
    return {"storage": {"volumes": [{"name": "models", "mountPath": "/models", "hostPath": host_path,
                                     "readOnly": read_only}]}}


@pytest.mark.parametrize("spec, field", [
    (_volume("/data/models"), "spec.storage.volumes[0].hostPath"),
    ({"roles": {"generator": {"hostNetwork": True}}}, "spec.roles.generator.hostNetwork"),
    ({"roles": {"trainer": {"env": {"LD_PRELOAD": "/tmp/x.so"}}}}, "spec.roles.trainer.env.LD_PRELOAD"),
    ({"roles": {"scorer": {"env": {"PYTHONPATH": "/models"}}}}, "spec.roles.scorer.env.PYTHONPATH"),
])
def test_the_default_policy_refuses_what_reaches_the_node_naming_the_field(spec, field):
    (problem,) = PodPolicy().problems(make_job(**spec))
    assert problem.startswith(f"{field}: ") and "Helm value policy." in problem


def test_a_plain_job_and_ordinary_variables_pass():
    job = make_job(roles={"trainer": {"env": {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"}}})
    assert PodPolicy().problems(job) == []


@pytest.mark.parametrize("path, allowed", [("/data", True), ("/data/models", True), ("/data/../etc", False),
                                           ("/data2", False), ("/", False), ("/etc", False)])
def test_host_paths_are_allowed_by_whole_segments_under_the_list(path, allowed):
    assert PodPolicy(host_paths=("/data",)).allows_host_path(path) is allowed
    assert (PodPolicy(host_paths=("/data",)).problems(make_job(**_volume(path))) == []) is allowed


def test_a_writable_host_path_needs_its_own_allowance():
    job = make_job(**_volume("/data/out", read_only=False))
    (problem,) = PodPolicy(host_paths=("/data",)).problems(job)
    assert problem.startswith("spec.storage.volumes[0].readOnly: a writable hostPath is refused")
    assert PodPolicy(host_paths=("/data",), writable_host_paths=True).problems(job) == []


def test_what_the_admin_allows_passes():
    job = make_job(roles={"generator": {"hostNetwork": True, "env": {"LD_LIBRARY_PATH": "/opt/ib"}}})
    assert len(PodPolicy().problems(job)) == 2
    assert PodPolicy(host_network=True, allowed_env=frozenset({"LD_LIBRARY_PATH"})).problems(job) == []


def test_the_policy_is_read_from_the_deployments_environment():
    config = OperatorConfig.from_env({"RLFLEET_POLICY_HOST_PATHS": "/data, /mnt/models", "RLFLEET_POLICY_HOST_NETWORK":
                                      "true", "RLFLEET_POLICY_ALLOWED_ENV": "LD_PRELOAD", "RLFLEET_SHM_SIZE": "1Gi"})
    assert config.policy == PodPolicy(host_paths=("/data", "/mnt/models"), host_network=True,
                                      allowed_env=frozenset({"LD_PRELOAD"}))
    assert config.shm_size == "1Gi"
    assert OperatorConfig.from_env({}).policy == PodPolicy()


class NoApi:
    """A refused job must not reach the API at all."""

    def __getattr__(self, name):
        raise AssertionError(f"the API was called ({name}) for a refused job")


async def test_reconcile_refuses_the_job_with_a_condition_and_creates_nothing(monkeypatch):
    warnings = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warnings.append((reason, message)))
    document = make_job(roles={"generator": {"hostNetwork": True}}).to_dict()
    body = kopf.Body({"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob", "spec": document["spec"],
                      "metadata": {"name": "t", "namespace": "default", "uid": "u", "generation": 1}})
    patch = kopf.Patch()
    with pytest.raises(kopf.PermanentError, match="spec.roles.generator.hostNetwork"):
        await handlers.reconcile(body=body, status=body.status, patch=patch,
                                 memo=kopf.Memo(kube=NoApi(), config=OperatorConfig(), server=Server()),
                                 logger=None)
    (condition,) = patch["status"]["conditions"]
    assert (patch["status"]["phase"], condition["reason"]) == ("Failed", REFUSED_BY_POLICY)
    assert [reason for reason, _ in warnings] == [REFUSED_BY_POLICY]
    # The status timer leaves the refusal standing (no StatefulSet exists to say anything else).
    later = assess(make_job(), dict(patch["status"]), Observed({}, []), "2026-01-01T00:00:00Z", 1)
    assert "phase" not in later.status and "conditions" not in later.status
