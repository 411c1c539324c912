"""What the workers export: labels on every series, the clock's counters, and the trainer's off-policy
health computed from known importance weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rlfleet.workers.metrics.clock import ExecutorClock
from rlfleet.workers.metrics.exporter import IDLE_REASONS, WorkerMetrics
from rlfleet.workers.metrics.families import ControllerMetrics, GeneratorMetrics, ScorerMetrics
from rlfleet.workers.rl.losses import aipo_loss

LABELS = {"job": "tiny", "namespace": "ml", "role": "trainer", "rank": "0"}


@dataclass
class FakeRollout:
    versions: list[int]


def value(worker: WorkerMetrics, name: str, **labels: str) -> float | None:
    return worker.registry.get_sample_value(name, {**worker.labels, **labels})


def test_clock_counters_carry_every_reason_and_the_base_labels():
    now = [10.0]
    clock = ExecutorClock(IDLE_REASONS["trainer"], "bookkeeping", now=lambda: now[0])
    worker = WorkerMetrics("trainer", 0, "tiny", "ml", clock=clock)
    assert worker.labels == LABELS
    now[0] += 3.0
    clock.started()
    with clock.busy():
        now[0] += 2.0
    with clock.idle("waiting_for_rollouts"):
        now[0] += 1.5
    assert value(worker, "rlfleet_busy_seconds_total") == 2.0
    assert value(worker, "rlfleet_idle_seconds_total", reason="starting") == 3.0
    assert value(worker, "rlfleet_idle_seconds_total", reason="waiting_for_rollouts") == 1.5
    assert value(worker, "rlfleet_idle_seconds_total", reason="checkpointing") == 0.0
    assert value(worker, "rlfleet_restarts_total") == 0.0
    assert value(worker, "rlfleet_worker_start_time_seconds") == pytest.approx(clock.start_wall)


def test_ess_and_clip_fraction_exported_match_a_hand_computation():
    """Importance ratios 0.5, 1, 3, 4 with rho = 2: two of four clipped; ESS = (sum r)^2 / (n sum r^2)."""
    ratios = [0.5, 1.0, 3.0, 4.0]
    gen = torch.full((1, 4), -2.0, dtype=torch.float64)
    logprobs = gen + torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)
    _, aipo = aipo_loss(logprobs, gen, torch.ones(1, dtype=torch.float64), torch.ones(1, 4, dtype=torch.bool), 2.0)
    worker = WorkerMetrics("trainer", 0, "tiny", "ml")
    meters = ControllerMetrics(worker)
    record = {"step": 3, "policy_version": 3, "reward_mean": 0.25, "step_seconds": 0.4, "samples_trained": 2,
              "samples_dropped_stale": 1, "prompts_too_long": 2, "prompts_refused": 1, "guides": 1,
              "sync_pack_seconds": 0.01,
              **aipo}
    meters.observe_step(record, step=2, fresh=[FakeRollout([2, 2, 1]), FakeRollout([1, 0])])

    assert value(worker, "rlfleet_clip_fraction_ratio") == pytest.approx(2 / 4)
    assert value(worker, "rlfleet_importance_ess_ratio") == pytest.approx(8.5**2 / (4 * (0.25 + 1 + 9 + 16)))
    gap = sum(abs(math.log(r)) for r in ratios) / 4
    assert value(worker, "rlfleet_logprob_gap_nats") == pytest.approx(gap)
    assert value(worker, "rlfleet_reward_mean") == 0.25
    assert value(worker, "rlfleet_samples_total", fate="dropped_stale") == 1
    assert value(worker, "rlfleet_weight_sync_seconds_count", phase="pack") == 1
    assert value(worker, "rlfleet_prompts_dropped_total", reason="too_long") == 2
    assert value(worker, "rlfleet_prompts_dropped_total", reason="refused") == 1
    assert value(worker, "rlfleet_guides_total") == 1


def test_staleness_histogram_counts_every_trained_token():
    worker = WorkerMetrics("trainer", 0, "tiny", "ml")
    meters = ControllerMetrics(worker)
    record = {"step": 3, "policy_version": 3, "reward_mean": 0.0, "step_seconds": 0.4, "samples_trained": 2,
              "samples_dropped_stale": 0, "prompts_too_long": 0, "prompts_refused": 0, "guides": 0}
    # Step 2 (0-based) trains tokens of versions 2, 2, 1, 1, 0: staleness 0, 0, 1, 1, 2.
    meters.observe_step(record, step=2, fresh=[FakeRollout([2, 2, 1]), FakeRollout([1, 0])])
    name = "rlfleet_trained_token_staleness_versions"
    assert value(worker, f"{name}_bucket", le="0") == 2
    assert value(worker, f"{name}_bucket", le="1") == 4
    assert value(worker, f"{name}_bucket", le="2") == 5
    assert value(worker, f"{name}_bucket", le="+Inf") == 5
    assert value(worker, f"{name}_sum") == 4
    assert value(worker, "rlfleet_trained_tokens_total") == 5
    assert "clip_fraction" not in record and value(worker, "rlfleet_clip_fraction_ratio") == 0.0


def test_queue_depths_are_read_at_scrape_time():
    worker = WorkerMetrics("trainer", 0, "tiny", "ml")
    queue = [1, 2, 3]
    ControllerMetrics(worker, {"rollout_batches": lambda: len(queue)})
    assert value(worker, "rlfleet_queue_depth", queue="rollout_batches") == 3
    queue.pop()
    assert value(worker, "rlfleet_queue_depth", queue="rollout_batches") == 2


def test_each_scorers_mean_and_each_components_mean_are_gauges_and_failures_count_by_reason():
    worker = WorkerMetrics("trainer", 0, "tiny", "ml")
    record = {"step": 1, "policy_version": 1, "reward_mean": 0.7, "step_seconds": 0.4, "samples_trained": 2,
              "samples_dropped_stale": 0, "prompts_too_long": 0, "prompts_refused": 0, "guides": 0,
              "scorer/math_answer": 0.5, "scorer/python": 0.2, "reward/correct": 0.3, "reward/short": -0.1,
              "scorer_failures/timeout": 2}
    ControllerMetrics(worker).observe_step(record, step=0, fresh=[])
    assert value(worker, "rlfleet_scorer_mean", scorer="math_answer") == 0.5
    assert value(worker, "rlfleet_scorer_mean", scorer="python") == 0.2
    assert value(worker, "rlfleet_reward_component_mean", component="short") == -0.1
    scorer = WorkerMetrics("scorer", 0, "tiny", "ml")
    ScorerMetrics(scorer, lambda: {"python": 3}, lambda: {("python", "timeout"): 2, ("python", "memory"): 1})
    assert value(scorer, "rlfleet_scorer_failures_total", scorer="python", reason="timeout") == 2
    assert value(scorer, "rlfleet_scorer_failures_total", scorer="python", reason="memory") == 1


def test_scorer_errors_per_scorer_and_generator_families():
    errors = {"math_answer": 0, "regex_format": 2}
    scorer = WorkerMetrics("scorer", 1, "tiny", "ml")
    ScorerMetrics(scorer, lambda: errors)
    assert value(scorer, "rlfleet_scorer_errors_total", scorer="regex_format") == 2
    assert value(scorer, "rlfleet_scorer_errors_total", scorer="math_answer") == 0
    generator = GeneratorMetrics(WorkerMetrics("generator", 0, "tiny", "ml"))
    generator.tokens.inc(12)
    generator.load.observe(0.2)
    assert value(generator.worker, "rlfleet_generated_tokens_total") == 12
    assert value(generator.worker, "rlfleet_weight_sync_seconds_sum", phase="load") == pytest.approx(0.2)
    assert value(generator.worker, "rlfleet_idle_seconds_total", reason="loading_weights") == 0.0


def test_each_generator_replicas_throughput_and_share_are_gauges():
    worker = WorkerMetrics("trainer", 0, "tiny", "ml")
    record = {"step": 1, "policy_version": 1, "reward_mean": 0.7, "step_seconds": 0.4, "samples_trained": 2,
              "samples_dropped_stale": 0, "prompts_too_long": 0, "prompts_refused": 0, "guides": 0,
              "generator_throughput/0": 750.0, "generator_throughput/1": 250.0, "generator_share/1": 0.25}
    ControllerMetrics(worker).observe_step(record, step=0, fresh=[])
    assert value(worker, "rlfleet_generator_throughput_tokens_per_second", replica="0") == 750.0
    assert value(worker, "rlfleet_generator_throughput_tokens_per_second", replica="1") == 250.0
    assert value(worker, "rlfleet_generator_share_ratio", replica="1") == 0.25
