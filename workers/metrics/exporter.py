"""One worker's Prometheus registry: `job`, `namespace`, `role`, `rank` (a generator's also `pool`) on every series,
its executor clock as `rlfleet_busy_seconds_total` / `rlfleet_idle_seconds_total{reason}`, served on its own port.

Scrape with `honor_labels: true` (the chart's ServiceMonitor does): the `job` label is the RLJob's
name, not the scrape job's.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily

from rlfleet.workers.executors import KINDS
from rlfleet.workers.generator.pools import pool_of
from rlfleet.workers.metrics.clock import ExecutorClock
from rlfleet.workers.metrics.spans import SpanLog, span_path

log = logging.getLogger(__name__)
# The `pool` label of a generator of a job that lists no pools.
DEFAULT_POOL = "default"

# Idle reasons of each executor by priority (the first active one is charged), and the reason when
# nothing is active. docs/metrics.md defines each.
IDLE_REASONS = {kind.role: kind.idle_reasons for kind in KINDS}


def default_reason(role: str, rank: int) -> str:
    """Where the time between named activities goes: trainer ranks > 0 wait on rank 0's next command;
    rank 0 does the step's bookkeeping; a controller of its own stands by until it leads; generators and scorers
    wait for requests."""
    if role == "trainer":
        return "bookkeeping" if rank == 0 else "waiting_for_rank0"
    return "standing_by" if role == "control" else "waiting_for_requests"


def generator_pool_label(job: Any, rank: int) -> str:
    """A generator's `pool` label (per-pool throughput and bubbles): its pool's name, or DEFAULT_POOL."""
    return pool_of(job.spec, rank).name or DEFAULT_POOL


class WorkerMetrics:
    def __init__(self, role: str, rank: int = 0, job: str = "", namespace: str = "",
                 spans: SpanLog | None = None, clock: ExecutorClock | None = None, pool: str = ""):
        self.labels = {"job": job, "namespace": namespace, "role": role, "rank": str(rank)} | (
            {"pool": pool} if pool else {})
        self.registry = CollectorRegistry()
        self.clock = clock or ExecutorClock(IDLE_REASONS[role], default_reason(role, rank),
                                            spans.change if spans else None)
        self.registry.register(ClockCollector(self.clock, self.labels))
        ProcessCollector(registry=self.registry)
        self.gauge("rlfleet_worker_start_time_seconds", "Unix time the worker's executor clock started").set(
            self.clock.start_wall)
        self.counter("rlfleet_restarts_total", "Earlier starts of this worker in the same run directory").inc(
            spans.previous_starts if spans else 0)
        self.server: Any = None

    @classmethod
    def for_worker(cls, ctx: Any) -> WorkerMetrics:
        """The metrics of the worker described by a WorkerContext, with its spans file in the run dir."""
        spans = SpanLog(span_path(ctx.run_dir, ctx.role, ctx.rank))
        return cls(ctx.role, ctx.rank, ctx.job.metadata.name, ctx.job.metadata.namespace, spans,
                   pool=generator_pool_label(ctx.job, ctx.rank) if ctx.role == "generator" else "")

    def serve(self, port: int, host: str = "0.0.0.0") -> WorkerMetrics:
        prometheus_client.disable_created_metrics()  # `_created` series double the count for no panel
        self.server, _ = prometheus_client.start_http_server(port, host, registry=self.registry)
        log.info("metrics on %s:%d/metrics", host, port)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._bind(Counter(name, doc, [*self.labels, *labels], registry=self.registry), labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Any:
        return self._bind(Gauge(name, doc, [*self.labels, *labels], registry=self.registry), labels)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Any:
        family = Histogram(name, doc, [*self.labels, *labels], buckets=buckets, registry=self.registry)
        return self._bind(family, labels)

    def counter_callback(self, name: str, doc: str, label: str | tuple[str, ...],
                         read: Callable[[], dict[Any, float]]) -> None:
        """A counter per value of `label` (or per tuple of values of a tuple of labels), read from `read()` at scrape
        time (no work when nothing scrapes)."""
        self.registry.register(CallbackCounter(name, doc, self.labels, label, read))

    def _bind(self, family: Any, labels: Sequence[str]) -> Any:
        return _Bound(family, self.labels) if labels else family.labels(**self.labels)


class _Bound:
    """A family with the base labels filled in: `.labels(queue="x")` gives the child."""

    def __init__(self, family: Any, base: dict[str, str]):
        self.family, self.base = family, base

    def labels(self, **extra: str) -> Any:
        return self.family.labels(**self.base, **extra)


class ClockCollector:
    """Busy and idle seconds read from the clock at scrape time, the current state included."""

    def __init__(self, clock: ExecutorClock, labels: dict[str, str]):
        self.clock, self.labels = clock, labels

    def collect(self):
        busy, idle = self.clock.totals()
        names, values = list(self.labels), list(self.labels.values())
        busy_family = CounterMetricFamily("rlfleet_busy_seconds", "Seconds the executor was working",
                                          labels=names)
        busy_family.add_metric(values, busy)
        idle_family = CounterMetricFamily("rlfleet_idle_seconds", "Seconds the executor was idle, by reason",
                                          labels=[*names, "reason"])
        for reason, seconds in idle.items():
            idle_family.add_metric([*values, reason], seconds)
        return [busy_family, idle_family]


class CallbackCounter:
    """`label` names one label (keys of `read()` are its values) or a tuple of them (keys are tuples)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], label: str | tuple[str, ...],
                 read: Callable[[], dict[Any, float]]):
        self.name, self.doc, self.labels, self.read = name, doc, labels, read
        self.label = (label,) if isinstance(label, str) else label

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=[*self.labels, *self.label])
        for key, value in self.read().items():
            family.add_metric([*self.labels.values(), *((key,) if isinstance(key, str) else key)], value)
        return [family]
