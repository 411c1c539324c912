"""Storage on a cluster (`spec.storage`): volumes the job's pods mount, the claim fetched URIs share, where the
trainer's checkpoints go. Torch-free: part of the RLJob schema. `rlfleet run` reads paths as they are."""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import Field, model_validator

from rlfleet.workers.executors import ROLES
from rlfleet.workers.strict import Strict

# A PersistentVolumeClaim's or a Secret's name (a DNS subdomain).
OBJECT_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
ABSOLUTE = r"^/"
# Where every pod mounts its own volumes (operator/workload.py): a job's volume may not hide one.
POD_PATHS = ("/etc/rlfleet", "/var/lib/rlfleet/run", "/var/cache/rlfleet", "/tmp", "/dev/shm",
             "/var/run/secrets/rlfleet")


class Nfs(Strict):
    server: str = Field(min_length=1, max_length=253)
    """NFS server host name or address."""
    path: str = Field(pattern=ABSOLUTE, max_length=4096)
    """Exported path."""


class Volume(Strict):
    """One of: an existing PersistentVolumeClaim (shared, e.g. ReadOnlyMany), a path on the node, an NFS export."""

    name: str = Field(pattern=r"^[a-z]([-a-z0-9]{0,40}[a-z0-9])?$")
    """Short name (a DNS label of at most 42 characters); the pods' volume is `data-<name>`."""
    mount_path: str = Field(pattern=ABSOLUTE, max_length=4096)
    """Where the pods see it: model.path and data.path name files under it."""
    claim: str | None = Field(None, pattern=OBJECT_NAME)
    """An existing PersistentVolumeClaim in the job's namespace."""
    host_path: str | None = Field(None, pattern=ABSOLUTE, max_length=4096)
    """A directory on every node the pods may run on."""
    nfs: Nfs | None = None
    """An NFS export."""
    read_only: bool = True
    """Mounted read-only (models and data); false for a volume the workers write."""
    roles: list[Literal[ROLES]] = Field(
        default_factory=lambda: list(ROLES), min_length=1, max_length=len(ROLES))
    """The roles whose pods mount it (all by default)."""

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        if sum(source is not None for source in (self.claim, self.host_path, self.nfs)) != 1:
            raise ValueError("set exactly one of claim, hostPath and nfs")
        path = self.mount_path.rstrip("/") + "/"
        hidden = [p for p in POD_PATHS if path.startswith(p + "/") or (p + "/").startswith(path)]
        if hidden:
            raise ValueError(f"mountPath {self.mount_path!r} overlaps {hidden[0]}, where the pods keep their "
                             "own files: mount it elsewhere (e.g. /models, /data)")
        return self


class Storage(Strict):
    volumes: list[Volume] = Field(default_factory=list, max_length=32)
    """Mounted into the pods of the roles each names."""
    cache_claim: str | None = Field(None, pattern=OBJECT_NAME)
    """An existing claim (ReadWriteMany across nodes) for the worker cache: model.uri and data.uri are fetched into
    it once for every pod and every later job. Unset, each pod fetches into its own emptyDir."""
    checkpoint_claim: str | None = Field(None, pattern=OBJECT_NAME)
    """An existing claim for the trainers' run directories (checkpoints), one folder per pod; it may be one of
    the volumes' claims (the critic's checkpoints go there too). Unset, each trainer pod and the critic get a claim of
    their own (the operator's trainerStorage)."""
    credentials_secret: str | None = Field(None, pattern=OBJECT_NAME)
    """A Secret whose keys become environment variables where URIs are fetched: AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION for s3://; HF_TOKEN, HF_ENDPOINT for hf://."""

    def holds(self, path: str, role: str) -> bool:
        """Whether a volume the role's pods mount holds `path`, an absolute path, by whole segments after `..`."""
        path = posixpath.normpath(path)
        return path.startswith("/") and any(
            path == mount or path.startswith(mount.rstrip("/") + "/")
            for mount in (posixpath.normpath(volume.mount_path) for volume in self.volumes if role in volume.roles))

    @model_validator(mode="after")
    def _distinct(self) -> Storage:
        for field in ("name", "mount_path"):
            values = [getattr(volume, field) for volume in self.volumes]
            repeated = sorted({value for value in values if values.count(value) > 1})
            if repeated:
                raise ValueError(f"two volumes share the {field.replace('_p', 'P')} {repeated[0]!r}")
        return self
