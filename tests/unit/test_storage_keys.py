"""An S3 object key that would leave the model's cache directory is refused, and nothing is written for it.

S3 keys are any string; the S3-compatible test server (tests/integration/test_storage_fetch.py) normalises `..` and
`//` out of request paths, so the listing comes from a stand-in client here: the same calls boto3's client gets.
"""

from __future__ import annotations

import sys
import types

import pytest

from rlfleet.workers.storage.fetch import FetchError, fetched_tree

BUCKET = "models"


class Listing:
    """boto3's S3 client, as much as a tree fetch uses: one page of keys, downloads written as files."""

    def __init__(self, keys: list[str]):
        self.keys = keys
        self.written: list[str] = []

    def get_paginator(self, name: str):
        assert name == "list_objects_v2"
        return types.SimpleNamespace(paginate=lambda Bucket, Prefix: [
            {"Contents": [{"Key": key} for key in self.keys if key.startswith(Prefix)]}])

    def download_file(self, bucket: str, key: str, target: str) -> None:
        self.written.append(target)
        with open(target, "w", encoding="ascii") as out:
            out.write(key)


@pytest.fixture
def listing(monkeypatch):
    """Installs a stand-in boto3 whose client lists the keys the test sets."""
    found = Listing([])
    client_errors = types.SimpleNamespace(NoCredentialsError=OSError, ClientError=OSError,
                                          EndpointConnectionError=OSError)
    monkeypatch.setitem(sys.modules, "boto3", types.SimpleNamespace(client=lambda service: found))
    monkeypatch.setitem(sys.modules, "botocore", types.SimpleNamespace(exceptions=client_errors))
    monkeypatch.setitem(sys.modules, "botocore.exceptions", client_errors)
    return found


# {tmp}: the test's own directory without its leading "/" (so that on old code, an absolute key lands there).
@pytest.mark.parametrize("key", ["tiny/../../../escaped.json", "tiny/a/../../../escaped.json",
                                 "tiny//{tmp}/escaped.json", "tiny/a//escaped.json"],
                         ids=["dot-dot", "nested-dot-dot", "absolute", "inner-empty"])
def test_a_key_that_leaves_the_cache_is_refused(listing, tmp_path, key):
    key = key.format(tmp=str(tmp_path).lstrip("/"))
    listing.keys = ["tiny/config.json", key]
    with pytest.raises(FetchError, match=r"would be written outside the cache") as refused:
        fetched_tree(f"s3://{BUCKET}/tiny", tmp_path / "cache")
    assert repr(key) in str(refused.value)
    assert not list(tmp_path.rglob("escaped.json")), "a file was written for the key"
    assert all(str(tmp_path / "cache") in target for target in listing.written)


def test_keys_inside_the_prefix_are_fetched_into_the_tree(listing, tmp_path):
    listing.keys = ["tiny/config.json", "tiny/sub/model..safetensors", "tiny/folder/", "other/x.json"]
    tree = fetched_tree(f"s3://{BUCKET}/tiny", tmp_path / "cache")
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()) == [
        "config.json", "sub/model..safetensors"]
