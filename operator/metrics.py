"""The operator's own Prometheus metrics (workers serve theirs; these say what the operator did)."""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable

import kopf
from prometheus_client import Counter, Gauge, start_http_server

RECONCILES = Counter("rlfleet_operator_reconciles_total", "RLJob reconciliations by result", ["result"])
OBJECT_WRITES = Counter("rlfleet_operator_object_writes_total", "Objects created or patched", ["kind", "action"])
STATUS_UPDATES = Counter("rlfleet_operator_status_updates_total", "Status refreshes by the timer", ["phase"])
TRAINER_RESTARTS = Counter("rlfleet_operator_trainer_restarts_total", "Trainer restarts from a checkpoint")
CONTROLLER_UNREACHABLE = Counter("rlfleet_operator_controller_unreachable_total",
                                 "Status refreshes where the controller did not answer")

ERRORS = Counter("rlfleet_operator_errors_total", "Handler runs that failed unexpectedly (kopf retries them)",
                 ["handler"])
JOBS = Gauge("rlfleet_operator_jobs", "RLJobs by status phase, as this operator last saw them", ["phase"])
PHASES = ("Pending", "Running", "Suspended", "Succeeded", "Failed")
_phases: dict[str, str] = {}


def set_phase(job: str, phase: str | None) -> None:
    """Record the phase of `job` (namespace/name; None when it is gone) and recount the jobs per phase."""
    if phase is None:
        _phases.pop(job, None)
    else:
        _phases[job] = phase
    for name in set(PHASES) | set(_phases.values()):
        JOBS.labels(name).set(sum(1 for seen in _phases.values() if seen == name))


def count_errors(handler: str) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Count a handler's unexpected failures; kopf's own Temporary/Permanent errors are decisions, not faults."""
    def wrap(function: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(function)  # kopf names handlers (and their persisted progress) after the function
        async def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return await function(*args, **kwargs)
            except (kopf.TemporaryError, kopf.PermanentError):
                raise
            except Exception:
                ERRORS.labels(handler).inc()
                raise
        return run
    return wrap


def serve(port: int) -> None:
    start_http_server(port)
