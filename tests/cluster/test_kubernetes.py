"""RLFleet on a real Kubernetes cluster, as docs/kubernetes.md tells users to run it: helm install, kubectl apply, watch
`kubectl get rlj`, and the job trains, fails over, suspends, scales and cleans up.

The lifecycle tests share one job and run in file order; each starts from where the previous one left it. The job
runs without end until the suspend test resumes it with its length.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml
from helm_tool import CHART, NAMESPACE, RELEASE, helm
from kube_cluster import BUILD_SECONDS, Cluster, clusters, eventually
from pod_security import restricted_violations
from runs import TINY

from rlfleet.benchmarks.chaos import ledger_problems
from rlfleet.operator.compat import GRPC_PROBES, NAMESPACE_NAME_LABEL, PVC_RETENTION
from rlfleet.workers.spec import parse_job

# Also integration and slow: the fast sets (`-m "not integration"`, `-m "not slow"`) leave them out.
pytestmark = [pytest.mark.cluster, pytest.mark.integration, pytest.mark.slow,
              pytest.mark.timeout(BUILD_SECONDS + 900)]
ROLES = ("generator", "scorer", "trainer")
JOBS = "rlfleet-e2e"
# The job runs until the last disruption gives it its length: a fixed length was over before the first pod was
# deleted on one machine (12 steps a second) and took 10 minutes on another (2 a second).
UNENDING = 1_000_000
# Steps trained after the resume that gives the job its length.
LAST_LEG = 20
# Checkpoints often, so a restart loses little.
CHECKPOINT_EVERY = 5
# The one node has 2 cores: request little, limit memory as a user would.
MEMORY = {"generator": "3Gi", "scorer": "1Gi", "trainer": "3Gi"}
START_SECONDS = 300
TRAIN_SECONDS = 600
REJOINED = "generator replica 0 is back"
# Long enough that the leader, then the trainer, are deleted mid-run on a fast node (about 0.45 s a step here, and the
# job's status lags by up to 10 s: here the leader went at step 40 and the trainer at 50, 30 steps before the end), and
# that a slow one finishes within TRAIN_SECONDS.
FAILOVER_STEPS = 80
POOL_LABEL = "rlfleet.io/test-pool"


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    yield from clusters()


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> str:
    """The chart installed as a user installs it; the operator runs in the cluster under the chart's RBAC.
    Returns the operator's namespace."""
    repository, tag = cluster.image.rsplit(":", 1)
    helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
         "--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "statusIntervalSeconds=2",
         kubeconfig=cluster.kubeconfig, timeout=360)
    yield NAMESPACE
    helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", kubeconfig=cluster.kubeconfig, timeout=180)
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


@pytest.fixture(scope="module")
def jobs_namespace(cluster: Cluster, operator: str) -> str:
    cluster.kubectl("create", "namespace", JOBS)
    # Enforced by servers with Pod Security admission (1.23+); 1.20 ignores the label, so the test also checks
    # each pod as the server stored it against the same rules.
    cluster.kubectl("label", "namespace", JOBS, "pod-security.kubernetes.io/enforce=restricted")
    # Pods are refused until the namespace's default service account exists.
    eventually(lambda: cluster.get("serviceaccount", "default", JOBS), 60, "the default service account")
    yield JOBS
    cluster.kubectl("delete", "namespace", JOBS, "--wait=false")


@pytest.fixture(scope="module")
def job(cluster: Cluster, jobs_namespace: str) -> dict:
    document = tiny_job("tiny")
    cluster.apply(document)
    yield document
    cluster.kubectl("delete", "rljob", "tiny", f"--namespace={jobs_namespace}", "--ignore-not-found", "--wait=false")


