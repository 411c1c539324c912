"""model.uri and data.uri: on an object store, a real S3-compatible server (moto's) on loopback reached by the
real client (boto3) in `rlfleet fetch` and `rlfleet run` processes, as an init container and a worker would; on
the Hub, the real huggingface_hub client against tests/hub_server.py (the Hub's download API on loopback)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import yaml
from hub_server import HubServer
from runs import RLFLEET, TINY, metrics, wait_for

from rlfleet.workers.models import materialize
from rlfleet.workers.models.config import TinyModel
from rlfleet.workers.storage.fetch import FetchError, fetched_file, fetched_tree

pytestmark = pytest.mark.integration

BUCKET = "rlfleet-models"
LINES = [f'{{"prompt": "{a}+{b}=", "answer": "{a + b}"}}' for a in range(6) for b in range(6)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server, a bucket holding the tiny model under tiny/ and a JSONL file, and the client's environment."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Its own process: moto's server is Flask, and a Flask imported into the test process breaks vLLM engines
    # started there later (vLLM's kernel registry probes every module's globals; Flask's proxies raise).
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _listening(port), 60, "the S3 server")
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "rlfleet",
           "AWS_SECRET_ACCESS_KEY": "rlfleet-secret", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="rlfleet",
                          aws_secret_access_key="rlfleet-secret", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    model = materialize(TinyModel(), tmp_path_factory.mktemp("source"))
    for path in model.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"tiny/{path.relative_to(model)}")
    client.put_object(Bucket=BUCKET, Key="data/sums.jsonl", Body="\n".join(LINES).encode())
    yield env, client, model
    server.terminate()
    server.wait(30)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def fetch(job: Path, env: dict, cache: Path) -> subprocess.Popen:
    return subprocess.Popen([*RLFLEET, "fetch", str(job)], env=os.environ | env | {"RLFLEET_CACHE": str(cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def write_job(tmp_path: Path, model_uri: str, data_uri: str = f"s3://{BUCKET}/data/sums.jsonl") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"metadata": {"name": "fetched"}, "spec": {
        "model": {"type": "hf", "uri": model_uri}, "data": {"type": "jsonl", "uri": data_uri, "heldOut": 4}}}))
    return path


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in directory.rglob("*") if p.is_file()}


def test_two_fetches_at_once_download_the_model_and_data_once_and_whole(s3, tmp_path):
    env, client, model = s3
    job, cache = write_job(tmp_path, f"s3://{BUCKET}/tiny"), tmp_path / "cache"
    runs = [fetch(job, env, cache) for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    (model_dir, data_file), again = ([Path(line) for line in out.split()] for out, _ in outputs)
    assert again == [model_dir, data_file]
    assert digests(model_dir) == digests(model)
    assert data_file.read_text().splitlines() == LINES
    # Fetched once: with the objects gone, the cache still answers (no second download, no request at all).
    leftovers = [d for d in (cache / "fetched").iterdir() if d.name.startswith(".") and not d.name.endswith(".lock")]
    assert not leftovers, leftovers
    client.delete_object(Bucket=BUCKET, Key="data/sums.jsonl")
    try:
        out, err = fetch(job, env, cache).communicate(timeout=120)
        assert out.split() == [str(model_dir), str(data_file)], err
    finally:
        client.put_object(Bucket=BUCKET, Key="data/sums.jsonl", Body="\n".join(LINES).encode())


@pytest.mark.parametrize("uri, reason", [
    (f"s3://{BUCKET}/no-such-model", "nothing there to fetch"),
    ("s3://no-such-bucket-here/tiny", "no such object or bucket"),
])
def test_a_uri_with_nothing_behind_it_fails_naming_it_and_why(s3, tmp_path, uri, reason):
    env, _, _ = s3
    run = fetch(write_job(tmp_path, uri), env, tmp_path / "cache")
    _, err = run.communicate(timeout=120)
    assert run.returncode != 0 and uri in err and reason in err, err
    assert "Traceback" not in err
    # Nothing half-made is left for a later fetch to take for the model.
    assert not [p for p in (tmp_path / "cache" / "fetched").iterdir() if not p.name.endswith(".lock")]


def test_an_unreachable_endpoint_is_named(s3, tmp_path, monkeypatch):
    env, _, _ = s3
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    for key, value in (env | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed}", "AWS_MAX_ATTEMPTS": "1"}).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(FetchError, match="cannot reach"):
        fetched_file(f"s3://{BUCKET}/data/sums.jsonl", tmp_path)


@pytest.mark.slow
def test_a_job_trains_from_a_model_and_data_on_the_object_store(s3, tmp_path):
    """`rlfleet run` with model.uri and data.uri: fetched before the workers start, read by them from the cache."""
    env, _, _ = s3
    job = yaml.safe_load(TINY.read_text())
    job["metadata"]["name"] = "from-s3"
    job["spec"] |= {"model": {"type": "hf", "uri": f"s3://{BUCKET}/tiny"},
                    "data": {"type": "jsonl", "uri": f"s3://{BUCKET}/data/sums.jsonl", "heldOut": 4}}
    job["spec"]["algorithm"]["steps"] = 3
    path, out = tmp_path / "job.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(job))
    done = subprocess.run([*RLFLEET, "run", str(path), "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env=os.environ | env | {"RLFLEET_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert max(m.get("step", 0) for m in metrics(out)) == 3


@pytest.fixture
def hub(s3, monkeypatch):
    """The tiny model (the one on S3) as a Hub model repository, and a dataset repository with the JSONL."""
    _, _, model = s3
    server = HubServer()
    server.repos[("models", "rlfleet/tiny")] = {str(p.relative_to(model)): p.read_bytes()
                                                for p in model.rglob("*") if p.is_file()}
    server.repos[("datasets", "rlfleet/sums")] = {"data/train.jsonl": "\n".join(LINES).encode()}
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server, model
    server.stop()


def test_a_hub_model_and_a_dataset_file_are_fetched_whole_and_once(hub, tmp_path):
    server, model = hub
    model_dir = fetched_tree("hf://rlfleet/tiny@main", tmp_path)
    assert digests(model_dir) == digests(model)
    data = fetched_file("hf://datasets/rlfleet/sums/data/train.jsonl", tmp_path)
    assert data.read_text().splitlines() == LINES
    asked = len(server.requests)
    assert fetched_tree("hf://rlfleet/tiny@main", tmp_path) == model_dir and len(server.requests) == asked


@pytest.mark.parametrize("uri, reason", [
    ("hf://rlfleet/no-such-model", "no such repository"),
    ("hf://datasets/rlfleet/sums/data/missing.jsonl", "EntryNotFoundError"),
])
def test_a_hub_uri_with_nothing_behind_it_fails_naming_it_and_why(hub, tmp_path, uri, reason):
    fetch_it = fetched_file if uri.startswith("hf://datasets") else fetched_tree
    with pytest.raises(FetchError, match=reason) as error:
        fetch_it(uri, tmp_path)
    assert uri in str(error.value)
