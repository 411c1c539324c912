"""Storage URIs a job may name instead of a path. Torch- and boto-free: the RLJob schema checks them.

    s3://BUCKET/KEY                                  an object store (AWS S3 or any S3-compatible server)
    hf://[datasets/]OWNER/NAME[@REVISION][/FILE]     a Hugging Face Hub repository (hf's own fsspec form)

A model URI names a tree (every object under the S3 prefix, the whole repository); a data URI names one file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/(?P<key>.*))?$")
HF = re.compile(r"^hf://((?P<type>datasets|spaces)/)?(?P<repo>[\w.-]+/[\w.-]+)(@(?P<revision>[\w.-]+))?"
                r"(/(?P<file>.+))?$")
GRAMMAR = "s3://BUCKET/KEY or hf://[datasets/]OWNER/NAME[@REVISION][/FILE]"


@dataclass(frozen=True)
class Location:
    scheme: str
    """s3 or hf."""
    container: str
    """The S3 bucket, or the Hub repository OWNER/NAME."""
    path: str = ""
    """The S3 key (prefix for a tree), or the file inside the repository."""
    revision: str | None = None
    repo_type: str = "model"

    @property
    def file_name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def parse(uri: str) -> Location:
    """The location a URI names; ValueError naming the grammar otherwise."""
    if match := S3.match(uri):
        return Location("s3", match["bucket"], match["key"] or "")
    if match := HF.match(uri):
        repo_type = (match["type"] or "models").removesuffix("s")
        return Location("hf", match["repo"], match["file"] or "", match["revision"], repo_type)
    raise ValueError(f"not a storage URI: expected {GRAMMAR}")


def check_file(uri: str) -> str:
    """A URI that names one file (data)."""
    if not parse(uri).file_name:
        raise ValueError(f"names no file: expected {GRAMMAR} with the file's KEY or FILE")
    return uri


def check_tree(uri: str) -> str:
    """A URI that names a tree (a model directory): an S3 prefix or a whole repository."""
    location = parse(uri)
    if location.scheme == "hf" and location.path:
        raise ValueError("a model is a whole repository: hf://OWNER/NAME[@REVISION], without a file")
    return uri


def one_source(section: Any, path_is: str, uri_is: str) -> Any:
    """A section (model, data) names exactly one of a path and a URI."""
    if (section.path is None) == (section.uri is None):
        raise ValueError(f"set exactly one of path ({path_is}) and uri ({uri_is})")
    return section
