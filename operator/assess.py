"""Pure: from what the cluster shows (StatefulSets, pods, the controller's progress) to the job's status and
what to do about it (scale to zero, restart the trainers). The kopf timer only gathers inputs and acts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfleet.operator import kueue, names
from rlfleet.operator.names import ROLE_LABEL
from rlfleet.operator.status import set_condition
from rlfleet.workers.plan import job_roles, role_spec
from rlfleet.workers.spec import RLJob, uncorrected_quantization

READY = "Ready"
RESTART_LIMIT = "RestartLimitExceeded"
INVALID_SPEC = "InvalidSpec"
NOT_OWNED = "ObjectNotOwned"
"""An object at a name the job needs belongs to another owner: the operator writes nothing until it is gone."""
REFUSED_BY_POLICY = "RefusedByPolicy"
"""The job asks for what the operator's pod policy (operator/policy.py) refuses: nothing is created."""
# Said by reconcile, which alone decides them (and clears them): the status timer leaves them standing.
REFUSALS = (NOT_OWNED, REFUSED_BY_POLICY)
QUEUED = "Queued"
CORRECTED = "OffPolicyCorrected"
"""Whether the loss corrects the log-prob gap of quantized generators (set only for a job that quantizes)."""
IMAGE_ERRORS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
START_ERRORS = {"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class Progress:
    """What the controller's gRPC Status call reported."""

    phase: str
    step: int
    total_steps: int
    policy_version: int
    reward_mean: float


@dataclass
class Observed:
    statefulsets: dict[str, dict[str, Any] | None]
    pods: list[dict[str, Any]]
    progress: Progress | None = None
    admission: kueue.Admission | None = None
    """Where Kueue stands with the job's Workload (None: the job is not queued)."""


@dataclass
class Assessment:
    status: dict[str, Any]
    scale_to_zero: bool = False
    scale_up: bool = False
    """Kueue admitted the job: its StatefulSets get their spec's replicas."""
    restart_trainers: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message) of Kubernetes events to post."""


def is_terminal(status: dict[str, Any]) -> bool:
    """Succeeded, or Failed after the restart budget: kept at zero replicas until the job is deleted."""
    if status.get("phase") == "Succeeded":
        return True
    ready = _condition(status, READY)
    return status.get("phase") == "Failed" and ready is not None and ready.get("reason") == RESTART_LIMIT


def initial_status(job: RLJob, previous: dict[str, Any], now: str, generation: int | None) -> dict[str, Any]:
    """Status right after (re)creating the objects: the timer fills in the rest."""
    if is_terminal(previous):
        return {}
    conditions = corrected(job, list(previous.get("conditions") or []), now, generation)
    if job.spec.suspend:
        conditions = set_condition(conditions, READY, "False", "Suspended",
                                   "every role scaled to zero; checkpoints kept", now, generation)
        return {"phase": "Suspended", "conditions": conditions}
    if previous.get("phase") in (None, "Failed", "Suspended"):
        conditions = set_condition(conditions, READY, "False", "Starting", "creating worker pods", now, generation)
        return {"phase": "Pending", "conditions": conditions}
    return {"conditions": conditions}


def corrected(job: RLJob, conditions: list[dict[str, Any]], now: str, generation: int | None) -> list[dict[str, Any]]:
    """`conditions` with OffPolicyCorrected for a job whose generators quantize: False, with the fix, when its loss
    corrects nothing (spec.uncorrected_quantization); none for a job that does not quantize."""
    generator = job.spec.roles.generator
    if generator.quantization == "none" and generator.kv_cache_dtype == "auto":
        return [c for c in conditions if c.get("type") != CORRECTED]
    problem = uncorrected_quantization(job.spec)
    if problem:
        return set_condition(conditions, CORRECTED, "False", "QuantizedWithoutCorrection", problem, now, generation)
    return set_condition(conditions, CORRECTED, "True", "ImportanceWeighted",
                         f"algorithm.loss {job.spec.algorithm.loss.type} weights each token by pi/mu", now, generation)


def not_owned_status(problem: str, previous: dict[str, Any], now: str, generation: int | None) -> dict[str, Any]:
    conditions = set_condition(list(previous.get("conditions") or []), READY, "False", NOT_OWNED, problem, now,
                               generation)
    return {"phase": "Failed", "conditions": conditions, "observedGeneration": generation}


def refused_status(problems: list[str], previous: dict[str, Any], now: str, generation: int | None,
                   reason: str = INVALID_SPEC) -> dict[str, Any]:
    conditions = set_condition(list(previous.get("conditions") or []), READY, "False", reason,
                               "; ".join(problems), now, generation)
    return {"phase": "Failed", "conditions": conditions, "observedGeneration": generation}


def assess(job: RLJob, previous: dict[str, Any], seen: Observed, now: str, generation: int | None) -> Assessment:
    roles = role_counts(job, seen.statefulsets)
    ready = sum(r["readyReplicas"] for r in roles.values())
    desired = sum(r["replicas"] for r in roles.values())
    restarts = previous.get("restarts") or 0
    selector = ",".join(f"{key}={value}" for key, value in sorted(names.selector(job, "generator").items()))
    status: dict[str, Any] = {"roles": roles, "ready": f"{ready}/{desired}", "restarts": restarts,
                              "observedGeneration": generation, "generatorSelector": selector}
    status |= _progress_fields(seen.progress)
    result = Assessment(status)

    def conclude(phase: str, ready_status: str, reason: str, message: str) -> Assessment:
        status["phase"] = phase
        status["conditions"] = set_condition(list(previous.get("conditions") or []), READY, ready_status,
                                             reason, message, now, generation)
        return result

    if is_terminal(previous):
        status.pop("conditions", None)
        status["phase"] = previous["phase"]
        result.scale_to_zero = desired > 0
        return result
    if (_condition(previous, READY) or {}).get("reason") in REFUSALS:
        return result
    if job.spec.suspend:
        return conclude("Suspended", "False", "Suspended", "every role scaled to zero; checkpoints kept")
    if seen.admission in ("pending", "evicted"):
        result.scale_to_zero = desired > 0
        return conclude("Pending", "False", QUEUED, f"{seen.admission} in Kueue: no worker pod runs until Kueue "
                        "admits the job's Workload (all its pods at once)")
    if seen.admission == "admitted" and desired == 0:
        result.scale_up = True
        return conclude("Pending", "False", "Starting", "admitted by Kueue: creating worker pods")
    if _finished(job, seen):
        result.scale_to_zero = True
        # Rank 0 exits once every step is trained, often before the timer's next Status call: the status
        # would keep the step of the last call (seen on a real cluster: Succeeded at step 145 of 150).
        status["step"] = status["totalSteps"] = job.spec.algorithm.steps
        result.events.append(("Normal", "Succeeded", f"trained {job.spec.algorithm.steps} steps"))
        return conclude("Succeeded", "False", "Succeeded", "training finished; every role scaled to zero")
    failures = trainer_failures(seen.pods)
    if failures:
        status["restarts"] = restarts + 1
        message = "; ".join(failures)
        if restarts + 1 > job.spec.failure_policy.max_restarts:
            result.scale_to_zero = True
            result.events.append(("Warning", RESTART_LIMIT, message))
            limit = job.spec.failure_policy.max_restarts
            return conclude("Failed", "False", RESTART_LIMIT, f"trainer failed after {limit} restarts: {message}")
        result.restart_trainers = True
        result.events.append(("Warning", "TrainerRestarting", f"restart {restarts + 1} from the last checkpoint: {message}"))
        return conclude("Pending", "False", "TrainerRestarting", message)
    if desired and ready == desired:
        return conclude("Running", "True", "AllPodsReady", f"{ready}/{desired} worker pods ready")
    problems = pod_problems(seen.pods)
    if problems:
        return conclude("Pending", "False", problems[0][0], "; ".join(text for _, text in problems))
    return conclude("Pending", "False", "PodsNotReady", f"{ready}/{desired} worker pods ready")


def changed_fields(current: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The part of new that differs from current: a status write per timer tick would wake every watcher."""
    return {key: value for key, value in new.items()
            if current.get(key) != value and not (value is None and key not in current)}


