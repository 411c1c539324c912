"""Fetching what a job names by URI into the worker cache, once per cache (storage.cache.build_once).

S3 through boto3, which reads the standard environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL (an S3-compatible server: MinIO, Ceph, R2, ...), AWS_REGION. The Hub through huggingface_hub:
HF_TOKEN, HF_ENDPOINT (a mirror). On a cluster these come from storage.credentialsSecret.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.workers.storage import uris
from rlfleet.workers.storage.cache import build_once
from rlfleet.workers.executors import BY_ROLE, ROLES

if TYPE_CHECKING:  # the schema imports the model configs, whose package imports this module
    from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
FETCHED_DIR = "fetched"


class FetchError(RuntimeError):
    """A URI that could not be fetched: what was asked, what went wrong, what to change."""


def uris_for(job: RLJob, role: str) -> list[str]:
    """The URIs a role's workers read: the model's (the kinds that load it), the data's (trainers)."""
    model, data = job.spec.model, job.spec.data
    wanted = [model.uri] if model.type == "hf" and BY_ROLE[role].reads_model else []
    wanted += [data.uri] if data.type == "jsonl" and role == "trainer" else []
    return [uri for uri in wanted if uri]


def fetch_for(job: RLJob, role: str | None, cache_dir: Path) -> list[Path]:
    """Fetch what a role (every role: None) reads into the cache; the paths, in the job's order."""
    roles = [role] if role else ROLES
    found = dict.fromkeys(uri for name in roles for uri in uris_for(job, name))
    data = job.spec.data.uri if job.spec.data.type == "jsonl" else None
    return [fetched_file(uri, cache_dir) if uri == data else fetched_tree(uri, cache_dir) for uri in found]


def fetched_tree(uri: str, cache_dir: Path) -> Path:
    """The directory a tree URI names (a model), fetched into the cache unless it is there already."""
    location = uris.parse(uris.check_tree(uri))
    return build_once(_target(uri, cache_dir), lambda out: _fetch(uri, location, out, tree=True))


def fetched_file(uri: str, cache_dir: Path) -> Path:
    """The file a file URI names (data), fetched into the cache unless it is there already."""
    location = uris.parse(uris.check_file(uri))
    directory = build_once(_target(uri, cache_dir), lambda out: _fetch(uri, location, out, tree=False))
    return directory / location.file_name


def _target(uri: str, cache_dir: Path) -> Path:
    # Readable, and unique per URI: two URIs never share a directory.
    slug = re.sub(r"[^A-Za-z0-9.-]+", "-", uri.split("://", 1)[1])[:60].strip("-")
    return cache_dir / FETCHED_DIR / f"{slug}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"


def _fetch(uri: str, location: uris.Location, out: Path, tree: bool) -> None:
    log.info("fetching %s", uri)
    fetch = _fetch_s3 if location.scheme == "s3" else _fetch_hf
    fetch(uri, location, out, tree)
    if not any(out.rglob("*")):
        raise FetchError(f"{uri}: nothing there to fetch (an empty prefix or repository)")


def _fetch_s3(uri: str, location: uris.Location, out: Path, tree: bool) -> None:
    import boto3
    import botocore.exceptions

    client = boto3.client("s3")
    try:
        if not tree:
            client.download_file(location.container, location.path, str(out / location.file_name))
            return
        prefix = location.path.rstrip("/") + "/" if location.path else ""
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.container, Prefix=prefix):
            for item in page.get("Contents", []):
                relative = item["Key"][len(prefix):]
                if relative and not relative.endswith("/"):  # "folder" marker objects hold nothing
                    target = _inside(out, relative, uri, item["Key"])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    client.download_file(location.container, item["Key"], str(target))
    except botocore.exceptions.NoCredentialsError:
        raise FetchError(f"{uri}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                         "(on a cluster, in the Secret storage.credentialsSecret names)") from None
    except botocore.exceptions.ClientError as err:
        raise FetchError(f"{uri}: {_s3_reason(err)}") from None
    except botocore.exceptions.EndpointConnectionError as err:
        raise FetchError(f"{uri}: cannot reach {err.kwargs.get('endpoint_url')}: check AWS_ENDPOINT_URL") from None


def _inside(out: Path, relative: str, uri: str, key: str) -> Path:
    """Where an object goes under `out`: S3 keys are any string, and one with `..` or an empty segment (`a//b`,
    whose tail joins as an absolute path) would write outside the cache."""
    parts = relative.split("/")
    if "" in parts or ".." in parts:
        raise FetchError(f"{uri}: object key {key!r} would be written outside the cache (a '..' or empty path "
                         "segment): rename or remove that object")
    return out.joinpath(*parts)


def _s3_reason(err: Exception) -> str:
    error = getattr(err, "response", {}).get("Error", {})
    code = str(error.get("Code", ""))
    if code in ("404", "NoSuchKey", "NoSuchBucket"):
        return f"no such object or bucket ({code})"
    if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"access denied ({code}): check the credentials and the bucket's policy"
    return f"{code or type(err).__name__}: {error.get('Message', err)}"


def _fetch_hf(uri: str, location: uris.Location, out: Path, tree: bool) -> None:
    import huggingface_hub
    from huggingface_hub import errors

    # HF_ENDPOINT read now: huggingface_hub reads it once, when first imported.
    where = {"repo_id": location.container, "repo_type": location.repo_type, "revision": location.revision,
             "local_dir": str(out), "endpoint": os.environ.get("HF_ENDPOINT")}
    try:
        if tree:
            huggingface_hub.snapshot_download(**where)
        else:  # kept where a fetched S3 object is: at the top, under its own name
            Path(huggingface_hub.hf_hub_download(filename=location.path, **where)).rename(out / location.file_name)
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as err:
        raise FetchError(f"{uri}: no such repository, or no access: set HF_TOKEN "
                         f"(on a cluster, in storage.credentialsSecret) ({type(err).__name__})") from None
    except errors.LocalEntryNotFoundError as err:  # an EntryNotFoundError: first
        raise FetchError(f"{uri}: cannot reach the Hub (HF_ENDPOINT, HF_HUB_OFFLINE): {err}") from None
    except (errors.RevisionNotFoundError, errors.EntryNotFoundError) as err:
        raise FetchError(f"{uri}: {type(err).__name__}: check the revision and the file") from None
    # The Hub client's own bookkeeping beside the files: not part of the model.
    shutil.rmtree(out / ".cache", ignore_errors=True)
