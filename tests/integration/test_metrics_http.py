"""A worker's /metrics over HTTP, and the live bubble ratios `rlfleet run` prints from it."""

from __future__ import annotations

import urllib.request

import pytest

from rlfleet.workers.local import format_progress
from rlfleet.workers.metrics.clock import ExecutorClock
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.scrape import BubbleMeter, read_clock
from rlfleet.workers.plan import free_port
from short_reply import short_reply_server

pytestmark = pytest.mark.integration


@pytest.fixture
def served():
    now = [0.0]
    clock = ExecutorClock(("loading_weights",), "waiting_for_requests", now=lambda: now[0])
    worker = WorkerMetrics("generator", 0, "tiny", "ml", clock=clock).serve(free_port(), "127.0.0.1")
    url = f"http://127.0.0.1:{worker.server.server_port}/metrics"
    yield worker, now, url
    worker.stop()


def test_metrics_page_carries_labels_and_units(served):
    _, _, url = served
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'rlfleet_busy_seconds_total{job="tiny",namespace="ml",rank="0",role="generator"} 0.0' in text
    assert 'reason="loading_weights"' in text and "process_cpu_seconds_total" in text
    assert "_created" not in text


def test_bubble_meter_reports_the_ratio_since_its_last_reading(served):
    worker, now, url = served
    clock = worker.clock
    now[0] = 5.0  # starting: not a bubble of the loop
    clock.started()
    with clock.busy():
        now[0] = 8.0
    now[0] = 9.0
    assert read_clock(url) == (3.0, 1.0)
    meter = BubbleMeter({"generator": [url], "scorer": [f"http://127.0.0.1:{free_port()}/metrics"]})
    assert meter.read() == {"generator": 0.25}  # the scorer that does not answer is left out
    now[0] = 13.0
    assert meter.read() == {"generator": 1.0}


def test_a_worker_that_dies_mid_page_reads_as_not_answering():
    """A worker killed while it answers leaves a short body: `rlfleet run` goes on without its reading."""
    with short_reply_server() as url:
        assert read_clock(f"{url}/metrics", timeout=5) is None


def test_progress_line_shows_each_executor_bubble():
    record = {"step": 3, "reward_mean": 0.5, "max_staleness": 1, "tokens_generated": 100, "step_seconds": 0.5,
              "samples_dropped_stale": 0}
    line = format_progress(record, 10, {"generator": 0.25, "scorer": 0.9, "trainer": 0.125})
    assert line.endswith("dropped 0  bubble gen 0.25 score 0.90 train 0.12")
    assert "bubble" not in format_progress(record, 10)
