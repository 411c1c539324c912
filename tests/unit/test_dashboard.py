"""The Grafana dashboard's shape: stable uid, datasource/job/namespace variables, units everywhere,
$__rate_interval in every rate, and only metrics the workers really export.
(Every query is run against a real Prometheus in tests/e2e/test_dashboard_queries.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.environment.server import EnvironmentCounts
from rlfleet.workers.metrics.families import (ControllerMetrics, CriticMetrics, EnvironmentMetrics, GeneratorMetrics,
                                             ReferenceMetrics, ScorerMetrics)

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "rlfleet" / "dashboards" / "rlfleet.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p["targets"]]


def exported_names() -> set[str]:
    generator = WorkerMetrics("generator")
    GeneratorMetrics(generator)
    reference = WorkerMetrics("reference")
    ReferenceMetrics(reference)
    scorer = WorkerMetrics("scorer")
    ScorerMetrics(scorer, lambda: {"math_answer": 0})
    critic = WorkerMetrics("critic")
    CriticMetrics(critic)
    trainer = WorkerMetrics("trainer")
    controller = ControllerMetrics(trainer, {"rollout_batches": lambda: 0})
    for label, gauge in controller.named_means.values():  # labelled by what a step's record names
        gauge.labels(**{label: "0"}).set(0.0)
    env = WorkerMetrics("env")
    counts = EnvironmentCounts()
    counts.tool_calls["calculator"] = counts.tool_errors["calculator"] = counts.errors["raised"] = 1
    EnvironmentMetrics(env, counts)
    return {sample.name for worker in (generator, reference, scorer, critic, trainer, env)
            for family in worker.registry.collect() for sample in family.samples}


def test_identity_and_variables(dashboard):
    assert dashboard["uid"] == "rlfleet-bubbles"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "job"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DATASOURCE
    assert "$namespace" in variables["job"]["query"]["query"]


def test_every_panel_has_a_unit_the_datasource_variable_and_a_query(dashboard):
    assert len(panels(dashboard)) >= 12
    for panel in panels(dashboard):
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_selector_filters_on_job_and_namespace(dashboard):
    for expr in exprs(dashboard):
        names = re.findall(r"rlfleet_\w+", expr)
        selectors = re.findall(r"rlfleet_\w+\{([^}]*)\}", expr)
        assert len(names) == len(selectors), f"a metric without a selector in {expr}"
        for selector in selectors:
            assert 'job=~"$job"' in selector and 'namespace=~"$namespace"' in selector, expr


def test_rates_use_the_rate_interval(dashboard):
    for expr in exprs(dashboard):
        for window in re.findall(r"(?:rate|increase)\([^\[]*\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), expr


def test_panels_show_the_bubble_the_timeline_and_off_policy_health(dashboard):
    titles = " | ".join(p["title"] for p in panels(dashboard)).lower()
    for topic in ("bubble ratio by executor", "timeline", "tokens per second", "weight sync", "staleness",
                  "clipped", "effective sample size", "log pi - log mu", "reward", "scorer errors", "restarts"):
        assert topic in titles, topic


def test_only_exported_metrics_are_queried(dashboard):
    exported = exported_names()
    queried = {name for expr in exprs(dashboard) for name in re.findall(r"rlfleet_\w+", expr)}
    assert queried <= exported, queried - exported
