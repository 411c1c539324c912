"""Every object of a job in creation order, as dicts or as one YAML stream (`rlfleet render`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import yaml

from rlfleet.operator.compat import Server
from rlfleet.operator.config import OperatorConfig
from rlfleet.operator.objects import (build_configmap, build_controller_access, build_egress_policy,
                                      build_network_policy, build_service, build_token_secret)
from rlfleet.operator.workload import build_statefulset, role_sets, storage_problems
from rlfleet.workers.auth import new_token
from rlfleet.workers.plan import job_roles
from rlfleet.workers.spec import RLJob, SpecError, parse_job


def build_all(job: RLJob, config: OperatorConfig | None = None, replicas: dict[str, int] | None = None,
              token: str | None = None, server: Server | None = None) -> list[dict[str, Any]]:
    """ConfigMap, token Secret, the controllers' access, Services, StatefulSets, NetworkPolicy; `replicas` overrides
    the spec (0 when finished). The Secret holds `token`, else a new random one (kept only if the Secret does not exist
    yet). `server`: what the API server supports (default: a current one)."""
    config = config or OperatorConfig()
    objects = [build_configmap(job), build_token_secret(job, token or new_token()), *build_controller_access(job)]
    sets = [(role, pool) for role in job_roles(job) for pool in role_sets(job, role)]
    objects += [build_service(job, role, pool.name if pool else "") for role, pool in sets]
    objects += [build_statefulset(job, role, config, replicas=(replicas or {}).get(role), server=server, pool=pool)
                for role, pool in sets]
    objects.append(build_network_policy(job, config))
    return objects + [policy for policy in [build_egress_policy(job)] if policy]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the job's JSON in its ConfigMap) as readable literal blocks."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def render_job(job: RLJob, namespace: str | None = None, image: str | None = None) -> str:
    """`rlfleet render`: the manifests the operator would create (without ownerReferences, which need
    the live RLJob's uid), with the operator's defaults unless overridden. Each render holds a new token. A
    model.path or data.path that no pod would see is a SpecError, as the operator refuses it."""
    problems = storage_problems(job)
    if problems:
        raise SpecError(problems)
    if namespace:
        document = job.to_dict()
        document["metadata"] = {"name": job.metadata.name, "namespace": namespace}
        job = parse_job(document)
    config = OperatorConfig.from_env()
    if image:
        config = replace(config, image=image)
    return to_yaml(build_all(job, config))
