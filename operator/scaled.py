"""Generator StatefulSets scaled by hand (`kubectl scale statefulset <job>-generator-<pool>`, or an autoscaler pointed
at one) scale their pool: the RLJob takes the count, so the operator keeps it and the controller follows.

Every StatefulSet the operator writes carries the replicas it set (REPLICAS_ANNOTATION, in the same write as
spec.replicas): a generator StatefulSet whose spec.replicas differs was scaled by someone else. Pure: the handlers
read the StatefulSets and write the RLJob.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from rlfleet.workers.generator.pools import Pool, generator_pools
from rlfleet.workers.spec import RLJob

REPLICAS_ANNOTATION = "rlfleet.io/replicas"


@dataclass(frozen=True)
class Scaled:
    index: int | None
    """The pool's place in spec.roles.generator.pools; None for a job without pools."""
    pool: Pool
    replicas: int
    """What its StatefulSet was scaled to."""

    @property
    def field(self) -> str:
        return f"spec.roles.generator{'' if self.index is None else f'.pools[{self.index}]'}.replicas"

    def message(self) -> str:
        return (f"generator pool {self.pool.name or '(the role)'}'s StatefulSet was scaled to {self.replicas}: "
                f"{self.field} is {self.replicas} now")


def refusal(problems: list[str], taken: list[Scaled]) -> str:
    """The Warning of counts the job cannot hold (its validation's `problems`): each StatefulSet is scaled back."""
    kept = ", ".join(f"{scaled.field} stays {scaled.pool.count}" for scaled in taken)
    return f"{'; '.join(problems)}: {kept} (its StatefulSet is scaled back)"[:1024]


def scaled_by_hand(job: RLJob, sets: dict[str, dict[str, Any] | None]) -> list[Scaled]:
    """The generator pools whose StatefulSet (`sets`, by pool name; None where absent) was scaled by someone else
    than the operator: its spec.replicas differs from the count the operator wrote with it, and from the job's."""
    listed = bool(job.spec.roles.generator.pools)
    found = []
    for index, pool in enumerate(generator_pools(job.spec)):
        statefulset = sets.get(pool.name)
        if statefulset is None:
            continue
        written = (statefulset["metadata"].get("annotations") or {}).get(REPLICAS_ANNOTATION)
        replicas = statefulset.get("spec", {}).get("replicas")
        # Once the job has taken the count, its reconcile writes the StatefulSet again: not taken twice.
        if written is not None and isinstance(replicas, int) and str(replicas) != written and replicas != pool.count:
            found.append(Scaled(index if listed else None, pool, replicas))
    return found


def scaled_fields(spec: dict[str, Any], taken: list[Scaled]) -> dict[str, Any]:
    """The fields of the stored RLJob's spec.roles.generator that give each pool of `taken` its StatefulSet's
    count, for a merge patch: it replaces a list whole, so the pools come back whole, with the role's replicas (their
    sum) when the job states it."""
    generator = copy.deepcopy(spec["roles"]["generator"])
    fields: dict[str, Any] = {}
    for scaled in taken:
        if scaled.index is None:
            fields["replicas"] = scaled.replicas
        else:
            generator["pools"][scaled.index]["replicas"] = scaled.replicas
            fields["pools"] = generator["pools"]
    if "pools" in fields and "replicas" in generator:
        fields["replicas"] = sum(pool.get("replicas", 1) for pool in generator["pools"])
    return fields
