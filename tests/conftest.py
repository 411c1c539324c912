"""Shared fixtures: a job, its tiny model in a per-session cache, and worker processes started like `rlfleet run`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kube_cluster import SECONDS, start_builds, start_cluster_early, stop_builds

from rlfleet.workers.spec import RLJob, parse_job


def make_job(**spec) -> RLJob:
    return parse_job({"metadata": {"name": "t"}, "spec": spec})


def make_full_job(**spec) -> RLJob:
    """A job that runs every executor kind of plan.ROLES, the optional ones included."""
    roles = {"reference": {}, "rewardModel": {"path": "/models/reward"}, "critic": {},
             "environment": {"type": "tools"}, "controller": {}, **spec.pop("roles", {})}
    algorithm = {"advantage": "gae", **spec.pop("algorithm", {})}  # the critic serves GAE
    return make_job(**spec, roles=roles, algorithm=algorithm)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The cluster tests run last, and their cluster's builds start now, in the background."""
    cluster = [item for item in items if item.get_closest_marker("cluster")]
    if cluster:
        items[:] = [item for item in items if not item.get_closest_marker("cluster")] + cluster
        if not config.option.collectonly:
            start_builds()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The cluster comes up beside the unit tests, the lightest (they run after the integration tests and before the
    cluster's). Not niced, unlike the builds: the cluster's daemons, started by it, would inherit it."""
    if item.get_closest_marker("integration") is None:
        start_cluster_early()


def pytest_sessionfinish() -> None:
    stop_builds()


def pytest_terminal_summary(terminalreporter) -> None:
    if SECONDS:
        terminalreporter.write_line(f"rlfleet cluster seconds: {json.dumps(SECONDS)}")


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


def sampled(ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None) -> list:
    """A completion the policy sampled, as a rollout's turns (log mu and versions 0 unless given)."""
    from rlfleet.workers.controller.rollouts import sampled_turn

    return [sampled_turn(ids, [0.0] * len(ids) if logprobs is None else logprobs,
                         [0] * len(ids) if versions is None else versions)] if ids else []
