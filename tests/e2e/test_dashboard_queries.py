"""Debian's Prometheus scrapes a real `rlfleet run` of the tiny job; every query of every dashboard panel
must return data, and every worker's busy + idle seconds must equal its wall time."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from runs import stop

from rlfleet.workers.executors import ROLES
from rlfleet.workers.plan import free_port
from rlfleet.workers.reward_model.toy import train_digit_preference

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "rlfleet" / "dashboards" / "rlfleet.json"
TINY = ROOT / "manifests" / "examples" / "tiny-local.yaml"
RATE_INTERVAL = "10s"
# An environment that calls a tool in each of its episodes, which end at once: the tool and environment panels get
# data without a tool-calling model.
ENVIRONMENT_CODE = """
from rlfleet.workers.environment.protocol import Environment, Step


class Counted(Environment):
    def step(self, reply):
        return Step(done=True, tool_calls={"calculator": 1}, tool_errors={"calculator": int("7" not in reply)})
"""  # what Grafana's $__rate_interval would be at a 1 s scrape interval and a short range


@pytest.fixture
def prometheus(tmp_path):
    """Prometheus on a free loopback port, scraping the targets file `rlfleet run` writes into run/."""
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is missing: run scripts/setup.sh as root (apt-get install prometheus)"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "rlfleet",
            "honor_labels": True,  # keep the workers' own job (the RLJob's name), as the chart's ServiceMonitor does
            "file_sd_configs": [{"files": [str(run_dir / "prometheus-targets.json")], "refresh_interval": "1s"}],
        }],
    }))
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, process)
        yield base, run_dir
    finally:
        stop(process, grace=20)


def test_every_dashboard_query_returns_data_from_a_real_run(prometheus, tmp_path, model_cache):
    base, run_dir = prometheus
    environment = tmp_path / "counted.py"
    environment.write_text(ENVIRONMENT_CODE)
    job = yaml.safe_load(TINY.read_text())
    job["spec"]["algorithm"]["steps"] = 20
    # Every executor kind, so that every panel has data: the reference, with a little KL, a toy reward model, the
    # critic, with GAE, and the controller as an executor of its own, a leader and a standby.
    job["spec"]["roles"]["reference"] = {"replicas": 1}
    job["spec"]["algorithm"]["kl"] = {"coef": 0.05}
    train_digit_preference(tmp_path / "reward-model", steps=20)  # what it prefers does not matter here
    job["spec"]["roles"]["rewardModel"] = {"path": str(tmp_path / "reward-model")}
    job["spec"]["roles"]["critic"] = {"replicas": 1}
    job["spec"]["algorithm"]["advantage"] = "gae"
    job["spec"]["roles"]["environment"] = {"type": "python", "path": str(environment), "class": "Counted"}
    job["spec"]["roles"]["controller"] = {"replicas": 2}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    result = subprocess.run([sys.executable, "-m", "rlfleet.workers.cli", "run", str(job_file), "--out", str(run_dir)],
                            capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"bubble critic \d\.\d\d env \d\.\d\d gen \d\.\d\d ref \d\.\d\d reward \d\.\d\d "
                     r"score \d\.\d\d train \d\.\d\d", result.stdout), result.stdout

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start, end = steps[0]["time"] - steps[0]["step_seconds"], steps[-1]["time"]
    variables = {"job": job["metadata"]["name"], "namespace": "default", "__rate_interval": RATE_INTERVAL,
                 "__range": f"{int(end - start)}s"}
    dashboard = json.loads(DASHBOARD.read_text())
    _check_variables(base, dashboard, variables)
    empty = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            series = _query(base, _substitute(target["expr"], variables), start, end, target.get("instant", False))
            if not series:
                empty.append(f"{panel['title']} [{target['refId']}]: {target['expr']}")
            if panel["title"] == "Bubble ratio by executor":  # a controller has none: it leads, or stands by
                assert {s["metric"]["role"] for s in series} == set(ROLES) - {"control"}
    assert not empty, "panel queries without data:\n" + "\n".join(empty)
    _check_busy_plus_idle_is_wall_time(base, end - 1.0)

    report = subprocess.run([sys.executable, "-m", "rlfleet.workers.cli", "report", str(run_dir)],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stdout + report.stderr
    assert re.search(r"generator\s+0\.\d\d", report.stdout) and (run_dir / "report" / "timeline.png").exists()


def _check_busy_plus_idle_is_wall_time(base: str, at: float) -> None:
    """At any scrape: busy + idle (all reasons) = scrape time - the clock's start, per worker."""
    expr = ("sum by (role, rank) (rlfleet_idle_seconds_total) + on (role, rank) rlfleet_busy_seconds_total"
            " - on (role, rank) (timestamp(rlfleet_worker_start_time_seconds) - rlfleet_worker_start_time_seconds)")
    series = _get(base, "/api/v1/query", {"query": expr, "time": f"{at:.3f}"})["result"]
    assert {(s["metric"]["role"], s["metric"]["rank"]) for s in series} == {(role, "0") for role in ROLES} | {
        ("control", "1")}
    for s in series:
        assert abs(float(s["value"][1])) < 0.25, f"busy + idle - wall = {s['value'][1]} s for {s['metric']}"


def _check_variables(base: str, dashboard: dict, values: dict) -> None:
    """Grafana's label_values(metric, label) is Prometheus's label values API with a match[] selector."""
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
        assert match, variable["query"]
        selector = _substitute(match.group(1), values | {"namespace": ".*"})
        found = _get(base, f"/api/v1/label/{match.group(2)}/values", {"match[]": selector})
        assert values[variable["name"]] in found, (variable["name"], found)


def _substitute(expr: str, values: dict) -> str:
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", values[name]).replace(f"${name}", values[name])
    assert "$" not in expr, expr
    return expr


def _query(base: str, expr: str, start: float, end: float, instant: bool) -> list[dict]:
    """Series with at least one number (NaN is no data), as Grafana would draw them."""
    if instant:
        series = _get(base, "/api/v1/query", {"query": expr, "time": f"{end:.3f}"})["result"]
        return [s for s in series if s["value"][1] not in ("NaN", "+Inf", "-Inf")]
    series = _get(base, "/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                 "step": "1"})["result"]
    return [s for s in series if any(v not in ("NaN", "+Inf", "-Inf") for _, v in s["values"])]


def _get(base: str, path: str, params: dict) -> object:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def _wait_ready(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "prometheus exited"
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("prometheus not ready within 60 s")
