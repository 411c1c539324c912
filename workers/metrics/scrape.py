"""Read workers' busy and idle seconds from their /metrics pages (what `rlfleet run` shows live)."""

from __future__ import annotations

import http.client
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from rlfleet.workers.metrics.clock import STARTING

SCRAPE_TIMEOUT = 0.5


def read_clock(url: str, timeout: float = SCRAPE_TIMEOUT) -> tuple[float, float] | None:
    """(busy, idle) seconds of one worker, `starting` left out; None if it does not answer, or not wholly (a worker
    killed mid-page leaves a short body: http.client raises IncompleteRead, no OSError)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException):
        return None
    busy = idle = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rlfleet_busy_seconds_total":
                busy += sample.value
            elif sample.name == "rlfleet_idle_seconds_total" and sample.labels.get("reason") != STARTING:
                idle += sample.value
    return busy, idle


class BubbleMeter:
    """Bubble ratio of each executor since the previous reading, summed over its workers."""

    def __init__(self, urls: dict[str, list[str]]):
        self.urls = urls
        self._last: dict[str, tuple[float, float]] = {}

    def read(self) -> dict[str, float]:
        busy: dict[str, float] = defaultdict(float)
        idle: dict[str, float] = defaultdict(float)
        for role, urls in self.urls.items():
            for url in urls:
                now = read_clock(url)
                if now is None:
                    continue
                before = self._last.get(url, (0.0, 0.0))
                if now[0] < before[0] or now[1] < before[1]:  # the worker restarted: counters began again
                    before = (0.0, 0.0)
                busy[role] += now[0] - before[0]
                idle[role] += now[1] - before[1]
                self._last[url] = now
        return {role: idle[role] / (idle[role] + busy[role]) for role in busy if idle[role] + busy[role] > 0}
