"""The metrics each role exports beyond the executor clock. Every name is listed in docs/metrics.md.

Updated once per request or per trainer step, never per token in Python.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Any, Callable, Iterable

from prometheus_client.core import HistogramMetricFamily

from rlfleet.workers.metrics.exporter import WorkerMetrics

# Weight-sync phases take milliseconds (tiny models) to tens of seconds (large ones over TCP).
SYNC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Staleness is a whole number of policy versions, bounded by maxStaleness (usually <= 8).
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)
# metrics.jsonl field -> the reason label of rlfleet_prompts_dropped_total.
DROPPED_PROMPTS = {"prompts_too_long": "too_long", "prompts_refused": "refused"}
# metrics.jsonl's episode counts (environment/stage.py: episode_metrics) by rlfleet_episodes_total's kind.
EPISODE_KINDS = {"episodes_across_versions": "across_versions", "episodes_drifted": "drifted",
                 "episodes_restarted": "restarted", "episodes_truncated": "truncated",
                 "environment_errors": "environment_error"}
ENVIRONMENT_STEP_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0)


class GeneratorMetrics:
    """A generator's, or a reference's (which generates nothing: its requests are log-prob requests)."""

    def __init__(self, worker: WorkerMetrics, queue: str = "generate_requests"):
        self.worker = worker
        self.clock = worker.clock
        self.tokens = worker.counter("rlfleet_generated_tokens_total", "Completion tokens generated")
        self.requests = worker.gauge("rlfleet_queue_depth", "Requests or batches waiting or in progress",
                                     ["queue"]).labels(queue=queue)
        sync = worker.histogram("rlfleet_weight_sync_seconds", "Weight push phases (pack on trainers; "
                                "transfer and load on generators)", SYNC_BUCKETS, ["phase"])
        self.transfer = sync.labels(phase="transfer")
        self.load = sync.labels(phase="load")
        self.version = worker.gauge("rlfleet_policy_version", "Policy version of the weights in use")


class ReferenceMetrics(GeneratorMetrics):
    """The reference executor's: weight pushes like a generator's, log-prob requests and the tokens it scored."""

    def __init__(self, worker: WorkerMetrics):
        super().__init__(worker, "logprob_requests")
        self.scored = worker.counter("rlfleet_reference_tokens_total",
                                     "Completion tokens the reference scored (log pi_ref)")


class CriticMetrics:
    """The critic executor's: the tokens it valued and learned from, and its version (updates so far)."""

    def __init__(self, worker: WorkerMetrics):
        self.worker = worker
        self.clock = worker.clock
        self.requests = worker.gauge("rlfleet_queue_depth", "Requests or batches waiting or in progress",
                                     ["queue"]).labels(queue="critic_requests")
        self.valued = worker.counter("rlfleet_critic_valued_tokens_total", "Completion tokens the critic valued")
        self.trained = worker.counter("rlfleet_critic_trained_tokens_total",
                                      "Completion tokens the critic learned from (once per batch, whatever the epochs)")
        self.version = worker.gauge("rlfleet_critic_version", "Critic updates (batches learned from) so far")


class ScorerMetrics:
    def __init__(self, worker: WorkerMetrics, error_counts: Callable[[], dict[str, int]],
                 failure_counts: Callable[[], dict[tuple[str, str], int]] = dict):
        self.worker = worker
        self.clock = worker.clock
        self.items = worker.counter("rlfleet_scored_items_total", "Completions scored")
        self.requests = worker.gauge("rlfleet_queue_depth", "Requests or batches waiting or in progress",
                                     ["queue"]).labels(queue="score_requests")
        worker.counter_callback("rlfleet_scorer_errors_total", "Scorer calls that raised, timed out or "
                                "returned a value outside [0, 1] (scored 0)", "scorer", error_counts)
        worker.counter_callback("rlfleet_scorer_failures_total", "Scorer calls scored 0, by scorer and reason "
                                "(docs/rewards.md: Failures)", ("scorer", "reason"), failure_counts)


class EnvironmentMetrics:
    def __init__(self, worker: WorkerMetrics, counts: Any):
        """`counts`: the replica's environment/server.py EnvironmentCounts."""
        self.clock = worker.clock
        self.step_seconds = worker.histogram("rlfleet_environment_step_seconds", "Time of one environment step "
                                             "(tools included): the environment's latency", ENVIRONMENT_STEP_BUCKETS)
        worker.counter_callback("rlfleet_tool_calls_total", "Tool calls the environments ran, by tool", "tool",
                                lambda: dict(counts.tool_calls))
        worker.counter_callback("rlfleet_tool_errors_total", "Tool calls that failed or did not parse, by tool",
                                "tool", lambda: dict(counts.tool_errors))
        worker.counter_callback("rlfleet_environment_errors_total", "Episodes ended by an environment that raised, "
                                "hung or could not start, by reason", "reason", lambda: dict(counts.errors))



