"""`Scoring`: runs a job's scorers on a batch in a pool of child processes it can kill on a timeout."""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from rlfleet.workers.scorer.config import ScorerSpec
from rlfleet.workers.scorer.python import BadResult, checked_result, load_function
from rlfleet.workers.scorer.rules import scorer_for

log = logging.getLogger(__name__)

# Spawning and importing takes seconds on a busy node; it must not count against any item's timeout.
STARTUP_SECONDS = 60.0
# The child sends results at most this often: one message per call would cost more than the call.
FLUSH_SECONDS = 0.01
# How often the parent looks which call the child runs.
PROGRESS_SECONDS = 0.05
# More children than this cost memory (each may use its scorers' memoryMib) for batches that rarely need them.
MAX_PROCESSES = 4


FAILURE_REASONS = ("raised", "timeout", "crashed", "memory", "wrong_type", "nonfinite", "out_of_range")
"""Why a scorer call scored 0: it raised; overran timeoutSeconds; its process died (exit, signal, the kernel's OOM
killer); it raised MemoryError (a python scorer's memoryMib); it returned no number, a number that is not finite, or
(a rule scorer) one outside [0, 1]."""


class ScoreInput(NamedTuple):
    """What every scorer may read of one completion: the data row's other fields go to python scorers and, a
    reasoning-gym problem's metadata, to the reasoning_gym scorer."""

    completion: str
    answer: str
    prompt: str = ""
    fields: dict[str, Any] = {}


@dataclass
class ItemScore:
    reward: float
    """Sum over scorers of weight * score; a failed scorer contributes 0."""
    errors: list[str] = field(default_factory=list)
    """Names of the scorers that failed (FAILURE_REASONS) on it."""
    reasons: list[str] = field(default_factory=list)
    """Why each scorer in `errors` failed, in the same order."""
    scores: dict[str, float] = field(default_factory=dict)
    """Each scorer's own score, before its weight, by name (0 where it failed)."""
    components: dict[str, float] = field(default_factory=dict)
    """The named parts of python scorers' scores (`component_prefixes` says how they are named)."""


def scorer_names(specs: Sequence[ScorerSpec]) -> list[str]:
    """One stable name per scorer: its type (a python scorer's: its function), plus its position when that
    repeats."""
    bases = [spec.function if spec.type == "python" else spec.type for spec in specs]
    return [b if bases.count(b) == 1 else f"{b}#{i}" for i, b in enumerate(bases)]


def component_prefixes(specs: Sequence[ScorerSpec]) -> list[str]:
    """What prefixes each scorer's component names: nothing in a job with one python scorer, else the scorer's
    name and a slash, so that two scorers' components of one name never meet in one metric."""
    names = scorer_names(specs)
    several = sum(spec.type == "python" for spec in specs) > 1
    return [f"{name}/" if several else "" for name in names]


