"""One metrics.jsonl line per trainer step."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from rlfleet.v1 import generator_pb2
from rlfleet.workers.controller.ledger import REFUSED, TOO_LONG
from rlfleet.workers.controller.rollouts import GUIDE, Batch, Rollout
from rlfleet.workers.scorer.batch import named_means

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
# Status is a read of counters: a replica that needs longer is as good as down for this step's record.
STATUS_SECONDS = 2.0


class GeneratorTimes:
    """Per-step deltas of the generators' busy and idle seconds (from their Status calls)."""

    def __init__(self, generators: list[Any], job_id: str, is_up: Callable[[int], bool] = lambda replica: True):
        self.generators = generators
        self.job_id = job_id
        self.is_up = is_up
        self.last_time = time.perf_counter()
        self.last = self._read()

    def lap(self) -> tuple[float, float, float]:
        """(step seconds, generator busy, generator idle) since the previous lap."""
        now, (busy, idle) = time.perf_counter(), self._read()
        lap = (now - self.last_time, busy - self.last[0], idle - self.last[1])
        self.last_time, self.last = now, (busy, idle)
        return lap

    def _read(self) -> tuple[float, float]:
        busy = idle = 0.0
        for replica, generator in enumerate(self.generators):
            if not self.is_up(replica):  # a stopped one would cost every step its deadline
                continue
            try:
                reply = generator.Status(generator_pb2.GeneratorStatusRequest(job_id=self.job_id),
                                         timeout=STATUS_SECONDS)
            except Exception:  # noqa: BLE001 - a replica that is down contributes nothing this step
                continue
            busy, idle = busy + reply.busy_seconds, idle + reply.idle_seconds
        return busy, idle


def step_record(step: int, batch: Batch, fresh: list[Rollout], stale: list[Rollout], metrics: dict[str, float],
                idle: float, generator_times: GeneratorTimes) -> dict[str, Any]:
    step_seconds, gen_busy, gen_idle = generator_times.lap()
    # What the policy earns: a guide's reward is the reference answer's, not a sample's.
    rewards = [r.reward for r in batch.rollouts if not _guided(r)]
    return {
        "step": step + 1,
        "time": time.time(),
        "policy_version": step + 1,
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        # Over the whole batch, dropped samples included: the bound is on what the producers made, and a
        # maximum over the kept samples alone could never exceed it.
        "max_staleness": max((step - r.version for r in batch.rollouts), default=0),
        # Over the samples that trained alone: the ledger's witness that the bound held (<= maxStaleness).
        "max_trained_staleness": max((step - r.version for r in fresh), default=0),
        "step_seconds": step_seconds,
        "generator_busy_seconds": max(0.0, gen_busy),
        "generator_idle_seconds": max(0.0, gen_idle),
        "trainer_busy_seconds": max(0.0, step_seconds - idle),
        "trainer_idle_seconds": idle,
        "tokens_generated": sum(len(r.completion_ids) for r in batch.rollouts),
        "samples_trained": len(fresh),
        "samples_dropped_stale": len(stale),
        "prompts_too_long": batch.dropped.get(TOO_LONG, 0),
        "prompts_refused": batch.dropped.get(REFUSED, 0),
        "scorer_errors": sum(len(r.scorer_errors) for r in batch.rollouts),
        "guides": sum(_guided(r) for r in batch.rollouts),
        "finished_fraction": sum(r.finished for r in batch.rollouts) / max(1, len(batch.rollouts)),
        "segments": batch.visits,
        "resumed_sequences": batch.resumed,
        "generator_replica": batch.replica,
        **_reward_model_mean(batch.rollouts),
        **scorer_means(batch.rollouts),
        **_failures(batch.rollouts),
        **metrics,
    }


def _guided(rollout: Rollout) -> bool:
    return any(turn.kind == GUIDE for turn in rollout.turns)


def _reward_model_mean(rollouts: list[Rollout]) -> dict[str, float]:
    """The reward model's own mean score (unweighted), in a job with one."""
    learned = [r.reward_model_score for r in rollouts if r.reward_model_score is not None]
    return {"reward_model_mean": sum(learned) / len(learned)} if learned else {}


def scorer_means(rollouts: list[Rollout]) -> dict[str, float]:
    """Each scorer's own mean score (`scorer/<name>`, before its weight) and each python scorer component's mean
    (`reward/<name>`) over the policy's samples (`named_means`)."""
    scored = [r for r in rollouts if not _guided(r)]
    return named_means([r.scorer_scores for r in scored], [r.components for r in scored])


def _failures(rollouts: list[Rollout]) -> dict[str, int]:
    """Failed scorer calls by reason (`scorer_failures/<reason>`), the reasons that occurred this step only."""
    return {f"scorer_failures/{reason}": count
            for reason, count in sorted(Counter(f for r in rollouts for f in r.scorer_failures).items())}


def keep_lines_until(path: Path, step: int) -> list[dict[str, Any]]:
    """On a resume from `step`, move the lines (metrics.jsonl, prompts.jsonl) of later steps to the side file
    (`superseded_path`) and return them: those steps are trained again, and each must appear once in the run's
    own file, while what the lost steps recorded stays on disk. A line torn by a kill is dropped. Rewritten
    through a temporary file, so a crash here loses nothing."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    whole = [(line, json.loads(line)) for line in lines if line.endswith("\n")]
    kept = [line for line, record in whole if record["step"] <= step]
    if len(kept) == len(lines):
        return []
    later = [(line, record) for line, record in whole if record["step"] > step]
    with open(superseded_path(path), "a", encoding="utf-8") as side:
        side.write("".join(line for line, _ in later))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    log.info("resuming at step %d: %d lines of later steps moved from %s to %s", step, len(later), path.name,
             superseded_path(path).name)
    return [record for _, record in later]


def superseded_path(path: Path) -> Path:
    """Where a resume puts the lines of the steps it trains again: metrics.jsonl -> metrics.superseded.jsonl."""
    return path.with_suffix(".superseded.jsonl")


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    log.info("step %d reward %.3f staleness %d", record["step"], record["reward_mean"], record["max_staleness"])