class ControllerMetrics:
    """Trainer rank 0: the loop's view of each step."""

    def __init__(self, worker: WorkerMetrics, queues: dict[str, Callable[[], float]] | None = None):
        self.worker = worker
        self.clock = worker.clock
        self.step_seconds = worker.histogram("rlfleet_step_seconds", "Wall time of one trainer step",
                                             STEP_BUCKETS)
        self.step = worker.gauge("rlfleet_step", "Trainer steps done")
        self.version = worker.gauge("rlfleet_policy_version", "Policy version of the weights in use")
        self.reward = worker.gauge("rlfleet_reward_mean", "Mean reward of the last step's batch")
        # metrics.jsonl's scorer/<name> and reward/<name> (controller/record.py: scorer_means), their held-out
        # eval_ twins (evaluation/held_out.py), and the generators' per-replica fields, by label.
        self.named_means = {
            "scorer": ("scorer", worker.gauge("rlfleet_scorer_mean", "Each scorer's own mean score over the last "
                                              "step's batch, before its weight", ["scorer"])),
            "reward": ("component", worker.gauge("rlfleet_reward_component_mean", "Mean of each named component of "
                                                 "python scorers over the last step's batch", ["component"])),
            "eval_scorer": ("scorer", worker.gauge("rlfleet_eval_scorer_mean", "Each scorer's own mean score over "
                                                   "the held-out prompts at the last evaluation in the loop, before "
                                                   "its weight", ["scorer"])),
            "eval_reward": ("component", worker.gauge("rlfleet_eval_reward_component_mean", "Mean of each named "
                                                      "component of python scorers over the held-out prompts at the "
                                                      "last evaluation in the loop", ["component"])),
            # Each generator replica's measured throughput and share of the last step (controller/throughput.py).
            "generator_throughput": ("replica", worker.gauge(
                "rlfleet_generator_throughput_tokens_per_second", "Each generator replica's measured throughput: "
                "completion tokens a second of its Generate calls, smoothed over the parts it finished", ["replica"])),
            "generator_share": ("replica", worker.gauge("rlfleet_generator_share_ratio", "Each generator replica's "
                                                        "share of the last step's rollouts", ["replica"])),
        }
        self.clip = worker.gauge("rlfleet_clip_fraction_ratio", "Share of the last step's tokens the loss "
                                 "clipped, with AIPO those whose pi/mu exceeded rho (rank 0's shard)")
        self.ess = worker.gauge("rlfleet_importance_ess_ratio", "Normalised effective sample size of the "
                                "last step's importance ratios, 1 = all equal (rank 0's shard)")
        self.gap = worker.gauge("rlfleet_logprob_gap_nats", "Mean |log pi - log mu| over the last step's "
                                "tokens (rank 0's shard)")
        self.kl = worker.gauge("rlfleet_kl_mean", "Token mean of the KL(pi || pi_ref) estimate over the last step's "
                               "tokens (jobs with a reference executor; NaN without)")
        self.kl.set(float("nan"))
        self.reward_model = worker.gauge("rlfleet_reward_model_mean", "Mean score of the reward model over the last "
                                         "step's batch, before its weight (jobs with a reward model; NaN without)")
        self.reward_model.set(float("nan"))
        self.value_loss = worker.gauge("rlfleet_value_loss", "The critic's value loss on the last step's batch, "
                                       "with the values its advantages used (jobs with a critic; NaN without)")
        self.explained_variance = worker.gauge("rlfleet_value_explained_variance_ratio", "1 - Var(returns - values) "
                                               "/ Var(returns) over the last step's tokens (jobs with a critic)")
        for gauge in (self.value_loss, self.explained_variance):
            gauge.set(float("nan"))
        self.trained = worker.counter("rlfleet_trained_tokens_total", "Completion tokens trained on")
        samples = worker.counter("rlfleet_samples_total", "Rollouts taken by the trainer, by fate", ["fate"])
        self.trained_samples = samples.labels(fate="trained")  # both exported from the start, as 0
        self.dropped_samples = samples.labels(fate="dropped_stale")
        self.guides = worker.counter("rlfleet_guides_total", "Reference solutions trained on in the place of a group's "
                                     "last completion (algorithm.guidance)")
        prompts = worker.counter("rlfleet_prompts_dropped_total", "Prompts never generated, by reason: longer "
                                 "than the generators' budget, or refused by a generator", ["reason"])
        self.dropped_prompts = {field: prompts.labels(reason=reason) for field, reason in DROPPED_PROMPTS.items()}
        self.pack = worker.histogram("rlfleet_weight_sync_seconds", "Weight push phases (pack on trainers; "
                                     "transfer and load on generators)", SYNC_BUCKETS, ["phase"]
                                     ).labels(phase="pack")
        self.turns = worker.gauge("rlfleet_episode_turns_mean", "The policy's turns per episode over the last step's "
                                  "batch (jobs with an environment; NaN without)")
        self.tool_share = worker.gauge("rlfleet_tool_episode_ratio", "Share of the last step's episodes that called "
                                       "a tool (jobs with an environment; NaN without)")
        for gauge in (self.turns, self.tool_share):
            gauge.set(float("nan"))
        episodes = worker.counter("rlfleet_episodes_total", "Trained episodes by outcome: their sampled tokens span "
                                  "several versions, their chat drifted, restarted as a new sample, hit a limit, or "
                                  "ended in an environment error", ["kind"])
        self.episodes = {field: episodes.labels(kind=kind) for field, kind in EPISODE_KINDS.items()}
        self.eval_accuracy = worker.gauge("rlfleet_eval_accuracy_ratio", "Greedy accuracy on the held-out prompts "
                                          "of the last evaluation in the loop (NaN before the first, and in a job "
                                          "without an answer-grading scorer)")
        self.eval_reward = worker.gauge("rlfleet_eval_reward_mean", "Mean reward (the job's scorers, weighted) of "
                                        "the greedy held-out completions at the last evaluation in the loop (NaN "
                                        "before the first)")
        self.eval_version = worker.gauge("rlfleet_eval_policy_version", "Policy version the last evaluation in "
                                         "the loop scored (NaN before the first)")
        for gauge in (self.eval_accuracy, self.eval_reward, self.eval_version):
            gauge.set(float("nan"))  # no data until an evaluation finished, rather than a false 0
        self.staleness = TokenStaleness(worker.labels)
        worker.registry.register(self.staleness)
        depth = worker.gauge("rlfleet_queue_depth", "Requests or batches waiting or in progress", ["queue"])
        for queue, read in (queues or {}).items():
            depth.labels(queue=queue).set_function(read)

    def observe_step(self, record: dict[str, Any], step: int, fresh: Iterable[Any]) -> None:
        """After trainer step `step` (0-based) trained the rollouts `fresh`; `record` is its metrics line."""
        self.step_seconds.observe(record["step_seconds"])
        self.step.set(record["step"])
        self.version.set(record["policy_version"])
        self.reward.set(record["reward_mean"])
        self.trained_samples.inc(record["samples_trained"])
        self.dropped_samples.inc(record["samples_dropped_stale"])
        self.guides.inc(record["guides"])
        for field, counter in self.dropped_prompts.items():
            counter.inc(record[field])
        if "clip_fraction" in record:  # absent when the step trained nothing
            self.clip.set(record["clip_fraction"])
            self.ess.set(record["ess"])
            self.gap.set(record["logprob_gap"])
        if "kl_mean" in record:
            self.kl.set(record["kl_mean"])
        if "reward_model_mean" in record:
            self.reward_model.set(record["reward_model_mean"])
        if "turns_mean" in record:
            self.turns.set(record["turns_mean"])
            self.tool_share.set(record["tool_episode_share"])
            for field, counter in self.episodes.items():
                counter.inc(record[field])
        self._set_named(record)
        if "value_loss" in record:
            self.value_loss.set(record["value_loss"])
            self.explained_variance.set(record["explained_variance"])
        if "sync_pack_seconds" in record:
            self.pack.observe(record["sync_pack_seconds"])
        versions = Counter(itertools.chain.from_iterable(r.versions for r in fresh))  # counted in C
        self.trained.inc(sum(versions.values()))
        self.staleness.add({step - version: count for version, count in versions.items()})


    def observe_eval(self, fields: dict[str, Any]) -> None:
        """A held-out evaluation's metrics.jsonl fields (evaluation/in_loop.py: EvalResult.fields); a job without an
        answer-grading scorer has no accuracy (nor had a record of a version before evaluations had a reward)."""
        for key, gauge in (("eval_accuracy", self.eval_accuracy), ("eval_reward_mean", self.eval_reward),
                           ("eval_policy_version", self.eval_version)):
            if key in fields:
                gauge.set(fields[key])
        self._set_named(fields)

    def _set_named(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            prefix, slash, name = key.partition("/")
            if slash and prefix in self.named_means:
                label, gauge = self.named_means[prefix]
                gauge.labels(**{label: name}).set(value)


class TokenStaleness:
    """Histogram of `step - version` over every trained token, added in bulk (a Histogram observes one
    value at a time, which would be a Python call per token)."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self._counts: Counter[int] = Counter()
        self._lock = threading.Lock()

    def add(self, counts: dict[int, int]) -> None:
        with self._lock:
            self._counts.update(counts)

    def collect(self):
        with self._lock:
            counts = dict(self._counts)
        buckets = [(str(bound), sum(c for s, c in counts.items() if s <= bound)) for bound in STALENESS_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))
        family = HistogramMetricFamily("rlfleet_trained_token_staleness_versions",
                                       "Policy versions between a trained token's sampler and the trained policy",
                                       labels=list(self.labels))
        family.add_metric(list(self.labels.values()), buckets, sum(s * c for s, c in counts.items()))
        return [family]