def tiny_job(name: str) -> dict:
    """The built-in example job, in the test namespace, shortened and sized for the node."""
    job = yaml.safe_load(TINY.read_text())
    job["metadata"] = {"name": name, "namespace": JOBS}
    spec = job["spec"]
    spec["algorithm"]["steps"] = UNENDING
    spec["checkpoint"] = {"everySteps": CHECKPOINT_EVERY, "keep": 2}
    for role, memory in MEMORY.items():
        spec["roles"][role]["resources"] = {"cpu": "100m", "memory": memory}
    return job


def rlj_row(cluster: Cluster, name: str = "tiny") -> dict[str, str]:
    """`kubectl get rlj tiny` as a user reads it: column name -> value."""
    header, row = cluster.kubectl("get", "rlj", name, f"--namespace={JOBS}").stdout.splitlines()[:2]
    return dict(zip(header.split(), row.split()))


def step(cluster: Cluster, name: str = "tiny") -> int:
    value = rlj_row(cluster, name).get("STEP", "")
    return int(value) if value.isdigit() else 0


def phase(cluster: Cluster, name: str = "tiny") -> str:
    return (cluster.get("rlj", name, JOBS).get("status") or {}).get("phase", "")


def pod(cluster: Cluster, name: str) -> dict | None:
    return cluster.get("pod", name, JOBS)


def ready(found: dict | None) -> bool:
    conditions = (found or {}).get("status", {}).get("conditions") or []
    return not (found or {}).get("metadata", {}).get("deletionTimestamp") and \
        any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_ready(cluster: Cluster, name: str, other_than: str | None = None) -> dict:
    """The pod once Ready; with other_than, a new pod of that name (not the one with that uid)."""
    def check():
        found = pod(cluster, name)
        return found if ready(found) and found["metadata"]["uid"] != other_than else None
    return eventually(check, START_SECONDS, f"pod {name} ready")


def wait_step_past(cluster: Cluster, value: int) -> int:
    return eventually(lambda: (now := step(cluster)) > value and now, TRAIN_SECONDS, f"a step past {value}")


def logs(cluster: Cluster, name: str) -> str:
    return cluster.kubectl("logs", name, f"--namespace={JOBS}").stdout


def running(cluster: Cluster) -> int:
    """The step, once the job is Running (every pod ready again after the last disruption)."""
    eventually(lambda: phase(cluster) == "Running", START_SECONDS, "phase Running")
    return step(cluster)


def identity(found: dict) -> tuple[str, int]:
    """A pod's uid and restarts: a pod replaced or a container restarted changes it."""
    return found["metadata"]["uid"], found["status"]["containerStatuses"][0]["restartCount"]


def identities(cluster: Cluster, names: tuple[str, ...]) -> dict[str, tuple[str, int] | None]:
    """Each named pod's identity (None: no such pod), read in one call."""
    found = {p["metadata"]["name"]: p for p in cluster.get("pod", namespace=JOBS)}
    return {name: identity(found[name]) if name in found else None for name in names}


def holder(cluster: Cluster, job: str = "fleet") -> str:
    """The controller pod that leads the job: its Lease's holder ("" while none does)."""
    return ((cluster.get("lease", f"{job}-controller", JOBS) or {}).get("spec") or {}).get("holderIdentity") or ""


def delete_pod(cluster: Cluster, name: str) -> str:
    """Delete the pod as a user would; returns the deleted pod's uid."""
    uid = pod(cluster, name)["metadata"]["uid"]
    cluster.kubectl("delete", "pod", name, f"--namespace={JOBS}", "--wait=false")
    return uid


def test_operator_runs_in_the_cluster_under_the_charts_service_account(cluster, operator):
    pods = cluster.get("pod", namespace=operator)
    assert [p["spec"]["serviceAccountName"] for p in pods] == ["rlfleet"]
    assert ready(pods[0])
    if cluster.server_minor() < GRPC_PROBES.since[1]:
        eventually(lambda: "lacks gRPC probes" in cluster.kubectl("logs", pods[0]["metadata"]["name"],
                                                                  f"--namespace={operator}").stdout,
                   60, "the operator's notice on how it handles this older server")