def pooled(statefulsets: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The StatefulSets of a role's pools as one: their replicas and ready replicas summed (None: none exists)."""
    found = [s for s in statefulsets if s]
    if not found:
        return None
    return {"spec": {"replicas": sum((s.get("spec") or {}).get("replicas") or 0 for s in found)},
            "status": {"readyReplicas": sum((s.get("status") or {}).get("readyReplicas") or 0 for s in found)}}


def role_counts(job: RLJob, statefulsets: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, int]]:
    counts = {}
    for role in job_roles(job):
        found = statefulsets.get(role) or {}
        wanted = (found.get("spec") or {}).get("replicas")
        if wanted is None:
            wanted = 0 if job.spec.suspend else role_spec(job, role).replicas
        counts[role] = {"replicas": wanted, "readyReplicas": (found.get("status") or {}).get("readyReplicas") or 0}
    return counts


def trainer_failures(pods: list[dict[str, Any]]) -> list[str]:
    """'pod: exit code' for every trainer container that exited non-zero (a restart follows)."""
    found = []
    for pod in _live(pods, "trainer"):
        for state in _terminations(pod):
            if state.get("exitCode", 0) != 0:
                reason = state.get("reason") or "Error"
                found.append(f"{pod['metadata']['name']} exited with code {state['exitCode']} ({reason})")
                break
    return found


