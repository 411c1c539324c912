"""The kopf operator against KMock (a Kubernetes API emulator): what it creates, patches, scales and refuses.

KMock runs no controllers: StatefulSets never get pods here, so tests write pod and StatefulSet statuses
themselves where the operator should react to them.
"""

from __future__ import annotations

import asyncio
import json

import kmock as km
import pytest
from bad_jobs import kubernetes_objects

from rlfleet.operator.objects import secret_token
from kmock_cluster import JOBS, NAMESPACE, Api, Operator, eventually, prepare, rljob

pytestmark = pytest.mark.integration

STS = "apps/v1/statefulsets"
STS_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets"
SMALL = {"roles": {"generator": {"replicas": 1, "engine": "torch"}}}


@pytest.fixture
def api(kmock, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(prepare(kmock, tmp_path)))
    return Api(kmock)


def status(api: Api, name: str) -> dict:
    return (api.get("rlfleet.io/v1alpha1/rljobs", name) or {}).get("status") or {}


async def all_created(api: Api, name: str) -> None:
    """The NetworkPolicy is created last."""
    await eventually(lambda: api.get("networking.k8s.io/v1/networkpolicies", name), what=f"{name}'s objects")


def ready_condition(api: Api, name: str) -> dict:
    return next((c for c in status(api, name).get("conditions", []) if c["type"] == "Ready"), {})


async def test_valid_job_gets_every_object_owned_and_a_status(api):
    # Created before the operator starts: replayed, so the handlers run twice and must be idempotent.
    api.kmock.objects["rlfleet.io/v1alpha1/rljobs", NAMESPACE, "alpha"] = rljob("alpha", SMALL)
    async with Operator():
        await eventually(lambda: api.get("networking.k8s.io/v1/networkpolicies", "alpha"), what="NetworkPolicy")
        for resource, name in [("v1/configmaps", "alpha-config"), ("v1/secrets", "alpha-token"),
                               ("v1/services", "alpha-trainer"),
                               ("v1/services", "alpha-generator"), ("v1/services", "alpha-scorer"),
                               (STS, "alpha-trainer"), (STS, "alpha-generator"), (STS, "alpha-scorer")]:
            obj = await eventually(lambda: api.get(resource, name), what=name)
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-alpha"
        await eventually(lambda: status(api, "alpha").get("phase") == "Pending", what="Pending")
        # Every pod ready: the StatefulSet controller would report it like this.
        for role in ("trainer", "generator", "scorer"):
            await api.merge(f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/alpha-{role}/status",
                            {"status": {"replicas": 1, "readyReplicas": 1}})
        await eventually(lambda: status(api, "alpha").get("phase") == "Running", what="Running")
        assert status(api, "alpha")["ready"] == "3/3"
        assert ready_condition(api, "alpha")["status"] == "True"


async def test_the_optional_executors_are_reconciled_like_every_role(api):
    replicas = {"trainer": 1, "generator": 1, "scorer": 1, "reference": 2, "reward": 1, "critic": 1}
    roles = {**SMALL["roles"], "reference": {"replicas": 2}, "rewardModel": {"path": "/models/rm"}, "critic": {}}
    async with Operator():
        await api.create(JOBS, rljob("refs", {"roles": roles, "algorithm": {"advantage": "gae"}}))
        await all_created(api, "refs")
        for role, count in replicas.items():
            made = api.get(STS, f"refs-{role}")
            assert made["spec"]["replicas"] == count and api.get("v1/services", f"refs-{role}"), role
            assert made["spec"]["template"]["spec"]["containers"][0]["command"][-1] == role
        # The critic's checkpoints outlive its pod, as a trainer's do.
        assert [c["metadata"]["name"] for c in api.get(STS, "refs-critic")["spec"]["volumeClaimTemplates"]] == ["run"]
        for role, count in replicas.items():
            await api.merge(f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/refs-{role}/status",
                            {"status": {"replicas": count, "readyReplicas": count}})
        await eventually(lambda: status(api, "refs").get("phase") == "Running", what="Running")
        assert status(api, "refs")["ready"] == f"{sum(replicas.values())}/{sum(replicas.values())}"
        await api.merge(f"{JOBS}/refs", {"spec": {"suspend": True}})
        await eventually(lambda: all(api.get(STS, f"refs-{r}")["spec"]["replicas"] == 0 for r in replicas),
                         what="every role at zero, the optional executors too")


