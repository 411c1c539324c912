"""What the cluster admin lets a job's pods do beyond the defaults (Helm values `policy.*`, via env): pure.

A job may ask for host paths, the node's network and environment variables that change what a process loads; any
of them reaches past the pod (the node's files, its ports, code run inside every worker), so each is refused unless
the operator's deployment allows it. The job's author is not the cluster's admin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import PurePosixPath

from rlfleet.workers.executors import BY_ROLE
from rlfleet.workers.plan import job_roles, role_spec
from rlfleet.workers.spec import RLJob, Roles

# Variables that make a dynamic loader, the Python interpreter or a shell load or run other code.
LOADER_ENV = frozenset({"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH", "PYTHONPATH", "PYTHONHOME",
                        "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONBREAKPOINT", "PYTHONWARNINGS", "PYTHONINSPECT",
                        "PYTHONEXECUTABLE", "BASH_ENV", "ENV"})


@dataclass(frozen=True)
class PodPolicy:
    host_paths: tuple[str, ...] = ()
    """Node directories a job's hostPath volumes may name (each, or below it); empty: no hostPath at all."""
    writable_host_paths: bool = False
    """Whether such a volume may be mounted writable (readOnly: false)."""
    host_network: bool = False
    """Whether a role may run on its node's network (roles.*.hostNetwork)."""
    allowed_env: frozenset[str] = frozenset()
    """Loader variables (LOADER_ENV) a job may set after all."""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PodPolicy:
        """RLFLEET_POLICY_HOST_PATHS and RLFLEET_POLICY_ALLOWED_ENV (comma-separated),
        RLFLEET_POLICY_WRITABLE_HOST_PATHS and RLFLEET_POLICY_HOST_NETWORK ("true" allows)."""
        env = os.environ if environ is None else environ

        def listed(name: str) -> list[str]:
            return [item.strip() for item in env.get(name, "").split(",") if item.strip()]

        return cls(host_paths=tuple(listed("RLFLEET_POLICY_HOST_PATHS")),
                   writable_host_paths=env.get("RLFLEET_POLICY_WRITABLE_HOST_PATHS", "").lower() == "true",
                   host_network=env.get("RLFLEET_POLICY_HOST_NETWORK", "").lower() == "true",
                   allowed_env=frozenset(listed("RLFLEET_POLICY_ALLOWED_ENV")))

    def problems(self, job: RLJob) -> list[str]:
        """What the job asks for that this policy refuses, each naming its field and the value that would allow it."""
        found = []
        for index, volume in enumerate(job.spec.storage.volumes):
            if volume.host_path is None:
                continue
            where = f"spec.storage.volumes[{index}]"
            if not self.allows_host_path(volume.host_path):
                found.append(f"{where}.hostPath: {volume.host_path!r} is not under a host path the cluster allows "
                             f"({', '.join(self.host_paths) or 'none'}; Helm value policy.hostPaths)")
            if not volume.read_only and not self.writable_host_paths:
                found.append(f"{where}.readOnly: a writable hostPath is refused (Helm value "
                             "policy.writableHostPaths)")
        for role in job_roles(job):
            spec, where = role_spec(job, role), f"spec.roles.{_alias(role)}"
            if spec.host_network and not self.host_network:
                found.append(f"{where}.hostNetwork: the node's network is refused (Helm value policy.hostNetwork)")
            for name in sorted(set(spec.env) & (LOADER_ENV - self.allowed_env)):
                found.append(f"{where}.env.{name}: changes what the workers load or run, refused (Helm value "
                             "policy.allowedEnv)")
        return found

    def allows_host_path(self, path: str) -> bool:
        # Compared by whole segments, after collapsing '.' and '..': /data2 is not under /data, /data/../etc neither.
        wanted = PurePosixPath(os.path.normpath(path))
        return any(wanted.is_relative_to(os.path.normpath(allowed)) for allowed in self.host_paths)


def _alias(role: str) -> str:
    """The role's key in spec.roles as a job spells it (rewardModel, not reward_model)."""
    field = BY_ROLE[role].spec_field
    return Roles.model_fields[field].alias or field