def test_invalid_job_is_refused_by_the_api_servers_crd_schema(cluster, jobs_namespace):
    bad = tiny_job("bad")
    bad["spec"]["algorithm"]["steps"] = "many"
    # --validate=false: the client checks nothing, so the refusal is the API server's.
    out = cluster.apply(bad, "--validate=false", check=False)
    assert out.returncode != 0
    assert "spec.algorithm.steps" in out.stderr and "integer" in out.stderr
    assert cluster.get("rlj", "bad", jobs_namespace) is None


def test_job_objects_appear_and_pods_start_restricted(cluster, job):
    for kind in ("statefulset", "service"):
        eventually(lambda: all(cluster.get(kind, f"tiny-{role}", JOBS) for role in ROLES), 60, f"{kind}s")
    for kind, name in (("configmap", "tiny-config"), ("secret", "tiny-token"), ("networkpolicy", "tiny")):
        assert eventually(lambda: cluster.get(kind, name, JOBS), 60, f"{kind} {name}")
    claim = eventually(lambda: (cluster.get("pvc", "run-tiny-trainer-0", JOBS) or {}).get("status", {})
                       .get("phase") == "Bound", START_SECONDS, "the trainer's volume bound")
    assert claim
    for role in ROLES:
        found = wait_ready(cluster, f"tiny-{role}-0")
        assert restricted_violations(found) == []
        assert found["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"]
    # What the kernel enforces, not just what the spec says.
    uid = cluster.kubectl("exec", "tiny-scorer-0", f"--namespace={JOBS}", "--", "id", "-u").stdout.strip()
    assert uid == "1000"
    refused = cluster.kubectl("exec", "tiny-scorer-0", f"--namespace={JOBS}", "--", "touch", "/opt/x", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr


def test_older_server_differences_are_what_the_readme_lists(cluster, job):
    minor = cluster.server_minor()
    probe = cluster.get("statefulset", "tiny-generator", JOBS)["spec"]["template"]["spec"]["containers"][0][
        "readinessProbe"]
    assert ("grpc" in probe) == (minor >= GRPC_PROBES.since[1]) and ("tcpSocket" in probe) == (not "grpc" in probe)
    trainer = cluster.get("statefulset", "tiny-trainer", JOBS)["spec"]
    assert ("persistentVolumeClaimRetentionPolicy" in trainer) == (minor >= PVC_RETENTION.since[1])
    labels = cluster.get("namespace", JOBS)["metadata"].get("labels") or {}
    assert ("kubernetes.io/metadata.name" in labels) == (minor >= NAMESPACE_NAME_LABEL.since[1])


def test_get_rlj_shows_progress(cluster, job):
    # A pod is Ready a probe period after its server starts, by when a fast node has trained a few steps.
    seen = eventually(lambda: (row := rlj_row(cluster))["PHASE"] == "Running" and step(cluster) >= 2 and row,
                      TRAIN_SECONDS, "steps in kubectl get rlj")
    assert seen["READY"] == "3/3"
    assert re.fullmatch(r"-?\d+(\.\d+)?", seen["REWARD"])


def test_generator_pod_deleted_mid_run_rejoins_and_training_goes_on(cluster, job):
    running(cluster)
    rejoined = logs(cluster, "tiny-trainer-0").count(REJOINED)
    old = delete_pod(cluster, "tiny-generator-0")
    wait_ready(cluster, "tiny-generator-0", other_than=old)
    eventually(lambda: logs(cluster, "tiny-trainer-0").count(REJOINED) > rejoined, START_SECONDS,
               "the controller taking the new generator back")
    # The only generator: a step after this one was generated by the new pod.
    wait_step_past(cluster, step(cluster))


def test_trainer_pod_deleted_mid_run_resumes_from_its_checkpoint(cluster, job):
    before = wait_step_past(cluster, CHECKPOINT_EVERY)
    running(cluster)
    old = delete_pod(cluster, "tiny-trainer-0")
    wait_ready(cluster, "tiny-trainer-0", other_than=old)
    eventually(lambda: "resuming from" in logs(cluster, "tiny-trainer-0"), START_SECONDS, "the trainer resuming")
    resumed = int(re.search(r"resuming from \S+: step (\d+)", logs(cluster, "tiny-trainer-0")).group(1))
    # `before` may lag the trainer by a status interval, never lead it.
    assert resumed >= before - CHECKPOINT_EVERY, f"resumed at step {resumed}, not from the newest checkpoint"
    wait_step_past(cluster, before)


def test_kubectl_scale_adds_a_generator_the_controller_uses_without_restarting_anything(cluster, job):
    running(cluster)
    trainer = pod(cluster, "tiny-trainer-0")
    # Through the RLJob's scale subresource, as an autoscaler would.
    cluster.kubectl("scale", "rlj", "tiny", f"--namespace={JOBS}", "--replicas=2")
    assert cluster.get("rlj", "tiny", JOBS)["spec"]["roles"]["generator"]["replicas"] == 2
    wait_ready(cluster, "tiny-generator-1")
    after = pod(cluster, "tiny-trainer-0")
    assert after["metadata"]["uid"] == trainer["metadata"]["uid"]
    assert after["status"]["containerStatuses"][0]["restartCount"] == \
        trainer["status"]["containerStatuses"][0]["restartCount"]
    eventually(lambda: cluster.get("rlj", "tiny", JOBS)["status"]["roles"]["generator"]["replicas"] == 2, 60,
               "status showing two generators")
    scale = json.loads(cluster.kubectl("get", "--raw", f"/apis/rlfleet.io/v1alpha1/namespaces/{JOBS}/rljobs/tiny/scale"
                                       ).stdout)
    assert scale["status"]["replicas"] == 2 and "rlfleet.io/role=generator" in scale["status"]["selector"]
    # The kubelet refreshes the ConfigMap's endpoints file in the running trainer pod at its next pod sync (within a
    # minute by default, 10 s on the project's cluster: scripts/kube/node.py); the controller then joins the new
    # generator and sends it the weights. Removing it hands its work back (the ledger check of
    # test_job_trains_to_succeeded_with_every_step_once finds nothing lost).
    eventually(lambda: "generator replica 1 rejoined at version" in logs(cluster, "tiny-trainer-0"), START_SECONDS,
               "the controller joining the added generator")
    cluster.kubectl("scale", "rlj", "tiny", f"--namespace={JOBS}", "--replicas=1")
    eventually(lambda: "generator replica 1 removed from the job" in logs(cluster, "tiny-trainer-0"), START_SECONDS,
               "the controller leaving the removed generator out")
    assert pod(cluster, "tiny-trainer-0")["metadata"]["uid"] == trainer["metadata"]["uid"]


def test_suspend_and_resume_with_kubectl_patch(cluster, job):
    before = running(cluster)
    cluster.kubectl("patch", "rlj", "tiny", f"--namespace={JOBS}", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    eventually(lambda: phase(cluster) == "Suspended", 60, "phase Suspended")
    eventually(lambda: not cluster.get("pod", namespace=JOBS), START_SECONDS, "every worker pod gone")
    assert all(cluster.get("statefulset", f"tiny-{role}", JOBS)["spec"]["replicas"] == 0 for role in ROLES)
    assert cluster.get("pvc", "run-tiny-trainer-0", JOBS), "suspending must keep the checkpoints"
    # Resumed with its length, counted from the last step it trained (the status's step lags a status interval);
    # a changed spec rolls the pods, which resume from the checkpoint anyway.
    metrics = read_run_volume(cluster, "run-tiny-trainer-0", ("metrics.jsonl",))["metrics.jsonl"]
    steps = json.loads(metrics.splitlines()[-1])["step"] + LAST_LEG
    resume = {"spec": {"suspend": False, "algorithm": {"steps": steps}}}
    cluster.kubectl("patch", "rlj", "tiny", f"--namespace={JOBS}", "--type=merge", "-p", json.dumps(resume))
    for role in ROLES:
        wait_ready(cluster, f"tiny-{role}-0")
    eventually(lambda: "resuming from" in logs(cluster, "tiny-trainer-0"), START_SECONDS, "the trainer resuming")
    eventually(lambda: step(cluster) > before or phase(cluster) == "Succeeded", TRAIN_SECONDS, f"a step past {before}")


def test_job_trains_to_succeeded_with_every_step_once(cluster, job, tmp_path):
    steps = cluster.get("rlj", "tiny", JOBS)["spec"]["algorithm"]["steps"]
    eventually(lambda: phase(cluster) in ("Succeeded", "Failed") and phase(cluster), TRAIN_SECONDS, "the job to finish")
    assert phase(cluster) == "Succeeded", cluster.get("rlj", "tiny", JOBS)["status"]
    assert rlj_row(cluster)["STEP"] == str(steps)
    eventually(lambda: not cluster.get("pod", namespace=JOBS), START_SECONDS, "workers scaled to zero")
    for name, text in read_run_volume(cluster, "run-tiny-trainer-0", ("metrics.jsonl", "prompts.jsonl")).items():
        (tmp_path / name).write_text(text)
    assert ledger_problems(tmp_path, steps, parse_job(job).spec.algorithm.max_staleness) == []


def test_deleting_the_job_removes_everything_it_owned(cluster, job):
    owned = [("statefulset", f"tiny-{r}") for r in ROLES] + [("service", f"tiny-{r}") for r in ROLES] + [
        ("configmap", "tiny-config"), ("secret", "tiny-token"), ("networkpolicy", "tiny")]
    cluster.kubectl("delete", "rlj", "tiny", f"--namespace={JOBS}")
    # The controller manager's garbage collector does this, following ownerReferences.
    eventually(lambda: not any(cluster.get(kind, name, JOBS) for kind, name in owned), 120, "owned objects gone")
    claim = cluster.get("pvc", "run-tiny-trainer-0", JOBS)
    if cluster.server_minor() >= PVC_RETENTION.since[1]:
        eventually(lambda: not cluster.get("pvc", "run-tiny-trainer-0", JOBS), 120, "the trainer's volume gone")
    else:
        # Older servers have no PVC retention policy: the volume stays, as the operator's notice says.
        assert claim is not None
        cluster.kubectl("delete", "pvc", "-l", "rlfleet.io/job=tiny", f"--namespace={JOBS}")


def read_run_volume(cluster: Cluster, claim: str, names: tuple[str, ...]) -> dict[str, str]:
    """Files of a volume, read by a short-lived pod that mounts it (works on any cluster)."""
    script = ("import json, pathlib; print(json.dumps({n: pathlib.Path('/data', n).read_text() for n in %r}))"
              % (names,))
    return json.loads(on_volume(cluster, claim, script, read_only=True))


def on_volume(cluster: Cluster, claim: str, script: str, read_only: bool) -> str:
    """Run a Python script in the project's image in a short-lived pod that mounts the claim at /data; its output."""
    runner = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "volume-user", "namespace": JOBS},
        # No service account token: its mount point, /var/run/secrets, is under /run (a link on Debian).
        "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                 "securityContext": {"runAsUser": 1000, "runAsNonRoot": True, "fsGroup": 1000,
                                     "seccompProfile": {"type": "RuntimeDefault"}},
                 "containers": [{"name": "script", "image": cluster.image, "command": ["python", "-c", script],
                                 "securityContext": {"allowPrivilegeEscalation": False,
                                                     "capabilities": {"drop": ["ALL"]}},
                                 "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                 "volumes": [{"name": "data",
                              "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}]}}
    cluster.apply(runner)
    try:
        ended = eventually(lambda: (pod(cluster, "volume-user") or {}).get("status", {}).get("phase") in
                           ("Succeeded", "Failed") and pod(cluster, "volume-user"), START_SECONDS, "the volume's pod")
        assert ended["status"]["phase"] == "Succeeded", (ended["status"], logs(cluster, "volume-user"))
        return logs(cluster, "volume-user")
    finally:
        # Gone before the next pod of the same name is made.
        cluster.kubectl("delete", "pod", "volume-user", f"--namespace={JOBS}")


def claim(cluster: Cluster, name: str) -> None:
    """A claim on the cluster's storage: its default class, or the project's cluster's local volumes."""
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    if not os.environ.get("RLFLEET_KUBECONFIG"):
        spec["storageClassName"] = ""  # the project's cluster has its local volumes and no class
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                   "metadata": {"name": name, "namespace": JOBS}, "spec": spec})