def pod_problems(pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(reason, message) for pods that cannot be scheduled or whose containers cannot start."""
    problems = []
    for pod in _live(pods):
        name, status = pod["metadata"]["name"], pod.get("status") or {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                problems.append((condition.get("reason") or "Unschedulable",
                                 f"{name} unschedulable: {condition.get('message', '')}".strip()))
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in IMAGE_ERRORS or reason in START_ERRORS:
                problems.append((reason, f"{name}: {reason}: {waiting.get('message', '')}".rstrip(": ")))
    return problems


def _finished(job: RLJob, seen: Observed) -> bool:
    """The controller said so, or the process that leads the loop exited 0 (it does only once every step is
    trained): trainer rank 0, or with spec.roles.controller any controller pod (a standby that leads a finished run
    exits 0 at once)."""
    if seen.progress is not None and seen.progress.phase == "Succeeded":
        return True
    if job.spec.roles.controller is not None:
        leaders = _live(seen.pods, "control")
    else:
        first = f"{job.metadata.name}-trainer-0"
        leaders = [pod for pod in _live(seen.pods, "trainer") if pod["metadata"]["name"] == first]
    return any(state.get("exitCode") == 0 for pod in leaders for state in _terminations(pod))


def _terminations(pod: dict[str, Any]) -> list[dict[str, Any]]:
    states = []
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        for key in ("state", "lastState"):
            terminated = (container.get(key) or {}).get("terminated")
            if terminated:
                states.append(terminated)
    return states


def _live(pods: list[dict[str, Any]], role: str | None = None) -> list[dict[str, Any]]:
    """Pods not being deleted (a deleted pod's exit code is the operator's own doing), of role if given."""
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")
            and (role is None or (p["metadata"].get("labels") or {}).get(ROLE_LABEL) == role)]


def _progress_fields(progress: Progress | None) -> dict[str, Any]:
    if progress is None:
        return {}
    return {"step": progress.step, "totalSteps": progress.total_steps,
            "policyVersion": progress.policy_version, "rewardMean": progress.reward_mean}


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)
