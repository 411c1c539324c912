"""Shared fixtures: a job, its tiny model in a per-session cache, and worker processes started like `rlfleet run`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.workers.spec import RLJob, parse_job


def make_job(**spec) -> RLJob:
    return parse_job({"metadata": {"name": "t"}, "spec": spec})


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory, monkeypatch_session) -> Path:
    cache = tmp_path_factory.mktemp("model-cache")
    monkeypatch_session.setenv("RLFLEET_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def monkeypatch_session():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def write_config(job: RLJob, directory: Path) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(job.to_dict()))
    return path
