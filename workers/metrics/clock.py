"""The executor clock: every second of a worker's life is either busy or idle for one named reason.

Bubble ratio = idle / (idle + busy) (DESIGN §6). Activities may overlap (a generator receives weights
while it generates; a scorer serves two producers at once), so the clock keeps a count per activity
and charges each moment to the one with the highest priority: busy first, then the idle reasons in
the order given, then the executor's default reason. Busy + idle therefore always equals the wall
time since the clock started. Each change of state is handed to `on_change` (the spans file).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Callable, Iterator, Sequence

BUSY = "busy"
STARTING = "starting"
"""Idle reason of every executor from its start until it is ready (engine loaded, loop started)."""


class ExecutorClock:
    def __init__(self, reasons: Sequence[str], default: str,
                 on_change: Callable[[float, str], None] | None = None,
                 now: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        """`reasons`: idle reasons by priority (first wins); `default`: the reason when none is active.

        `on_change(wall_time, state)` is called with the state just entered ("busy" or a reason)."""
        self.reasons = tuple(dict.fromkeys([*reasons, STARTING, default]))
        self.default = default
        self._priority = (BUSY, *self.reasons)
        self._on_change = on_change
        self._now = now
        self._lock = threading.Lock()
        self._active: Counter[str] = Counter({STARTING: 1})
        self._seconds = dict.fromkeys(self._priority, 0.0)
        self._since = now()
        self.start_wall = wall()
        self._wall_offset = self.start_wall - self._since
        self.state = STARTING
        self._notify(self._since, STARTING)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        with self._during(BUSY):
            yield

    @contextlib.contextmanager
    def idle(self, reason: str) -> Iterator[None]:
        if reason not in self.reasons:
            raise ValueError(f"unknown idle reason {reason!r}; known: {', '.join(self.reasons)}")
        with self._during(reason):
            yield

    def started(self) -> None:
        """The executor is ready: `starting` ends (once; later calls do nothing)."""
        with self._lock:
            if self._active[STARTING]:
                self._active[STARTING] = 0
                self._settle()

    def totals(self) -> tuple[float, dict[str, float]]:
        """(busy seconds, idle seconds by reason) since the start, including the current state so far."""
        with self._lock:
            seconds = dict(self._seconds)
            seconds[self.state] += self._now() - self._since
        busy = seconds.pop(BUSY)
        return busy, seconds

    def close(self) -> None:
        """Record the end of the current state (a clean exit)."""
        with self._lock:
            now = self._now()
            self._seconds[self.state] += now - self._since
            self._since = now
            self._notify(now, "end")

    @contextlib.contextmanager
    def _during(self, activity: str) -> Iterator[None]:
        with self._lock:
            self._active[activity] += 1
            self._settle()
        try:
            yield
        finally:
            with self._lock:
                self._active[activity] -= 1
                self._settle()

    def _settle(self) -> None:
        """Caller holds the lock: move to the highest-priority active state, charging the one left."""
        state = next((s for s in self._priority if self._active[s] > 0), self.default)
        if state == self.state:
            return
        now = self._now()
        self._seconds[self.state] += now - self._since
        self.state, self._since = state, now
        self._notify(now, state)

    def _notify(self, monotonic: float, state: str) -> None:
        if self._on_change is not None:
            self._on_change(monotonic + self._wall_offset, state)