async def test_controllers_of_their_own_get_an_account_that_may_use_the_jobs_lease(api):
    async with Operator():
        await api.create(JOBS, rljob("ctl", {"roles": {**SMALL["roles"], "controller": {}},
                                             "storage": {"checkpointClaim": "runs"}}))  # their shared run folder
        await all_created(api, "ctl")
        for resource in ("v1/serviceaccounts", "rbac.authorization.k8s.io/v1/roles",
                         "rbac.authorization.k8s.io/v1/rolebindings"):
            assert api.get(resource, "ctl-controller")["metadata"]["ownerReferences"][0]["uid"] == "uid-ctl", resource
        pod = api.get(STS, "ctl-control")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "ctl-controller"
        for role, count in {"trainer": 1, "generator": 1, "scorer": 1, "control": 2}.items():
            await api.merge(f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/ctl-{role}/status",
                            {"status": {"replicas": count, "readyReplicas": count}})
        # The status timer looks for the leader in the Lease (none here: the controllers make it) on its way.
        await eventually(lambda: status(api, "ctl").get("phase") == "Running", what="Running")


async def test_stuck_pods_show_in_the_ready_condition(api):
    async with Operator():
        await api.create(JOBS, rljob("beta", SMALL))
        await all_created(api, "beta")
        await api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", _pod("beta-generator-0", "beta", "generator", {
            "containerStatuses": [{"name": "generator", "state": {"waiting": {
                "reason": "ImagePullBackOff", "message": 'Back-off pulling image "nope:1"'}}}]}))
        await api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", _pod("beta-trainer-0", "beta", "trainer", {
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}))
        condition = await eventually(lambda: "Insufficient" in ready_condition(api, "beta").get("message", "")
                                     and ready_condition(api, "beta"), what="condition")
        assert "beta-generator-0: ImagePullBackOff" in condition["message"]
        assert "beta-trainer-0 unschedulable" in condition["message"]


async def test_generator_replicas_change_scales_only_the_generators(api):
    async with Operator():
        await api.create(JOBS, rljob("gamma", SMALL))
        await all_created(api, "gamma")
        await api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", _pod("gamma-trainer-0", "gamma", "trainer", {}))
        before = {role: api.get(STS, f"gamma-{role}") for role in ("trainer", "scorer")}
        await api.merge(f"{JOBS}/gamma", {"spec": {"roles": {"generator": {"replicas": 3}}}})
        await eventually(lambda: api.get(STS, "gamma-generator")["spec"]["replicas"] == 3, what="3 generators")
        endpoints = await eventually(lambda: "gamma-generator-2" in api.get("v1/configmaps", "gamma-config")
                                     ["data"]["endpoints.json"], what="endpoints")
        assert endpoints
        for role, sts in before.items():
            assert api.get(STS, f"gamma-{role}")["spec"] == sts["spec"], f"{role} was changed"
        assert api.get("v1/pods", "gamma-trainer-0") is not None, "training was restarted"


