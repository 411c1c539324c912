"""The operator's own metrics: jobs by phase, and unexpected handler failures (kopf's decisions excluded)."""

from __future__ import annotations

import asyncio

import kopf
import pytest

from rlfleet.operator import metrics


def jobs(phase: str) -> float:
    return metrics.JOBS.labels(phase)._value.get()


def test_jobs_by_phase_follow_each_job():
    phases = ("Pending", "Running", "Failed")
    before = [jobs(p) for p in phases]  # other tests' jobs share this process's registry
    metrics.set_phase("probe/a", "Pending")
    metrics.set_phase("probe/b", "Pending")
    metrics.set_phase("probe/a", "Running")
    assert [jobs(p) - b for p, b in zip(phases, before)] == [1, 1, 0]
    metrics.set_phase("probe/b", None)
    metrics.set_phase("probe/a", None)
    assert [jobs(p) for p in phases] == before


def test_only_unexpected_failures_count_as_errors():
    @metrics.count_errors("probe")
    async def handler(outcome: BaseException | None, **_) -> str:
        if outcome is not None:
            raise outcome
        return "done"

    errors = metrics.ERRORS.labels("probe")
    before = errors._value.get()
    assert asyncio.run(handler(outcome=None)) == "done" and handler.__name__ == "handler"
    for decision in (kopf.TemporaryError("wait", delay=1), kopf.PermanentError("invalid")):
        with pytest.raises(type(decision)):
            asyncio.run(handler(outcome=decision))
    assert errors._value.get() == before
    with pytest.raises(ConnectionError):
        asyncio.run(handler(outcome=ConnectionError("api down")))
    assert errors._value.get() == before + 1