def named_means(scores: Sequence[Mapping[str, float]], components: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each scorer's mean score (`scorer/<name>`) and each component's mean (`reward/<name>`) over the items (their
    `ItemScore.scores` and `.components`); an item without a component (its call failed) counts 0 there, so a
    scorer's component means add up to its own mean."""
    means: dict[str, float] = {}
    for prefix, rows in (("scorer/", scores), ("reward/", components)):
        names = dict.fromkeys(name for row in rows for name in row)
        means |= {prefix + name: sum(row.get(name, 0.0) for row in rows) / len(rows) for name in names}
    return means


def pool_size() -> int:
    """Child processes of a scorer: one per core it may use, at most MAX_PROCESSES."""
    return max(1, min(MAX_PROCESSES, len(os.sched_getaffinity(0))))


class Scoring:
    """Scores batches with a job's scorers in a pool of child processes, each killed and restarted on a timeout.

    A batch is cut into one contiguous part per child. `error_counts` counts failed calls per scorer name since
    start, `failure_counts` per (scorer name, reason).
    """

    def __init__(self, specs: Sequence[ScorerSpec], processes: int = 1):
        self.specs = list(specs)
        self.names = scorer_names(self.specs)
        self.prefixes = component_prefixes(self.specs)
        self.error_counts = {name: 0 for name in self.names}
        self.failure_counts: dict[tuple[str, str], int] = {}
        # forkserver: fast restarts, and never a fork of a process that runs gRPC threads.
        # Preloading __main__ (the default) spares every child from re-running the main script.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["__main__", __name__])
        self._pool = [_Child(ctx, self.specs, self.names) for _ in range(processes)]
        self._lock = threading.Lock()

    def score(self, items: Sequence[tuple]) -> list[ItemScore]:
        """Score (completion, answer[, prompt[, fields]]) tuples; one ItemScore per item, in order."""
        inputs = [ScoreInput(*item) for item in items]
        size = -(-len(inputs) // len(self._pool)) or 1
        parts = [inputs[start:start + size] for start in range(0, len(inputs), size)]
        with self._lock:
            if len(parts) == 1:
                outcomes = [self._pool[0].run(parts[0])]
            else:
                with ThreadPoolExecutor(len(parts), thread_name_prefix="scoring") as threads:
                    outcomes = list(threads.map(_Child.run, self._pool, parts, range(0, len(inputs), size)))
            n = len(self.specs)
            rows = [part[i * n:(i + 1) * n] for part in outcomes for i in range(len(part) // n)]
            return [self._item(row) for row in rows]

    def close(self) -> None:
        """Stop the children; the next batch would start new ones."""
        with self._lock:
            for child in self._pool:
                child.kill()  # it holds no state worth a graceful exit

    def __enter__(self) -> Scoring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _item(self, row: list[Outcome]) -> ItemScore:
        result = ItemScore(0.0)
        for spec, name, prefix, (value, components, reason, message) in zip(self.specs, self.names, self.prefixes,
                                                                             row):
            if reason is not None and (name, reason) not in self.failure_counts:
                log.warning("scorer %s failed (%s): %s; scored 0, and such failures are counted from now on, not "
                            "logged", name, reason, message)
            if reason is not None:
                result.errors.append(name)
                result.reasons.append(reason)
                self.error_counts[name] += 1
                self.failure_counts[name, reason] = self.failure_counts.get((name, reason), 0) + 1
                value, components = 0.0, {}
            result.scores[name] = value
            result.components |= {prefix + key: part for key, part in components.items()}
            result.reward += spec.weight * value
        return result


Outcome = tuple[float, dict[str, float], "str | None", "str | None"]
"""One call's (score, components, failure reason or None, what failed)."""


class _Child:
    """One child process of the pool, scoring one part of each batch.

    Calls are numbered item * len(specs) + scorer. The part goes to the child in one message; the child
    publishes in shared memory which call it is running and since when (time.monotonic is system-wide), and
    sends results every FLUSH_SECONDS. When the running call passes its own timeout_seconds, or the child
    dies, the parent kills it, scores that call 0, and sends the calls still without a result to a new child.
    """

    def __init__(self, ctx: Any, specs: list[ScorerSpec], names: list[str]):
        self.ctx, self.specs, self.names = ctx, specs, names
        self._progress = ctx.RawArray("d", 2)  # [running call, its start time]
        self._child: Any = None
        self._conn: Any = None

    def run(self, items: list[ScoreInput], first: int = 0) -> list[Outcome]:
        """Every call's outcome for `items` (the batch's from item `first` on), item-major."""
        outcomes: list[Outcome | None] = [None] * (len(items) * len(self.specs))
        pending = list(range(len(outcomes)))
        while pending:
            pending = self._run(items, pending, outcomes, first)
        return outcomes  # type: ignore[return-value] - every call has its outcome now

    def _run(self, items: list[ScoreInput], pending: list[int], outcomes: list, first: int) -> list[int]:
        """Run the pending calls in the child until done or one fails hard; returns the calls left."""
        n = len(self.specs)
        base = pending[0] // n * n  # send only the items from the first pending one on
        conn = self._started()
        conn.send((items[base // n :], [k - base for k in pending]))
        self._await_ready(conn)  # receiving a large batch must not eat into the first call's timeout
        done = 0
        while done < len(pending):
            results, failed, reason = self._next_results(conn, base)
            for outcome in results:
                outcomes[pending[done]] = outcome
                done += 1
            if failed is not None:
                name, item = self.names[failed % n], first + failed // n
                what = f"over {self.specs[failed % n].timeout_seconds} s" if reason == "timeout" else "its process died"
                log.warning("scorer %s %s on item %d; restarting the child", name, what, item)
                self.kill()
                outcomes[failed] = (0.0, {}, reason, what)
                return [k for k in pending[done:] if k != failed]
        return []

    def _next_results(self, conn: Any, base: int) -> tuple[list, int | None, str | None]:
        """The child's next results, or ([], call, reason) when `call` overran its timeout or killed the child."""
        while True:
            running = base + int(self._progress[0])
            deadline = self._progress[1] + self.specs[running % len(self.specs)].timeout_seconds
            # The child moves on to the next call without a word (it sends results in chunks): looking again
            # every PROGRESS_SECONDS, a call of a short timeout after one of a long one stops at its own.
            if conn.poll(min(PROGRESS_SECONDS, max(0.0, deadline - time.monotonic()))):
                try:
                    return conn.recv(), None, None
                except (EOFError, OSError):
                    return [], base + int(self._progress[0]), "crashed"
            if time.monotonic() >= deadline and base + int(self._progress[0]) == running:
                return [], running, "timeout"
            # Otherwise that call is within its time, or finished and its result waits in the child's buffer.

    def _started(self) -> Any:
        if self._child is not None and not self._child.is_alive():
            self.kill()  # died between batches (e.g. killed for memory): start afresh
        if self._child is None:
            self._conn, theirs = self.ctx.Pipe()
            args = (theirs, self.specs, self._progress)
            self._child = self.ctx.Process(target=_child_main, args=args, name="rlfleet-scorer", daemon=True)
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
        self.kill()
        raise RuntimeError(f"scorer child not ready within {STARTUP_SECONDS}s")

    def kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join()
            self._conn.close()
            self._child = self._conn = None


def _child_main(conn: Any, specs: list[ScorerSpec], progress: Any) -> None:
    """Child loop: run each batch's calls in order, publishing progress, sending results in chunks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _limit_memory(specs)
    scorers = [_scorer(spec) for spec in specs]
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


def _limit_memory(specs: list[ScorerSpec]) -> None:
    """Python scorers may allocate their largest memoryMib over what the child holds at start (RLIMIT_DATA:
    heap and anonymous mappings, not the shared libraries); past it an allocation fails with MemoryError."""
    budgets = [spec.memory_mib for spec in specs if spec.type == "python"]
    if budgets:
        limit = _data_bytes() + max(budgets) * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _data_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _scorer(spec: ScorerSpec) -> Callable[[ScoreInput], Any]:
    if spec.type == "reasoning_gym":
        from rlfleet.workers.scorer.gym import reasoning_gym_score  # reasoning-gym: only where a job asks for it

        return lambda item: reasoning_gym_score(item.completion, item.answer, item.prompt, spec, **item.fields)
    if spec.type != "python":
        rule = scorer_for(spec)
        return lambda item: rule(item.completion, item.answer, spec)
    try:
        function = load_function(spec)
    except BaseException as err:  # noqa: BLE001 - refused before the run; if it still fails here, every call fails
        message = f"{type(err).__name__}: {err}"
        log.error("python scorer %s: %s", spec.path or spec.module, message)

        def function(*_: Any, **__: Any) -> Any:
            raise RuntimeError(f"the function did not load: {message}")

    return lambda item: function(item.completion, item.answer, item.prompt, **item.fields)


def _call(scorer: Callable[[ScoreInput], Any], item: ScoreInput, spec: ScorerSpec) -> tuple:
    """(score, components, failure reason or None, message)."""
    try:
        value = scorer(item)
        if spec.type == "python":
            return (*checked_result(value), None, None)
        value = float(value)
    except BadResult as err:
        return 0.0, {}, err.reason, str(err)
    except MemoryError:
        return 0.0, {}, "memory", "MemoryError"
    except BaseException as err:  # noqa: BLE001 - any failure, sys.exit() included, is a 0 and a counted error
        return 0.0, {}, "raised", f"{type(err).__name__}: {err}"[:200]
    if not 0.0 <= value <= 1.0:  # NaN included
        return 0.0, {}, "out_of_range", f"returned {value}"
    return value, {}, None, None