async def test_each_generator_pool_is_a_statefulset_that_scales_in_place(api):
    pools = {"roles": {"generator": {"engine": "torch", "pools": [{"name": "fast", "replicas": 1},
                                                                  {"name": "slow", "replicas": 1}]}}}
    async with Operator():
        await api.create(JOBS, rljob("pools", pools))
        await all_created(api, "pools")
        assert api.get(STS, "pools-generator") is None
        assert api.get("v1/services", "pools-generator-fast") and api.get("v1/services", "pools-generator-slow")
        fast = api.get(STS, "pools-generator-fast")
        await api.merge(f"{JOBS}/pools", {"spec": {"roles": {"generator": {"pools": [
            {"name": "fast", "replicas": 1}, {"name": "slow", "replicas": 3}]}}}})
        await eventually(lambda: api.get(STS, "pools-generator-slow")["spec"]["replicas"] == 3, what="3 slow")
        await eventually(lambda: "pools-generator-slow-2" in _endpoints_text(api), what="endpoints")
        assert api.get(STS, "pools-generator-fast")["spec"] == fast["spec"], "the other pool was changed"
        # The first pool grows into its own block of indexes: the second pool's replicas keep theirs.
        await api.merge(f"{JOBS}/pools", {"spec": {"roles": {"generator": {"pools": [
            {"name": "fast", "replicas": 2}, {"name": "slow", "replicas": 3}]}}}})
        await eventually(lambda: api.get(STS, "pools-generator-fast")["spec"]["replicas"] == 2, what="2 fast")
        await eventually(lambda: "pools-generator-fast-1" in _endpoints_text(api), what="endpoints of 2 fast")
        hosts = [address.split(".")[0] for address in json.loads(_endpoints_text(api))["servers"]["generator"]]
        assert (hosts[:2], hosts[128:]) == (["pools-generator-fast-0", "pools-generator-fast-1"],
                                            [f"pools-generator-slow-{ordinal}" for ordinal in range(3)])
        # `kubectl scale statefulset` on a pool (or an autoscaler of it): the RLJob takes the count.
        await api.merge(f"{STS_PATH}/pools-generator-fast", {"spec": {"replicas": 3}})
        await eventually(lambda: _pool_counts(api) == [3, 3], what="the pool's count in the RLJob")
        await eventually(lambda: "pools-generator-fast-2" in _endpoints_text(api), what="endpoints of 3 fast")
        await eventually(lambda: _event(api, "PoolScaled", "spec.roles.generator.pools[0].replicas is 3 now"),
                         what="an Event saying so")
        # Over the pool's block of indexes: scaled back (the Warning's text: test_scaled_pools.py).
        await api.merge(f"{STS_PATH}/pools-generator-slow", {"spec": {"replicas": 200}})
        await eventually(lambda: api.get(STS, "pools-generator-slow")["spec"]["replicas"] == 3, what="scaled back")
        assert _pool_counts(api) == [3, 3]
        # Swapping the pools would move running replicas to another pool: refused, nothing changes.
        await api.merge(f"{JOBS}/pools", {"spec": {"roles": {"generator": {"pools": [
            {"name": "slow", "replicas": 3}, {"name": "fast", "replicas": 3}]}}}})
        await eventually(lambda: "pool fast runs generators 0..2" in str(status(api, "pools").get("conditions")),
                         what="refused, saying why")
        assert api.get(STS, "pools-generator-fast")["spec"]["replicas"] == 3
        await overwrite_with_running(api, "pools")
        await eventually(lambda: "pool fast runs generators 0..2" in str(status(api, "pools").get("conditions")),
                         what="the refusal said again")


def _endpoints_text(api) -> str:
    return api.get("v1/configmaps", "pools-config")["data"]["endpoints.json"]


def _pool_counts(api) -> list[int]:
    return [pool["replicas"] for pool in api.get("rlfleet.io/v1alpha1/rljobs", "pools")["spec"]["roles"]["generator"]
            ["pools"]]


def _event(api, reason: str, part: str) -> str:
    """The message of an Event of `reason` that holds `part`, or "" (KMock keeps a namespace's first Event only: it
    names every Event alike, ignoring generateName)."""
    return next((e.raw["message"] for key, e in api.kmock.objects.items() if key[0].plural == "events"
                 and e.raw.get("reason") == reason and part in e.raw.get("message", "")), "")


