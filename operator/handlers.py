"""kopf handlers: thin. Parse the job, build the objects (pure), create-or-patch them, move the status.

Run with `python -m rlfleet.operator` (or `kopf run -A -m rlfleet.operator.handlers`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
from typing import Any, Callable

import kopf

from rlfleet.operator import GROUP, PLURAL, VERSION, assess, kueue, metrics
from rlfleet.operator.apply import NotOwned, apply, owned, refuse_others
from rlfleet.operator.compat import server_of
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.policy import PodPolicy
from rlfleet.operator.kube import Kube, collection_path, login
from rlfleet.operator.names import configmap_name, role_name, selector
from rlfleet.operator.objects import JOB_FILE
from rlfleet.operator.progress import controller_address, job_token, read_progress
from rlfleet.operator.render import build_all
from rlfleet.operator.scaled import REPLICAS_ANNOTATION, refusal, scaled_by_hand, scaled_fields
from rlfleet.operator.workload import role_sets, storage_problems, template_hash
from rlfleet.workers.environment.loading import environment_source_problems
from rlfleet.workers.generator.pools import Pool, renumbering
from rlfleet.workers.plan import job_roles, replicas
from rlfleet.workers.scorer.python import source_problems
from rlfleet.workers.spec import RLJob, SpecError, parse_job

STATUS_INTERVAL = float(os.environ.get("RLFLEET_STATUS_INTERVAL_SECONDS", "10"))
# A job blocked by another owner's object looks again this often: it starts once that object is removed.
NOT_OWNED_RETRY_SECONDS = 60
RESOURCE = (GROUP, VERSION, PLURAL)


@kopf.on.login()
def authenticate(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """kopf and the operator's own client log in the same way (service account in a pod, else kubeconfig),
    decided at start rather than by which client libraries happen to be installed."""
    return login(settings)


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # Progress in annotations: the status schema is structural and would prune kopf's own status fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    # Peering pauses every operator that sees a peer of equal priority: replicas must differ.
    settings.peering.priority = random.SystemRandom().randint(1, 1_000_000)
    memo.config = OperatorConfig.from_env()
    memo.kube = Kube(login(settings), settings)
    # Objects are built for this server: older ones get fallbacks, and every difference is said once here.
    memo.server = server_of(await memo.kube.get("version"))
    for notice in memo.server.notices():
        logger.warning(notice)
    if os.environ.get("RLFLEET_OPERATOR_METRICS_PORT"):
        metrics.serve(int(os.environ["RLFLEET_OPERATOR_METRICS_PORT"]))


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "kube", None) is not None:
        await memo.kube.close()


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
@metrics.count_errors("reconcile")
async def reconcile(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo,
                    logger: logging.Logger, **_: Any) -> None:
    """Create or patch every object of the job; an invalid job creates nothing."""
    job = load_or_refuse(body, status, patch, memo.config.policy)
    if moved := renumbered(await running_job(memo.kube, job), job):
        refuse(body, status, patch, *moved)
    queue, workload = await queued_workload(memo.kube, job, body)
    # A queued job's pods wait, all of them, until Kueue admits its Workload.
    held = queue is not None and kueue.admission(workload) != "admitted"
    if not (held or job.spec.suspend or assess.is_terminal(dict(status))):
        job = await take_scaled_pools(memo.kube, job, body, await generator_sets(memo.kube, job))
    scaled = {role: 0 for role in job_roles(job)} if assess.is_terminal(dict(status)) or held else None
    objects = build_all(job, memo.config, scaled, server=memo.server)
    if queue:
        objects.append(kueue.build_workload(job, queue, [o for o in objects if o["kind"] == "StatefulSet"]))
    objects = [owned(obj, _owner(body)) for obj in objects]
    try:
        await refuse_others(memo.kube, objects)
    except NotOwned as error:
        refuse_not_owned(body, status, patch, str(error))
    for obj in objects:
        applied = await apply(memo.kube, obj)
        metrics.OBJECT_WRITES.labels(obj["kind"], applied.action).inc()
        if applied.action != "unchanged":
            logger.info("%s %s %s", applied.action, obj["kind"], obj["metadata"]["name"])
        if obj["metadata"]["name"] == role_name(job, "trainer") and obj["kind"] == "StatefulSet" \
                and applied.before is not None and template_hash(applied.before) != template_hash(obj):
            # OnDelete: the ranks restart together (from the checkpoint), never one by one.
            await restart_trainers(memo.kube, job, logger)
    if workload is not None and workload.get("spec", {}).get("active", True) == job.spec.suspend:
        await memo.kube.merge_patch(workload_path(job), kueue.active_patch(job))
    fresh = assess.initial_status(job, dict(status), _now(), body.meta.get("generation"))
    patch.status.update(assess.changed_fields(dict(status), fresh))
    metrics.RECONCILES.labels("ok").inc()
    metrics.set_phase(_key(body), fresh.get("phase"))


@kopf.timer(*RESOURCE, interval=STATUS_INTERVAL)
@metrics.count_errors("refresh_status")
async def refresh_status(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo,
                         logger: logging.Logger, **_: Any) -> None:
    """Status from the StatefulSets, the pods and the controller; then scale or restart as it says."""
    try:
        job = load(body)
    except SpecError as error:
        keep_refused(body, status, patch, assess.INVALID_SPEC, error.problems)
        return
    # Assessed as a job that runs, a refused one would read Pending over reconcile's Failed.
    if refused := refusal_of(job, memo.config.policy) or renumbered(await running_job(memo.kube, job), job):
        keep_refused(body, status, patch, *refused)
        return
    generators = await generator_sets(memo.kube, job)
    seen = await observe(memo.kube, job, generators)
    queue, workload = await queued_workload(memo.kube, job, body)
    if queue:
        seen.admission = kueue.admission(workload)
    if not (job.spec.suspend or assess.is_terminal(dict(status))):
        token = await job_token(memo.kube, job)
        if token is not None:
            seen.progress = await read_progress(await controller_address(memo.kube, job), job.metadata.name, token)
        if seen.progress is None:
            metrics.CONTROLLER_UNREACHABLE.inc()
    if not (job.spec.suspend or assess.is_terminal(dict(status))) and seen.admission in (None, "admitted"):
        job = await take_scaled_pools(memo.kube, job, body, generators)
    result = assess.assess(job, dict(status), seen, _now(), body.meta.get("generation"))
    for kind, reason, message in result.events:
        kopf.event(body, type=kind, reason=reason, message=message)  # kopf.info would drop it: posting.level
    if result.scale_to_zero:
        await scale_to_zero(memo.kube, job)
    if result.scale_up:
        await scale_to_spec(memo.kube, job)
    if workload is not None:
        terminal = result.status.get("phase") if assess.is_terminal(result.status) else None
        told = kueue.status_patch(workload, terminal, _now())
        if told is not None:
            await memo.kube.merge_patch(f"{workload_path(job)}/status", told)
    if result.restart_trainers:
        metrics.TRAINER_RESTARTS.inc()
        await restart_trainers(memo.kube, job, logger)
    patch.status.update(assess.changed_fields(dict(status), result.status))
    metrics.STATUS_UPDATES.labels(result.status.get("phase", "unchanged")).inc()
    metrics.set_phase(_key(body), result.status.get("phase", status.get("phase")))


@kopf.on.delete(*RESOURCE, optional=True)  # optional: no finalizer, deletion never waits for the operator
async def forget(body: kopf.Body, **_: Any) -> None:
    metrics.set_phase(_key(body), None)


def load(body: kopf.Body) -> RLJob:
    """The job as the workers will see it: pydantic is the authority, the CRD schema only a first check."""
    document = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": body.meta["name"], "namespace": body.meta["namespace"]},
    }
    if "spec" in body:
        # As stored, not body.spec: kopf's view reads a list as {} (a default job) and fails on a string.
        document["spec"] = json.loads(json.dumps(body["spec"]))
    return parse_job(document)


def load_or_refuse(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, policy: PodPolicy) -> RLJob:
    """The job, if its spec is valid, its pods see what they need (model.path and data.path on volumes they mount,
    the controllers' shared run directory), and the cluster's pod policy allows what it asks for."""
    try:
        job = load(body)
    except SpecError as error:
        refuse(body, status, patch, assess.INVALID_SPEC, error.problems)
    if refused := refusal_of(job, policy):
        refuse(body, status, patch, *refused)
    return job


def refusal_of(job: RLJob, policy: PodPolicy) -> tuple[str, list[str]] | None:
    """(reason, problems) for a job that parses but is refused all the same; None for one that may run."""
    if unmounted := storage_problems(job):
        return assess.INVALID_SPEC, unmounted
    if problems := policy.problems(job):
        return assess.REFUSED_BY_POLICY, problems
    if problems := source_problems(job.spec.scorers) + environment_source_problems(job.spec.roles.environment):
        return assess.INVALID_SPEC, problems
    return None


def renumbered(running: RLJob | None, job: RLJob) -> tuple[str, list[str]] | None:
    """(reason, problems) for a job whose pools, reshaped, would move a running generator replica to another pool;
    None where none would move. A suspended job has no generator running: it may reshape its pools freely."""
    if running is None or running.spec.suspend or not (moved := renumbering(running.spec, job.spec)):
        return None
    return assess.INVALID_SPEC, [moved]


def keep_refused(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, reason: str, problems: list[str]) -> None:
    """The timer's part in a refusal: the status says it again (no second Warning) where a tick that began before
    reconcile refused wrote over it, as timers run beside the handlers."""
    fresh = assess.refused_status(problems, dict(status), _now(), body.meta.get("generation"), reason)
    patch.status.update(assess.changed_fields(dict(status), fresh))


def refuse(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, reason: str, problems: list[str]) -> None:
    """Nothing is created: Failed, Ready=False with `reason` and the problems, a Warning event; not retried."""
    metrics.RECONCILES.labels("invalid" if reason == assess.INVALID_SPEC else "refused").inc()
    metrics.set_phase(_key(body), "Failed")
    patch.status.update(assess.refused_status(problems, dict(status), _now(), body.meta.get("generation"), reason))
    kopf.warn(body, reason=reason, message="; ".join(problems)[:1024])
    raise kopf.PermanentError(f"{reason}: {'; '.join(problems)}")


def refuse_not_owned(body: kopf.Body, status: kopf.Status, patch: kopf.Patch, problem: str) -> None:
    """Another owner's object stands at a name the job needs: nothing is written, the status and an Event say which,
    and the job is looked at again later."""
    metrics.RECONCILES.labels("not_owned").inc()
    metrics.set_phase(_key(body), "Failed")
    patch.status.update(assess.not_owned_status(problem, dict(status), _now(), body.meta.get("generation")))
    kopf.warn(body, reason=assess.NOT_OWNED, message=problem[:1024])
    raise kopf.TemporaryError(f"not owned: {problem}", delay=NOT_OWNED_RETRY_SECONDS)


async def running_job(kube: Kube, job: RLJob) -> RLJob | None:
    """The job as its workers run it now (its ConfigMap's), or None before it is created or when unreadable."""
    found = await kube.get(f"{collection_path('v1', 'ConfigMap', job.metadata.namespace)}/{configmap_name(job)}")
    try:
        return parse_job(json.loads(found["data"][JOB_FILE])) if found else None
    except (KeyError, TypeError, ValueError):  # SpecError is a ValueError: a job an older operator wrote
        return None


async def generator_sets(kube: Kube, job: RLJob) -> dict[str, dict[str, Any] | None]:
    """Each generator pool's StatefulSet as it is now (None: not created yet), by pool name ("" without pools)."""
    sets_path = collection_path("apps/v1", "StatefulSet", job.metadata.namespace)
    return {pool.name: await kube.get(f"{sets_path}/{role_name(job, 'generator', pool.name)}")
            for pool in role_sets(job, "generator")}


async def observe(kube: Kube, job: RLJob, generators: dict[str, dict[str, Any] | None]) -> assess.Observed:
    """The job's StatefulSets (the generator pools' as `generator_sets` read them, summed) and pods."""
    namespace = job.metadata.namespace
    sets_path = collection_path("apps/v1", "StatefulSet", namespace)
    statefulsets = {role: await kube.get(f"{sets_path}/{role_name(job, role)}")
                    for role in job_roles(job) if role != "generator"}
    found = list(generators.values())
    statefulsets["generator"] = found[0] if len(found) == 1 else assess.pooled(found)
    pods = await kube.list(collection_path("v1", "Pod", namespace), selector(job))
    return assess.Observed(statefulsets, pods)


async def scale_to_zero(kube: Kube, job: RLJob) -> None:
    await _scale(kube, job, lambda _role, _pool: 0)


async def scale_to_spec(kube: Kube, job: RLJob) -> None:
    await _scale(kube, job, lambda role, pool: pool.count if pool is not None else replicas(job, role))


async def _scale(kube: Kube, job: RLJob, wanted: Callable[[str, Pool | None], int]) -> None:
    """Every StatefulSet of the job (one per generator pool) to `wanted(role, pool)` pods."""
    sets_path = collection_path("apps/v1", "StatefulSet", job.metadata.namespace)
    for role in job_roles(job):
        for pool in role_sets(job, role):
            count = wanted(role, pool)
            await kube.merge_patch(f"{sets_path}/{role_name(job, role, pool.name if pool else '')}",
                                   {"metadata": {"annotations": {REPLICAS_ANNOTATION: str(count)}},
                                    "spec": {"replicas": count}})


async def take_scaled_pools(kube: Kube, job: RLJob, body: kopf.Body,
                            sets: dict[str, dict[str, Any] | None]) -> RLJob:
    """A generator StatefulSet (of `sets`, `generator_sets`) scaled by someone else scales its pool: the RLJob takes
    the count (its update then reconciles the endpoints, which the controller follows); returns the job with it. A
    count the job cannot hold is scaled back, saying why. Called before every reconcile and status refresh of a
    running job, so neither writes the StatefulSet back first."""
    sets_path = collection_path("apps/v1", "StatefulSet", job.metadata.namespace)
    taken = scaled_by_hand(job, sets)
    if not taken:
        return job
    document = json.loads(json.dumps(dict(body)))
    fields = scaled_fields(document["spec"], taken)
    document["spec"]["roles"]["generator"].update(fields)
    try:
        scaled = parse_job(document)
    except SpecError as error:
        for refused in taken:
            await kube.merge_patch(f"{sets_path}/{role_name(job, 'generator', refused.pool.name)}",
                                   {"spec": {"replicas": refused.pool.count}})
        kopf.warn(body, reason="ScaleRefused", message=refusal(error.problems, taken))
        return job
    path = f"{collection_path(f'{GROUP}/{VERSION}', 'RLJob', job.metadata.namespace)}/{job.metadata.name}"
    await kube.merge_patch(path, {"spec": {"roles": {"generator": fields}}})
    for taken_pool in taken:
        kopf.event(body, type="Normal", reason="PoolScaled", message=taken_pool.message())
    return scaled


async def queued_workload(kube: Kube, job: RLJob, body: kopf.Body) -> tuple[str | None, dict[str, Any] | None]:
    """The Kueue queue the job is labelled with, and its Workload as it is now (None until created)."""
    queue = kueue.queue_of(body.meta.get("labels"))
    return queue, (await kube.get(workload_path(job)) if queue else None)


def workload_path(job: RLJob) -> str:
    return f"{collection_path(kueue.API_VERSION, kueue.KIND, job.metadata.namespace)}/{kueue.workload_name(job)}"


async def restart_trainers(kube: Kube, job: RLJob, logger: logging.Logger) -> None:
    """Delete every trainer pod: all ranks start again together and resume from the last checkpoint."""
    pods_path = collection_path("v1", "Pod", job.metadata.namespace)
    for rank in range(replicas(job, "trainer")):
        await kube.delete(f"{pods_path}/{role_name(job, 'trainer')}-{rank}")
    logger.warning("restarting the trainers of %s from the last checkpoint", job.metadata.name)


def _key(body: kopf.Body) -> str:
    return f"{body.meta['namespace']}/{body.meta['name']}"


def _owner(body: kopf.Body) -> dict[str, Any]:
    return {"apiVersion": body["apiVersion"], "kind": body["kind"],
            "metadata": {"name": body.meta["name"], "uid": body.meta["uid"]}}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