def test_a_job_reads_its_model_and_data_from_a_claim_and_checkpoints_to_another(cluster, jobs_namespace):
    """spec.storage on a real kubelet: the model and data a user put on a claim are mounted read-only into the
    generator, the trainer, the reference and the critic, and the trainer's and the critic's checkpoints go to one
    folder per pod (subPathExpr) on another. The reference pod gets the trainer's weights over DDMA and scores every
    completion: each step's kl_mean comes from it; the critic values every completion token (GAE) and learns."""
    job = tiny_job("stored")
    model = {key: value for key, value in job["spec"]["model"].items() if key != "type"}
    lines = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a in range(10) for b in range(10)]
    for name in ("rl-models", "rl-checkpoints"):
        claim(cluster, name)
    # What a user does once: the model and the data put on the claim (here, built there by the project's image).
    on_volume(cluster, "rl-models", (
        "import json, pathlib, shutil; from rlfleet.workers.models import materialize; "
        "from rlfleet.workers.models.config import TinyModel; "
        f"shutil.copytree(materialize(TinyModel(**{model!r}), pathlib.Path('/tmp/build')), '/data/tiny'); "
        f"pathlib.Path('/data/sums.jsonl').write_text({chr(10).join(lines)!r})"), read_only=False)
    job["spec"] |= {
        "model": {"type": "hf", "path": "/models/tiny"},
        "data": {"type": "jsonl", "path": "/models/sums.jsonl", "heldOut": 10},
        "storage": {"volumes": [{"name": "models", "claim": "rl-models", "mountPath": "/models",
                                 "roles": ["generator", "trainer", "reference", "critic"]}],
                    "checkpointClaim": "rl-checkpoints"}}
    job["spec"]["roles"]["reference"] = {"resources": {"cpu": "100m", "memory": "2Gi"}}
    job["spec"]["roles"]["critic"] = {"resources": {"cpu": "100m", "memory": "2Gi"}}
    job["spec"]["algorithm"] |= {"steps": CHECKPOINT_EVERY + 1, "kl": {"coef": 0.1}, "advantage": "gae"}
    cluster.apply(job)
    try:
        finished = lambda: (cluster.get("rlj", "stored", JOBS).get("status") or {}).get("phase")  # noqa: E731
        eventually(lambda: finished() in ("Succeeded", "Failed"), START_SECONDS + TRAIN_SECONDS, "the stored job")
        assert finished() == "Succeeded", cluster.get("rlj", "stored", JOBS)["status"]
        run = read_run_volume(cluster, "rl-checkpoints", ("stored-trainer-0/metrics.jsonl",))
        records = [json.loads(line) for line in run["stored-trainer-0/metrics.jsonl"].splitlines()]
        steps = [r["step"] for r in records if "step" in r]
        assert max(steps) == CHECKPOINT_EVERY + 1
        assert all(r["kl_mean"] >= 0 for r in records if "step" in r and "loss" in r)
        assert [r["critic_version"] for r in records if "step" in r] == steps
        saved = on_volume(cluster, "rl-checkpoints", "import os; print(sorted(os.listdir('/data/stored-trainer-0/"
                          "checkpoints')), sorted(os.listdir('/data/stored-critic-0/critic-checkpoints')))",
                          read_only=True)
        assert f"step-{CHECKPOINT_EVERY + 1:06d}" in saved and f"step-{CHECKPOINT_EVERY + 1:08d}.pt" in saved, saved
    finally:
        cluster.kubectl("delete", "rlj", "stored", f"--namespace={JOBS}", "--ignore-not-found")
        cluster.kubectl("delete", "pvc", "rl-models", "rl-checkpoints", f"--namespace={JOBS}", "--ignore-not-found",
                        "--wait=false")


