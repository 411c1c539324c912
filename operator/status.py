"""The RLJob status the operator writes: its schema (for the CRD) and standard Kubernetes conditions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

PHASES = ("Pending", "Running", "Suspended", "Succeeded", "Failed")
Phase = Literal["Pending", "Running", "Suspended", "Succeeded", "Failed"]


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class Condition(_Status):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str = Field(max_length=316)
    """Ready: every worker pod is ready (its reason says why not)."""
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=1024)
    """CamelCase reason, e.g. InvalidSpec, Unschedulable, ImagePullBackOff, Suspended."""
    message: str = Field(max_length=32768)
    """Human-readable details: the bad fields, the stuck pods and why."""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(None, ge=0)


class RoleStatus(_Status):
    replicas: int = 0
    """Desired pods (0 while suspended or finished)."""
    ready_replicas: int = 0
    """Pods passing their readiness probe."""


class JobStatus(_Status):
    phase: Phase | None = None
    """Pending, Running, Suspended, Succeeded or Failed."""
    conditions: list[Condition] = Field(default_factory=list)
    roles: dict[str, RoleStatus] = Field(default_factory=dict)
    """Ready and desired replicas per role."""
    ready: str | None = None
    """Ready/desired pods over all roles, e.g. 3/3."""
    step: int | None = None
    """Trainer steps done (from the controller)."""
    total_steps: int | None = None
    policy_version: int | None = None
    """Policy version the generators sample with."""
    reward_mean: float | None = None
    """Mean reward of the last trained batch."""
    restarts: int | None = None
    """Times the trainers were restarted from the last checkpoint after a failure."""
    observed_generation: int | None = None
    generator_selector: str | None = None
    """Label selector of the generator pods: the scale subresource's, for `kubectl scale` and autoscalers."""


def set_condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
                  now: str, generation: int | None = None) -> list[dict[str, Any]]:
    """Conditions with `type_` set; its lastTransitionTime moves only when its status changes."""
    previous = next((c for c in conditions if c.get("type") == type_), None)
    changed = previous is None or previous.get("status") != status
    condition = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": now if changed else previous.get("lastTransitionTime", now),
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return [c for c in conditions if c.get("type") != type_] + [condition]
