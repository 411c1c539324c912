"""Create-or-patch decisions and ownership: pure parts of applying an object."""

from __future__ import annotations

import copy
import re

import pytest

from conftest import make_job
from rlfleet.operator.apply import NotOwned, apply, covers, owned, patch_ops, refuse_others
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.objects import build_network_policy, build_service, build_token_secret
from rlfleet.operator.workload import build_statefulset

OWNER = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "t", "uid": "u-1"}}


def live_copy(obj: dict) -> dict:
    """What the API server would hand back: our object plus server-side fields."""
    live = copy.deepcopy(obj)
    live["metadata"] |= {"uid": "x", "resourceVersion": "9", "labels": obj["metadata"]["labels"] | {"team": "a"}}
    if "annotations" in obj["metadata"]:
        live["metadata"]["annotations"] = obj["metadata"]["annotations"] | {"deployed-by": "ci"}
    live.setdefault("spec", {})["revisionHistoryLimit"] = 10
    live["status"] = {"replicas": 1}
    return live


def test_nothing_to_patch_when_live_already_holds_everything():
    sts = owned(build_statefulset(make_job(), "generator"), OWNER)
    assert patch_ops(sts, live_copy(sts)) == []
    assert covers({"a": 1, "b": [{"c": 1, "d": 2}]}, {"b": [{"c": 1}]})
    assert not covers({"b": [{"c": 1}, {"c": 2}]}, {"b": [{"c": 1}]})


def test_changed_parts_are_replaced_whole():
    old = owned(build_statefulset(make_job(roles={"generator": {"nodeSelector": {"zone": "a"}}}), "generator"), OWNER)
    new = owned(build_statefulset(make_job(roles={"generator": {"replicas": 3}}), "generator"), OWNER)
    ops = patch_ops(new, live_copy(old))
    paths = {op["path"]: op["value"] for op in ops}
    assert paths["/spec/replicas"] == 3
    # Replacing the template drops the nodeSelector the job no longer has (a merge patch would keep it).
    assert "nodeSelector" not in paths["/spec/template"]["spec"]
    assert all(op["op"] == "add" for op in ops)
    # The replicas written with them, key by key: another's annotation on the live object stays.
    assert paths["/metadata/annotations/rlfleet.io~1replicas"] == "3"
    annotated = live_copy(old)
    del annotated["metadata"]["annotations"]
    assert {"op": "add", "path": "/metadata/annotations", "value": {"rlfleet.io/replicas": "3"}} in patch_ops(
        new, annotated)


def test_immutable_fields_are_never_patched():
    old = build_statefulset(make_job(), "trainer")
    new = copy.deepcopy(old)
    new["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] = "99Gi"
    new["spec"]["selector"] = {"matchLabels": {"x": "y"}}
    assert patch_ops(new, live_copy(old)) == []
    service = build_service(make_job(), "trainer")
    live = live_copy(service)
    live["spec"]["clusterIP"] = "None"
    assert patch_ops(service, live) == []


def test_owned_objects_point_at_their_job_as_controller():
    obj = owned(build_service(make_job(), "scorer"), OWNER)
    (reference,) = obj["metadata"]["ownerReferences"]
    assert reference == {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob", "name": "t", "uid": "u-1",
                         "controller": True, "blockOwnerDeletion": True}


class OneObjectKube:
    """The API calls apply() makes, against one stored object."""

    def __init__(self, live: dict | None = None):
        self.live, self.writes = live, []

    async def get(self, path):
        return copy.deepcopy(self.live)

    async def create(self, collection, obj):
        self.writes.append(("create", obj))
        self.live = obj

    async def json_patch(self, path, ops):
        self.writes.append(("patch", ops))


async def test_the_token_secret_is_created_once_and_never_rotated():
    kube = OneObjectKube()
    first = owned(build_token_secret(make_job(), "first-token"), OWNER)
    assert (await apply(kube, first)).action == "created"
    # Every later reconcile builds a new random token: the live Secret, and the workers' token, stay.
    other = owned(build_token_secret(make_job(), "second-token"), OWNER)
    assert (await apply(kube, other)).action == "unchanged"
    assert kube.writes == [("create", first)]


def _held_by(obj: dict, references: list[dict] | None) -> dict:
    """obj as someone else left it: the same name, their owners (or none), their content."""
    live = copy.deepcopy(obj)
    live["metadata"].pop("ownerReferences")
    if references is not None:
        live["metadata"]["ownerReferences"] = references
    live["spec"] = {"podSelector": {}, "policyTypes": ["Ingress"]}
    return live


OTHER_JOB = {"apiVersion": "rlfleet.io/v1alpha1", "kind": "RLJob", "name": "t", "uid": "u-old", "controller": True}


@pytest.mark.parametrize("references, holder", [
    (None, "no owner"),
    ([{"apiVersion": "apps/v1", "kind": "Deployment", "name": "policy-bot", "uid": "d-1", "controller": True}],
     "Deployment policy-bot (uid d-1)"),
    ([OTHER_JOB], "RLJob t (uid u-old)"),
])
async def test_an_object_another_owner_controls_is_neither_patched_nor_adopted(references, holder):
    desired = owned(build_network_policy(make_job(), OperatorConfig()), OWNER)
    kube = OneObjectKube(_held_by(desired, references))
    with pytest.raises(NotOwned, match=rf"NetworkPolicy t exists and is controlled by {re.escape(holder)}"):
        await apply(kube, desired)
    with pytest.raises(NotOwned, match=re.escape(holder)):
        await refuse_others(kube, [desired])
    assert kube.writes == []


async def test_the_jobs_own_objects_pass_the_check():
    desired = owned(build_network_policy(make_job(), OperatorConfig()), OWNER)
    await refuse_others(OneObjectKube(live_copy(desired)), [desired])
    await refuse_others(OneObjectKube(None), [desired])