def test_a_standby_controller_leads_when_the_leaders_pod_is_deleted_and_pools_keep_their_own_nodes(
        cluster, jobs_namespace, tmp_path):
    """spec.roles.controller on a real cluster: two controller pods elect a leader by the job's Lease; the leader's
    pod deleted, the standby takes the Lease and goes on, restoring the trainer in place (no worker pod restarted).
    Then the trainer's pod is deleted: the same leader restores the new one and goes on (no other pod restarted), and
    the job trains every step once to Succeeded. Its generators are two pools, each with its own node selector
    and tensor parallelism. Deleting the job deletes its Lease."""
    job = tiny_job("fleet")
    spec = job["spec"]
    spec["algorithm"]["steps"] = FAILOVER_STEPS
    spec["storage"] = {"checkpointClaim": "rl-control"}
    spec["roles"]["controller"] = {"replicas": 2, "resources": {"cpu": "100m", "memory": "2Gi"}}
    del spec["roles"]["generator"]["replicas"]  # the pools' sum
    spec["roles"]["generator"]["pools"] = [
        {"name": "one", "tensorParallelSize": 1, "nodeSelector": {POOL_LABEL: "one"}},
        {"name": "two", "tensorParallelSize": 2, "nodeSelector": {f"{POOL_LABEL}-2": "two"}}]
    # Both pools' selectors match the one node; a pool whose selector matched no node would never start.
    cluster.kubectl("label", "nodes", "--all", f"{POOL_LABEL}=one", f"{POOL_LABEL}-2=two", "--overwrite")
    claim(cluster, "rl-control")
    cluster.apply(job)
    workers = ("fleet-trainer-0", "fleet-scorer-0", "fleet-generator-one-0", "fleet-generator-two-0")
    try:
        for name in ("fleet-generator-one", "fleet-generator-two"):
            assert eventually(lambda: cluster.get("statefulset", name, JOBS), 60, name)
        selectors = [cluster.get("statefulset", f"fleet-generator-{p}", JOBS)["spec"]["template"]["spec"][
            "nodeSelector"] for p in ("one", "two")]
        assert selectors[0][POOL_LABEL] == "one" and selectors[1][f"{POOL_LABEL}-2"] == "two", selectors
        leader = eventually(lambda: step(cluster, "fleet") > CHECKPOINT_EVERY and holder(cluster),
                            START_SECONDS + TRAIN_SECONDS, "the fleet job past its first checkpoint")
        assert "tensor_parallel_size': 2" in logs(cluster, "fleet-generator-two-0")
        before = identities(cluster, workers)
        delete_pod(cluster, leader)
        standby = eventually(lambda: (now := holder(cluster)) not in ("", leader) and now, START_SECONDS,
                             "the standby taking the Lease")
        assert standby.startswith("fleet-control-")
        with cluster.followed_logs(standby, JOBS, tmp_path / "standby.log") as followed:
            eventually(lambda: "leads as epoch" in followed.read_text(), START_SECONDS, "the standby leading")
            # At once (the job's step lags, and the steps are fast): the trainer's pod deleted mid-run.
            now = identities(cluster, workers)
            delete_pod(cluster, "fleet-trainer-0")
            assert now == before, "a worker pod restarted"
            eventually(lambda: "the trainer is restored" in followed.read_text(), START_SECONDS,
                       "the leader restoring the trainer's new pod")
            # The same leader trains on (one that lost its Lease would have ended the process whose log this is).
            eventually(lambda: re.search(r"step \d+ reward", followed.read_text().partition(
                "the trainer is restored")[2]), TRAIN_SECONDS, "the leader's next step with the trainer's new pod")
        # None: a pod scaled down, the job done.
        assert all(found in (now[name], None) for name, found in identities(cluster, workers[1:]).items()), \
            "another worker pod restarted"
        eventually(lambda: phase(cluster, "fleet") in ("Succeeded", "Failed"), TRAIN_SECONDS, "the fleet job to finish")
        assert phase(cluster, "fleet") == "Succeeded", cluster.get("rlj", "fleet", JOBS)["status"]
        run = read_run_volume(cluster, "rl-control", ("control/metrics.jsonl", "control/prompts.jsonl"))
        for name, text in run.items():
            (tmp_path / name.removeprefix("control/")).write_text(text)
        assert ledger_problems(tmp_path, FAILOVER_STEPS, spec["algorithm"]["maxStaleness"]) == []
        cluster.kubectl("delete", "rlj", "fleet", f"--namespace={JOBS}")
        eventually(lambda: not cluster.get("lease", "fleet-controller", JOBS), 120, "the job's Lease gone with it")
    finally:
        cluster.kubectl("delete", "rlj", "fleet", f"--namespace={JOBS}", "--ignore-not-found")
        cluster.kubectl("delete", "pvc", "rl-control", f"--namespace={JOBS}", "--ignore-not-found", "--wait=false")



