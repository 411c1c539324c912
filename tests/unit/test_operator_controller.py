"""A job whose controller is an executor of its own (spec.roles.controller): its pods, their access to the job's
Lease, their probes, and how the operator finds the leader among them."""

from __future__ import annotations

import kubernetes_validate
import pytest

from conftest import make_job
from rlfleet.operator.apply import CREATE_ONLY
from rlfleet.operator.progress import controller_address
from rlfleet.operator.render import build_all, render_job
from rlfleet.operator.workload import build_statefulset, planned_command
from rlfleet.workers.controller.lease import LEASE_ENV
from rlfleet.workers.plan import ENDPOINTS_FILE_ENV, GRPC_PORT, METRICS_PORT, cluster_endpoints
from rlfleet.workers.spec import SpecError

KUBERNETES = ("1.30.0", "1.35.0")
ACCESS = ("ServiceAccount", "Lease", "Role", "RoleBinding")


def controlled_job(**spec):
    return make_job(roles={"controller": {}, **spec.pop("roles", {})}, **spec)


@pytest.mark.parametrize("version", KUBERNETES)
def test_a_controlled_jobs_objects_validate_strictly(version):
    objects = build_all(controlled_job())
    assert {o["kind"] for o in objects} >= set(ACCESS)
    assert "t-control" in {o["metadata"]["name"] for o in objects if o["kind"] == "StatefulSet"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_controller_pods_lead_by_the_jobs_lease_under_their_own_account():
    job = controlled_job()
    sts = build_statefulset(job, "control")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert (sts["spec"]["replicas"], sts["spec"]["podManagementPolicy"]) == (2, "Parallel")
    assert container["command"] == planned_command(job, "control")
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("t-controller", True)
    env = {e["name"]: e for e in container["env"]}
    assert env[LEASE_ENV]["value"] == "t-controller"
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The endpoints file the kubelet keeps current, as the trainer's was when it hosted the controller.
    assert env[ENDPOINTS_FILE_ENV]["value"] == "/etc/rlfleet/endpoints.json"
    assert ENDPOINTS_FILE_ENV not in {e["name"] for e in build_statefulset(job, "trainer")["spec"]["template"][
        "spec"]["containers"][0]["env"]}
    for role in ("trainer", "generator", "scorer"):
        other = build_statefulset(job, role)["spec"]["template"]["spec"]
        assert other["automountServiceAccountToken"] is False and "serviceAccountName" not in other
        assert LEASE_ENV not in {e["name"] for e in other["containers"][0]["env"]}


def test_controller_pods_may_take_and_renew_the_jobs_lease_and_nothing_else():
    access = {o["kind"]: o for o in build_all(controlled_job()) if o["kind"] in ACCESS}
    account, lease, role, binding = (access[kind] for kind in ACCESS)
    assert {o["metadata"]["name"] for o in (account, lease, role, binding)} == {"t-controller"}
    assert account["automountServiceAccountToken"] is False, "only pods that opt in get the token"
    # The job's own object (the handlers add the RLJob as its owner, so it goes with the job), without a holder,
    # created once and never patched back over its holder's writes.
    assert lease["spec"] == {} and lease["kind"] in CREATE_ONLY
    leases = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}
    assert role["rules"] == [leases | {"resourceNames": ["t-controller"], "verbs": ["get", "update"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "t-controller"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "t-controller", "namespace": "default"}]
    assert not [o for o in build_all(make_job()) if o["kind"] in ACCESS], "a job without controllers grants nothing"


def test_controller_pods_are_probed_where_a_standby_answers_too():
    """A standby serves gRPC only once it leads; never ready, it would hold the job Pending, and its startup probe
    would restart it. Its metrics server runs from the start."""
    job = controlled_job()
    container = build_statefulset(job, "control")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": METRICS_PORT}
    generator = build_statefulset(job, "generator")["spec"]["template"]["spec"]["containers"][0]
    assert generator["readinessProbe"]["grpc"] == {"port": GRPC_PORT}


class LeaseKube:
    """The one read controller_address makes: the job's Lease, or none."""

    def __init__(self, holder: str | None):
        self.holder, self.paths = holder, []

    async def get(self, path):
        self.paths.append(path)
        if self.holder is None:
            return None
        return {"metadata": {"name": "t-controller"}, "spec": {"holderIdentity": self.holder} if self.holder else {}}


@pytest.mark.parametrize("holder,address", [
    ("t-control-1", f"t-control-1.t-control.default.svc:{GRPC_PORT}"),
    ("t-control-0", f"t-control-0.t-control.default.svc:{GRPC_PORT}"),
    (None, f"t-control-0.t-control.default.svc:{GRPC_PORT}"),  # no Lease yet
    ("", f"t-control-0.t-control.default.svc:{GRPC_PORT}"),  # released
    ("t-control-2", f"t-control-0.t-control.default.svc:{GRPC_PORT}"),  # no such pod (of 2)
    ("other-control-1", f"t-control-0.t-control.default.svc:{GRPC_PORT}"),
])
async def test_the_operator_reads_progress_from_the_leases_holder(holder, address):
    kube = LeaseKube(holder)
    assert await controller_address(kube, controlled_job()) == address
    assert kube.paths == ["apis/coordination.k8s.io/v1/namespaces/default/leases/t-controller"]


async def test_without_controllers_of_its_own_progress_comes_from_trainer_rank_0():
    kube = LeaseKube("t-control-1")
    assert await controller_address(kube, make_job()) == cluster_endpoints(make_job()).controller
    assert kube.paths == [] and cluster_endpoints(make_job()).controller.startswith("t-trainer-0.")


def test_controller_pods_share_one_run_folder_on_the_claim_and_are_refused_without_one():
    job = controlled_job(storage={"checkpointClaim": "runs"})
    mounts = {role: next(m for m in build_statefulset(job, role)["spec"]["template"]["spec"]["containers"][0][
        "volumeMounts"] if m["name"] == "run") for role in ("control", "trainer")}
    assert mounts["control"]["subPath"] == "control" and "subPathExpr" not in mounts["control"]
    assert mounts["trainer"]["subPathExpr"] == "$(POD_NAME)"  # a folder of its own, as before
    with pytest.raises(SpecError) as refused:
        render_job(controlled_job())
    assert "spec.roles.controller:" in str(refused.value) and "spec.storage.checkpointClaim" in str(refused.value)