async def test_any_other_change_restarts_all_trainer_ranks_together(api):
    async with Operator():
        await api.create(JOBS, rljob("zeta", SMALL | {"roles": {"trainer": {"replicas": 2}}}))
        await all_created(api, "zeta")
        for rank in range(2):
            await api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", _pod(f"zeta-trainer-{rank}", "zeta", "trainer", {}))
        token = secret_token(api.get("v1/secrets", "zeta-token"))
        await api.merge(f"{JOBS}/zeta", {"spec": {"algorithm": {"learningRate": 0.001}}})
        await eventually(lambda: api.get("v1/pods", "zeta-trainer-0") is None
                         and api.get("v1/pods", "zeta-trainer-1") is None, what="trainer pods deleted")
        assert api.get(STS, "zeta-trainer")["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert not status(api, "zeta").get("restarts")  # a deliberate restart is not a failure
        # The reconcile after the change built a new random token; the job's Secret was left as created.
        assert secret_token(api.get("v1/secrets", "zeta-token")) == token and len(token) >= 32
        assert api.versions("v1/secrets", "zeta-token") == 1


async def test_suspend_scales_every_role_to_zero_and_resume_scales_back(api):
    async with Operator():
        await api.create(JOBS, rljob("delta", SMALL))
        await all_created(api, "delta")
        await api.merge(f"{JOBS}/delta", {"spec": {"suspend": True}})
        await eventually(lambda: all(api.get(STS, f"delta-{r}")["spec"]["replicas"] == 0
                                     for r in ("trainer", "generator", "scorer")), what="zero replicas")
        await eventually(lambda: status(api, "delta").get("phase") == "Suspended", what="Suspended")
        # The trainer's volume (checkpoints) outlives the scale-down.
        trainer = api.get(STS, "delta-trainer")["spec"]
        assert trainer["persistentVolumeClaimRetentionPolicy"]["whenScaled"] == "Retain"
        await api.merge(f"{JOBS}/delta", {"spec": {"suspend": False}})
        await eventually(lambda: api.get(STS, "delta-trainer")["spec"]["replicas"] == 1, what="resumed")
        await eventually(lambda: status(api, "delta").get("phase") == "Pending", what="Pending again")


async def test_invalid_job_creates_nothing_and_says_why(api):
    async with Operator():
        await api.create(JOBS, rljob("bad", {"algorithm": {"maxStaleness": -1}}))
        await eventually(lambda: status(api, "bad").get("phase") == "Failed", what="Failed")
        condition = ready_condition(api, "bad")
        assert condition["reason"] == "InvalidSpec"
        assert "spec.algorithm.maxStaleness" in condition["message"]
        await eventually(lambda: any(e.raw.get("reason") == "InvalidSpec" and e.raw.get("type") == "Warning"
                                     for key, e in api.kmock.objects.items() if key[0].plural == "events"),
                         what="Warning event")
    created = [key for key in api.kmock.objects
               if key[0].plural in ("configmaps", "secrets", "services", "statefulsets", "networkpolicies")]
    assert created == []


async def test_a_refusal_that_a_status_write_begun_before_it_overwrote_comes_back(api):
    """The status timer runs beside reconcile: a tick that read the status before a refusal may write Running over
    it, and reconcile never refuses again. The next tick says the refusal again."""
    async with Operator():
        await api.create(JOBS, rljob("bad", {"algorithm": {"maxStaleness": -1}}))
        await eventually(lambda: status(api, "bad").get("phase") == "Failed", what="Failed")
        await overwrite_with_running(api, "bad")
        await eventually(lambda: status(api, "bad").get("phase") == "Failed", what="Failed again")
    assert ready_condition(api, "bad")["reason"] == "InvalidSpec"
    assert "spec.algorithm.maxStaleness" in ready_condition(api, "bad")["message"]


async def overwrite_with_running(api: Api, name: str) -> None:
    """The status write of a timer tick that began before the job was refused."""
    ready = {"type": "Ready", "status": "True", "reason": "Running", "message": "every role is ready",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
    await api.merge(f"{JOBS}/{name}/status", {"status": {"phase": "Running", "conditions": [ready]}})


async def test_reward_code_without_its_function_is_refused_and_good_code_goes_in_the_configmap(api):
    """The operator parses a python scorer's source (never runs it): a source without the function creates nothing,
    one with it travels in the job's ConfigMap (docs/rewards.md)."""
    source = "def score(completion, answer, prompt, **fields):\n    return 1.0\n"
    scorer = {"type": "python", "path": "rewards.py", "function": "reward", "source": source}
    async with Operator():
        await api.create(JOBS, rljob("no-reward", {**SMALL, "scorers": [scorer]}))
        await api.create(JOBS, rljob("reward", {**SMALL, "scorers": [{**scorer, "function": "score"}]}))
        await eventually(lambda: status(api, "no-reward").get("phase") == "Failed", what="Failed")
        await all_created(api, "reward")
    condition = ready_condition(api, "no-reward")
    assert condition["reason"] == "InvalidSpec"
    assert condition["message"].startswith("spec.scorers.0.source: defines no 'reward' at the top level")
    assert api.get("v1/configmaps", "no-reward-config") is None
    job = json.loads(api.get("v1/configmaps", "reward-config")["data"]["job.json"])
    assert job["spec"]["scorers"][0]["source"] == source


async def test_a_data_path_on_no_mounted_volume_creates_nothing_and_says_why(api):
    """`data.path: /tmp/...` would render and fail in the pod: the operator refuses it, naming the field and mounts,
    and the status timer (which parses the spec fine) leaves the refusal standing."""
    spec = {"data": {"type": "jsonl", "path": "/tmp/train.jsonl"},
            "storage": {"volumes": [{"name": "data", "claim": "rl-data", "mountPath": "/data"}]}}
    async with Operator():
        await api.create(JOBS, rljob("unmounted", spec))
        await eventually(lambda: status(api, "unmounted").get("phase") == "Failed", what="Failed")
        condition = ready_condition(api, "unmounted")
        assert condition["reason"] == "InvalidSpec"
        assert condition["message"].startswith("spec.data.path: '/tmp/train.jsonl' lies on no volume the trainer "
                                               "pods mount (their spec.storage.volumes: /data)")
        await eventually(lambda: any(e.raw.get("reason") == "InvalidSpec" and "spec.data.path" in e.raw.get("message")
                                     for key, e in api.kmock.objects.items() if key[0].plural == "events"),
                         what="Warning event")
        await asyncio.sleep(3)  # three status intervals (tests/kmock_cluster.py)
        assert status(api, "unmounted")["phase"] == "Failed"
        assert ready_condition(api, "unmounted")["reason"] == "InvalidSpec"
    created = [key for key in api.kmock.objects
               if key[0].plural in ("configmaps", "secrets", "services", "statefulsets", "networkpolicies")]
    assert created == []


async def test_a_job_named_like_another_owners_object_leaves_it_alone_and_says_whose(api):
    """A namespace's deny-all NetworkPolicy, made by hand, and a job named after it: the policy is neither patched
    nor adopted, nothing of the job is created, and the status and a Warning event name the object."""
    deny = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny", "namespace": NAMESPACE, "resourceVersion": "1"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    api.kmock.objects["networking.k8s.io/v1/networkpolicies", NAMESPACE, "default-deny"] = deny
    async with Operator():
        await api.create(JOBS, rljob("default-deny", SMALL))
        await eventually(lambda: ready_condition(api, "default-deny").get("reason") == "ObjectNotOwned",
                         what="ObjectNotOwned")
        assert "NetworkPolicy default-deny exists and is controlled by no owner" in \
            ready_condition(api, "default-deny")["message"]
        assert status(api, "default-deny")["phase"] == "Failed"
        await eventually(lambda: any(e.raw.get("reason") == "ObjectNotOwned" and e.raw.get("type") == "Warning"
                                     and "NetworkPolicy default-deny" in e.raw.get("message", "")
                                     for key, e in api.kmock.objects.items() if key[0].plural == "events"),
                         what="Warning event")
    assert api.get("networking.k8s.io/v1/networkpolicies", "default-deny") == deny
    assert api.versions("networking.k8s.io/v1/networkpolicies", "default-deny") == 1
    created = [key for key in api.kmock.objects
               if key[0].plural in ("configmaps", "secrets", "services", "statefulsets")]
    assert created == []


# A sample of the corpus (tests/bad_jobs.py): kopf takes ~0.5 s per refused job against KMock, so the whole
# corpus (92 jobs) runs against the handler alone, in tests/unit/test_operator_refuses.py.
CORPUS_SAMPLE = ["spec-list", "spec-string", "hidden-size-string", "max-staleness-negative", "generator-replicas-0",
                 "trainer-replicas-huge", "model-empty", "unknown-in-spec", "regex-huge", "node-selector-key-huge",
                 "name-leading-digit"]


async def test_bad_jobs_of_the_corpus_are_refused_and_create_nothing(api):
    """Each sampled job, created as kubectl would while kopf runs: Failed with InvalidSpec and a Warning event
    naming its field path, and no object created for any of them."""
    cases = [c for c in kubernetes_objects() if c[0] in CORPUS_SAMPLE]
    assert len(cases) == len(CORPUS_SAMPLE)

    def warnings() -> dict[str, str]:
        # From the requests: KMock ignores generateName, so it keeps only the first of kopf's Events (409s the rest).
        return {r.data["involvedObject"]["name"]: r.data["message"] for r in api.kmock
                if r.action == km.action.CREATE and r.resource is not None and r.resource.plural == "events"
                and r.data.get("reason") == "InvalidSpec" and r.data.get("type") == "Warning"}

    async with Operator():
        for _, name, spec, _ in cases:
            await api.create(JOBS, rljob(name, spec))
        await eventually(lambda: all(status(api, name).get("phase") == "Failed" for _, name, _, _ in cases),
                         what="every bad job Failed")
        await eventually(lambda: len(warnings()) == len(cases), what="a Warning event per job")
    wrong = []
    for id_, name, _, path in cases:
        condition = ready_condition(api, name)
        if condition.get("reason") != "InvalidSpec" or f"{path}: " not in condition.get("message", "") \
                or f"{path}: " not in warnings()[name]:
            wrong.append(f"{id_}: want {path!r}; condition {condition}, event {warnings()[name]!r}")
    assert not wrong, "\n".join(wrong)
    created = [key for key in api.kmock.objects
               if key[0].plural in ("configmaps", "secrets", "services", "statefulsets", "networkpolicies", "pods")]
    assert created == []


async def test_failed_trainer_restarts_until_the_budget_is_spent(api):
    spec = SMALL | {"failurePolicy": {"maxRestarts": 1}}
    async with Operator():
        await api.create(JOBS, rljob("eps", spec))
        await all_created(api, "eps")
        await api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", _crashed_trainer("eps"))
        # First failure: the trainer pods are deleted (they restart from the checkpoint).
        await eventually(lambda: api.get("v1/pods", "eps-trainer-0") is None, what="trainer pod deleted")
        await eventually(lambda: status(api, "eps").get("restarts") == 1, what="1 restart")
        await api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", _crashed_trainer("eps"))
        await eventually(lambda: status(api, "eps").get("phase") == "Failed", what="Failed")
        assert ready_condition(api, "eps")["reason"] == "RestartLimitExceeded"
        await eventually(lambda: all(api.get(STS, f"eps-{r}")["spec"]["replicas"] == 0
                                     for r in ("trainer", "generator", "scorer")), what="scaled to zero")


def _pod(name: str, job: str, role: str, pod_status: dict) -> dict:
    labels = {"rlfleet.io/job": job, "rlfleet.io/role": role}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels,
                                                             "resourceVersion": "1"},
            "spec": {"containers": [{"name": role, "image": "x"}]}, "status": pod_status}


def _crashed_trainer(job: str) -> dict:
    return _pod(f"{job}-trainer-0", job, "trainer", {"containerStatuses": [{
        "name": "trainer", "restartCount": 1, "state": {"running": {}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]})
