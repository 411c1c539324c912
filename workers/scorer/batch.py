"""`Scoring`: runs a job's scorers on a batch in a child process it can kill on a timeout."""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlfleet.workers.scorer.rules import Scorer, scorer_for
from rlfleet.workers.scorer.config import ScorerSpec

log = logging.getLogger(__name__)

# Spawning and importing takes seconds on a busy node; it must not count against any item's timeout.
STARTUP_SECONDS = 60.0
# The child sends results at most this often: one message per call would cost more than the call.
FLUSH_SECONDS = 0.01


@dataclass
class ItemScore:
    reward: float
    """Sum over scorers of weight * score; a failed scorer contributes 0."""
    errors: list[str] = field(default_factory=list)
    """Names of the scorers that raised, timed out or returned a value outside [0, 1]."""


def scorer_names(specs: Sequence[ScorerSpec]) -> list[str]:
    """One stable name per scorer: its type, plus its position when the type repeats."""
    types = [spec.type for spec in specs]
    return [t if types.count(t) == 1 else f"{t}#{i}" for i, t in enumerate(types)]


class Scoring:
    """Scores batches with a job's scorers in one child process, killed and restarted on a timeout.

    Calls are numbered item * len(specs) + scorer. The batch goes to the child in one message; the
    child publishes in shared memory which call it is running and since when (time.monotonic is
    system-wide), and sends results every FLUSH_SECONDS. When the running call passes its own
    timeout_seconds, the parent kills the child, scores that call 0, and sends the calls still
    without a result to a new child. `error_counts` counts failures per scorer name since start.
    """

    def __init__(self, specs: Sequence[ScorerSpec]):
        self.specs = list(specs)
        self.names = scorer_names(self.specs)
        self.error_counts = {name: 0 for name in self.names}
        # forkserver: fast restarts, and never a fork of a process that runs gRPC threads.
        # Preloading __main__ (the default) spares every child from re-running the main script.
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["__main__", __name__])
        self._progress = self._ctx.RawArray("d", 2)  # [running call, its start time]
        self._lock = threading.Lock()
        self._child: Any = None
        self._conn: Any = None

    def score(self, items: Sequence[tuple[str, str]]) -> list[ItemScore]:
        """Score (completion, answer) pairs; one ItemScore per pair, in order."""
        n = len(self.specs)
        scores = [[0.0] * n for _ in items]
        errors: list[list[str]] = [[] for _ in items]
        with self._lock:
            pending = list(range(len(items) * n))
            while pending:
                pending = self._run(items, pending, scores, errors)
        weights = [spec.weight for spec in self.specs]
        return [
            ItemScore(sum(w * s for w, s in zip(weights, row)), errs) for row, errs in zip(scores, errors)
        ]

    def close(self) -> None:
        """Stop the child; the next batch would start a new one."""
        with self._lock:
            self._kill()  # it holds no state worth a graceful exit

    def __enter__(self) -> Scoring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, items: Sequence[tuple[str, str]], pending: list[int], scores: list, errors: list) -> list:
        """Run the pending calls in the child until done or one fails hard; returns the calls left."""
        n = len(self.specs)
        base = pending[0] // n * n  # send only the items from the first pending one on
        conn = self._started()
        conn.send((list(items[base // n :]), [k - base for k in pending]))
        self._await_ready(conn)  # receiving a large batch must not eat into the first call's timeout
        done = 0
        while done < len(pending):
            results, failed = self._next_results(conn, base)
            for value, error in results:
                self._record(pending[done], value, error, scores, errors)
                done += 1
            if failed is not None:
                name, item = self.names[failed % n], failed // n
                log.warning("scorer %s hung or crashed on item %d; restarting the child", name, item)
                self._kill()
                self._fail(errors, failed)
                return [k for k in pending[done:] if k != failed]
        return []

    def _next_results(self, conn: Any, base: int) -> tuple[list, int | None]:
        """The child's next results, or ([], call) when `call` overran its timeout or killed the child."""
        while True:
            running = base + int(self._progress[0])
            deadline = self._progress[1] + self.specs[running % len(self.specs)].timeout_seconds
            if conn.poll(max(0.0, deadline - time.monotonic())):
                try:
                    return conn.recv(), None
                except (EOFError, OSError):
                    return [], base + int(self._progress[0])
            if base + int(self._progress[0]) == running:
                return [], running
            # Otherwise that call finished in time and its result waits in the child's buffer.

    def _record(self, call: int, value: float | None, error: str | None, scores: list, errors: list) -> None:
        item, j = divmod(call, len(self.specs))
        if error is None and value is not None and math.isfinite(value) and 0.0 <= value <= 1.0:
            scores[item][j] = value
        else:
            log.debug("scorer %s on item %d: %s", self.names[j], item, error or f"returned {value}")
            self._fail(errors, call)

    def _fail(self, errors: list[list[str]], call: int) -> None:
        item, j = divmod(call, len(self.specs))
        errors[item].append(self.names[j])
        self.error_counts[self.names[j]] += 1

    def _started(self) -> Any:
        if self._child is not None and not self._child.is_alive():
            self._kill()  # died between batches (e.g. killed for memory): start afresh
        if self._child is None:
            self._conn, theirs = self._ctx.Pipe()
            args = (theirs, self.specs, self._progress)
            self._child = self._ctx.Process(target=_child_main, args=args, name="rlfleet-scorer", daemon=True)
            self._child.start()
            theirs.close()
            self._await_ready(self._conn)
        return self._conn

    def _await_ready(self, conn: Any) -> None:
        try:
            if conn.poll(STARTUP_SECONDS) and conn.recv() == "ready":
                return
        except EOFError:
            pass
        self._kill()
        raise RuntimeError(f"scorer child not ready within {STARTUP_SECONDS}s")

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
            self._conn.close()
            self._child = self._conn = None


def _child_main(conn: Any, specs: list[ScorerSpec], progress: Any) -> None:
    """Child loop: run each batch's calls in order, publishing progress, sending results in chunks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    scorers = [scorer_for(spec) for spec in specs]
    conn.send("ready")
    while True:
        try:
            items, calls = conn.recv()
        except EOFError:  # the parent is gone
            return
        results, flushed = [], time.monotonic()
        for index, call in enumerate(calls):
            item, j = divmod(call, len(specs))
            # Time before index: a reader never pairs this call with an older start time.
            progress[1] = time.monotonic()
            progress[0] = call
            if index == 0:
                conn.send("ready")  # progress is valid from here on
            results.append(_call(scorers[j], items[item], specs[j]))
            if time.monotonic() - flushed > FLUSH_SECONDS:
                conn.send(results)
                results, flushed = [], time.monotonic()
        if results:
            conn.send(results)


def _call(scorer: Scorer, item: tuple[str, str], spec: ScorerSpec) -> tuple[float | None, str | None]:
    try:
        return float(scorer(item[0], item[1], spec)), None
    except Exception as err:  # noqa: BLE001 - any scorer failure is a 0 and a counted error
        return None, f"{type(err).__name__}: {err}"[:200]
