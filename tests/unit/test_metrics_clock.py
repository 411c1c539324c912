"""The executor clock: busy + idle always add up to the wall time, overlapping activities are charged once."""

from __future__ import annotations

import random
import threading
import time

import pytest

from rlfleet.workers.metrics.clock import ExecutorClock
from rlfleet.workers.metrics.spans import SpanLog, read_spans


class FakeTime:
    def __init__(self, start: float = 100.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def generator_clock(fake: FakeTime, on_change=None) -> ExecutorClock:
    return ExecutorClock(("loading_weights", "receiving_weights"), "waiting_for_requests", on_change,
                         now=fake, wall=lambda: 1_000.0)


def test_overlapping_activities_are_charged_to_the_highest_priority():
    fake = FakeTime()
    clock = generator_clock(fake)
    fake.advance(2.0)  # loading the engine
    clock.started()
    fake.advance(1.0)  # nothing to do
    with clock.idle("receiving_weights"):
        fake.advance(0.5)
        with clock.busy():  # generating while weights arrive: busy wins
            fake.advance(3.0)
        fake.advance(0.25)
    with clock.idle("loading_weights"):
        fake.advance(0.75)
    fake.advance(4.0)
    busy, idle = clock.totals()
    assert busy == 3.0
    assert idle == {"loading_weights": 0.75, "receiving_weights": 0.75, "starting": 2.0, "waiting_for_requests": 5.0}
    assert busy + sum(idle.values()) == pytest.approx(fake.now - 100.0)


def test_the_current_state_counts_up_to_now():
    fake = FakeTime()
    clock = generator_clock(fake)
    clock.started()
    with clock.busy():
        fake.advance(7.0)
        busy, _ = clock.totals()  # a scrape in the middle of a long generate call
    assert busy == 7.0


def test_unknown_reason_is_refused():
    with pytest.raises(ValueError, match="unknown idle reason"):
        with generator_clock(FakeTime()).idle("napping"):
            pass


def test_busy_plus_idle_equals_wall_time_under_threads():
    """Real time, several threads entering and leaving overlapping activities."""
    before = time.monotonic()
    clock = ExecutorClock(("loading_weights", "receiving_weights"), "waiting_for_requests")
    clock.started()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            activity = clock.busy() if rng.random() < 0.5 else clock.idle(rng.choice(clock.reasons[:2]))
            with activity:
                time.sleep(rng.uniform(0, 0.002))
            time.sleep(rng.uniform(0, 0.002))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    busy, idle = clock.totals()
    wall = time.monotonic() - before
    assert busy > 0 and idle["waiting_for_requests"] > 0
    assert busy + sum(idle.values()) == pytest.approx(wall, abs=0.005)


def test_spans_file_replays_the_clock_and_counts_restarts(tmp_path):
    path = tmp_path / "spans" / "generator-0.jsonl"
    fake = FakeTime()
    first = SpanLog(path)
    clock = generator_clock(fake, first.change)
    fake.advance(1.0)
    clock.started()
    with clock.busy():
        fake.advance(2.0)
    fake.advance(0.5)
    clock.close()
    assert first.previous_starts == 0
    again = SpanLog(path)  # the worker restarted
    assert again.previous_starts == 1
    spans = read_spans(path, until=2_000.0)
    assert [(s.state, s.end - s.start) for s in spans] == [
        ("starting", 1.0), ("busy", 2.0), ("waiting_for_requests", 0.5)]
    busy, idle = clock.totals()
    assert sum(s.end - s.start for s in spans) == pytest.approx(busy + sum(idle.values()))


def test_an_open_state_lasts_until_the_given_end(tmp_path):
    path = tmp_path / "trainer-1.jsonl"
    fake = FakeTime()
    clock = ExecutorClock(("waiting_for_rank0",), "waiting_for_rank0", SpanLog(path).change, now=fake,
                          wall=lambda: 50.0)
    clock.started()
    with clock.busy():
        fake.advance(1.0)
    spans = read_spans(path, until=60.0)  # killed while waiting: no "end" line
    assert [(s.state, s.start, s.end) for s in spans] == [("busy", 50.0, 51.0), ("waiting_for_rank0", 51.0, 60.0)]