def test_kubectl_scale_on_any_pools_statefulset_scales_that_pool_in_place(cluster, jobs_namespace):
    """`kubectl scale statefulset` on the first of two generator pools: the RLJob takes the count (an Event says so),
    the added pod joins as generator 1, in its pool's block, while the second pool's replica keeps generator 128;
    scaled back, it leaves the rotation. Nothing else restarts."""
    job = tiny_job("pools")
    del job["spec"]["roles"]["generator"]["replicas"]  # the pools' sum
    job["spec"]["roles"]["generator"]["pools"] = [{"name": "one"}, {"name": "two"}]
    cluster.apply(job)
    workers = ("pools-trainer-0", "pools-scorer-0", "pools-generator-one-0", "pools-generator-two-0")
    try:
        eventually(lambda: step(cluster, "pools") > 2, START_SECONDS + TRAIN_SECONDS, "the pools job's third step")
        before = identities(cluster, workers)
        cluster.kubectl("scale", "statefulset", "pools-generator-one", f"--namespace={JOBS}", "--replicas=2")
        eventually(lambda: [pool.get("replicas", 1) for pool in cluster.get("rlj", "pools", JOBS)["spec"]["roles"][
            "generator"]["pools"]] == [2, 1], 60, "the RLJob taking the pool's count")
        eventually(lambda: any(e["reason"] == "PoolScaled" for e in cluster.get("events", namespace=JOBS)), 60,
                   "an Event saying so")
        eventually(lambda: "generator replica 1 rejoined at version" in logs(cluster, "pools-trainer-0"),
                   START_SECONDS, "the controller joining the added generator as replica 1")
        cluster.kubectl("scale", "statefulset", "pools-generator-one", f"--namespace={JOBS}", "--replicas=1")
        eventually(lambda: "generator replica 1 removed from the job" in logs(cluster, "pools-trainer-0"),
                   START_SECONDS, "the controller leaving the removed generator out")
        log = logs(cluster, "pools-trainer-0")
        assert "replica 128 added" not in log and "replica 128 removed" not in log
        assert identities(cluster, workers) == before, "a worker pod restarted"
    finally:
        cluster.kubectl("delete", "rlj", "pools", f"--namespace={JOBS}", "--ignore-not-found")
