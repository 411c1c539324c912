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
from rlfleet.workers.controller.rollouts import Batch, Rollout, group_rewards, guided, sampled_entropy
from rlfleet.workers.scorer.batch import named_means

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
# Status is a read of counters: a replica that needs longer is as good as down for this step's record.
STATUS_SECONDS = 2.0


class GeneratorTimes:
    """Per-step deltas of the generators' busy and idle seconds (from their Status calls), in all and by replica."""

    def __init__(self, generators: list[Any], job_id: str, is_up: Callable[[int], bool] = lambda replica: True):
        self.generators = generators
        self.job_id = job_id
        self.is_up = is_up
        self.last_time = time.perf_counter()
        self.last = self._read()

    def lap(self) -> tuple[float, float, float, dict[int, tuple[float, float]]]:
        """(step seconds, generator busy, generator idle, {replica: (busy, idle)}) since the previous lap; a replica
        is in the last only if it answered both times."""
        now, times = time.perf_counter(), self._read()
        by_replica = {replica: (busy - self.last[replica][0], idle - self.last[replica][1])
                      for replica, (busy, idle) in times.items() if replica in self.last}
        lap = (now - self.last_time, _sum(times, 0) - _sum(self.last, 0), _sum(times, 1) - _sum(self.last, 1),
               by_replica)
        self.last_time, self.last = now, times
        return lap

    def _read(self) -> dict[int, tuple[float, float]]:
        times = {}
        for replica, generator in enumerate(self.generators):
            if not self.is_up(replica):  # a stopped one would cost every step its deadline
                continue
            try:
                reply = generator.Status(generator_pb2.GeneratorStatusRequest(job_id=self.job_id),
                                         timeout=STATUS_SECONDS)
            except Exception:  # noqa: BLE001 - a replica that is down contributes nothing this step
                continue
            times[replica] = (reply.busy_seconds, reply.idle_seconds)
        return times


def _sum(times: dict[int, tuple[float, float]], which: int) -> float:
    return sum(pair[which] for pair in times.values())


def step_record(step: int, batch: Batch, fresh: list[Rollout], stale: list[Rollout], metrics: dict[str, float],
                idle: float, generator_times: GeneratorTimes) -> dict[str, Any]:
    step_seconds, gen_busy, gen_idle, by_replica = generator_times.lap()
    # What the policy earns: a guide's reward is the reference answer's, not a sample's.
    rewards = [r.reward for r in batch.rollouts if not guided(r)]
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
        "guides": sum(guided(r) for r in batch.rollouts),
        "sampled_entropy": sampled_entropy(batch.rollouts) or 0.0,
        "uniform_groups": uniform_groups(batch.rollouts),
        "finished_fraction": sum(r.finished for r in batch.rollouts) / max(1, len(batch.rollouts)),
        "segments": batch.visits,
        "resumed_sequences": batch.resumed,
        "generator_replica": batch.replica,
        **_generator_shares(batch, by_replica),
        **_replica_times(by_replica),
        **_reward_model_mean(batch.rollouts),
        **scorer_means(batch.rollouts),
        **_failures(batch.rollouts),
        **metrics,
    }


def uniform_groups(rollouts: list[Rollout]) -> float:
    """The share of the batch's groups whose own samples all scored alike: all their advantages are 0, so under a
    group baseline they teach nothing."""
    groups = group_rewards(rollouts)
    return sum(len(rewards) == 1 for rewards in groups) / max(1, len(groups))


def _generator_shares(batch: Batch, answered: dict[int, Any]) -> dict[str, float]:
    """Each replica's share of the step's rollouts (`generator_share/<replica>`; a batch is split by throughput), 0 for
    a replica that answered its Status but made none."""
    total = sum(batch.shares.values())
    if not total:
        return {}
    return {f"generator_share/{replica}": batch.shares.get(replica, 0) / total
            for replica in sorted(set(batch.shares) | set(answered))}


def _replica_times(by_replica: dict[int, tuple[float, float]]) -> dict[str, float]:
    """Each replica's busy and idle seconds over the step (`generator_busy_seconds/<replica>`, `.._idle_..`): the idle
    ones are its bubble."""
    fields = {}
    for replica, (busy, idle) in sorted(by_replica.items()):
        fields[f"generator_busy_seconds/{replica}"] = max(0.0, busy)
        fields[f"generator_idle_seconds/{replica}"] = max(0.0, idle)
    return fields


def _reward_model_mean(rollouts: list[Rollout]) -> dict[str, float]:
    """The reward model's own mean score (unweighted), in a job with one."""
    learned = [r.reward_model_score for r in rollouts if r.reward_model_score is not None]
    return {"reward_model_mean": sum(learned) / len(learned)} if learned else {}


def scorer_means(rollouts: list[Rollout]) -> dict[str, float]:
    """Each scorer's own mean score (`scorer/<name>`, before its weight) and each python scorer component's mean
    (`reward/<name>`) over the policy's samples (`named_means`)."""
    scored = [r for r in rollouts if not guided(r)]
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
