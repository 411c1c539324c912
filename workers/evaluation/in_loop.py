"""Evaluation in the loop: the held-out prompts go greedily through one generator replica, in a background
thread, while training goes on, and the job's scorers grade the completions; the weights that scored best are kept
in checkpoints/best.

The generator answers with the policy version it used. The weights of the version asked for are copied
(`snapshot`) when the evaluation starts, and become checkpoints/best only if that very version was scored
and beat the best so far, so the best checkpoint always holds the weights its accuracy was measured on. Best is by
the accuracy where a scorer grades answers (`grades_answers`), else by the mean reward.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rlfleet.v1 import generator_pb2
from rlfleet.workers import message_budget
from rlfleet.workers.evaluation.held_out import Grader, HeldOutScores, graded, held_out_prompts

log = logging.getLogger(__name__)
# How often the evaluation thread looks for a replica that holds the version to score.
REPLICA_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class EvalResult:
    policy_version: int
    """The version the generator scored (it says which it used)."""
    scores: HeldOutScores
    seconds: float
    episodes: dict[str, float] = field(default_factory=dict)
    """A job with an environment: its held-out episodes' metrics (eval_turns_mean, eval_tool_episode_share, ...)."""

    def fields(self) -> dict[str, Any]:
        """Its metrics.jsonl fields."""
        return {**self.scores.fields(), "eval_policy_version": self.policy_version, "eval_seconds": self.seconds,
                **self.episodes}


class HeldOutEvaluator:
    """One evaluation at a time, in a thread: Generate (greedy) on a replica holding the version, then `grade`."""

    def __init__(self, job: Any, tokenizer: Any, generators: list[Any], replica_version: Callable[[int], int | None],
                 grade: Grader, episodes: Any = None):
        self.job = job
        self.tokenizer = tokenizer
        self.generators = generators
        self.replica_version = replica_version
        """The version a replica holds, None while it is down."""
        self.grade = grade
        self.episodes = episodes
        """A job with an environment: its stage, which plays each held-out example as an episode."""
        self.examples, self.prompts = held_out_prompts(job, tokenizer, job.spec.evaluation.limit)
        self._thread: threading.Thread | None = None
        self._result: EvalResult | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, version: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(version,), name="eval", daemon=True)
        self._thread.start()

    def take(self, wait: bool = False) -> EvalResult | None:
        """The result of the evaluation that finished (waiting for the one running if `wait`), once."""
        if self._thread is not None:
            if self._thread.is_alive() and not wait:
                return None
            self._thread.join()
            self._thread = None
        result, self._result = self._result, None
        return result

    def _run(self, version: int) -> None:
        started = time.perf_counter()
        try:
            replica = self._replica(version)
            if replica is None:
                log.warning("evaluation of version %d skipped: no generator replica holds it", version)
                return
            texts, scored, extra = (self._episodes if self.episodes else self._completions)(replica, version)
            scores = graded(self.job, self.grade, texts, self.examples)
        except Exception as error:  # noqa: BLE001 - an evaluation that fails never stops training
            log.warning("evaluation of version %d failed: %s", version, error)
            return
        self._result = EvalResult(scored, scores, time.perf_counter() - started, extra)
        log.info("held-out reward %.3f, accuracy %s at policy version %d", scores.reward_mean,
                 "none" if scores.accuracy is None else f"{scores.accuracy:.3f} ({scores.correct}/{scores.total})",
                 scored)

    def _completions(self, replica: int, version: int) -> tuple[list[str], int, dict[str, float]]:
        """Greedy completions' texts, and the version that generated them."""
        replies = list(self._generate(replica))
        texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for _, r in replies for s in r.segments]
        # Parts may meet newer weights: the newest names the result, so it is `version`'s only if every part was.
        return texts, max(reply.policy_version for _, reply in replies), {}

    def _episodes(self, replica: int, version: int) -> tuple[list[str], int, dict[str, float]]:
        """Each held-out example played as an episode: the final answers' texts, the newest version that played, and
        the episodes' metrics (eval_turns_mean, eval_tool_episode_share, ...)."""
        from rlfleet.workers.controller.rollouts import Group, Rollout
        from rlfleet.workers.environment.stage import episode_metrics

        groups = [Group(-1, example, [Rollout(f"eval-{version}-{i}", -1, prompt, example.answer)])
                  for i, (example, prompt) in enumerate(zip(self.examples, self.prompts))]
        scored = self.episodes.play_greedy(groups, self.generators[replica], replica)
        rollouts = [g.rollouts[0] for g in groups]
        texts = [self.tokenizer.decode(r.answer_ids, skip_special_tokens=True) for r in rollouts]
        return texts, scored, {f"eval_{name}": value for name, value in episode_metrics(rollouts).items()
                               if "/" not in name}

    def _generate(self, replica: int) -> message_budget.Replies:
        """Greedy completions of every held-out prompt, in as many calls as fit gRPC's message limit."""
        generation = self.job.spec.generation
        ids = [f"eval-{i}" for i in range(len(self.prompts))]

        def call(part: range) -> Any:
            return self.generators[replica].Generate(generator_pb2.GenerateRequest(
                job_id=self.job.metadata.name, max_tokens=generation.max_new_tokens, temperature=0.0, top_p=1.0,
                seed=0, sequences=[generator_pb2.Sequence(sample_id=ids[i], prompt_ids=self.prompts[i])
                                   for i in part]), timeout=generation.timeout_seconds)

        sizes = [message_budget.generate_size(sample_id, len(prompt), 0, generation.max_new_tokens)
                 for sample_id, prompt in zip(ids, self.prompts)]
        return message_budget.call_in_parts(sizes, call, f"held-out Generate on generator replica {replica}",
                                            message_budget.SEGMENT_FIELD)

    def _replica(self, version: int) -> int | None:
        """An up replica holding `version` or newer, waiting up to the weight-sync deadline for the push to land."""
        deadline = time.monotonic() + self.job.spec.weight_sync.timeout_seconds
        while time.monotonic() < deadline:
            for replica in range(len(self.generators)):
                held = self.replica_version(replica)
                if held is not None and held >= version:
                    return replica
            time.sleep(REPLICA_POLL_SECONDS)
        return None


class InLoopEvaluation:
    """The controller's side: when to evaluate, the snapshot of the weights scored, the best checkpoint, and the
    result in metrics.jsonl and Prometheus."""

    def __init__(self, evaluator: HeldOutEvaluator, trainer: Any, meters: Any,
                 guard: Callable[..., Any] = lambda call, again=True: call()):
        self.evaluator = evaluator
        self.trainer = trainer
        self.guard = guard
        """What a call of the trainer's that needs its policy goes through (controller/recovery.py)."""
        self.every = evaluator.job.spec.evaluation.every_steps
        self.steps = evaluator.job.spec.algorithm.steps
        self.meters = meters
        self.snapshot: tuple[int, Any] | None = None
        """The version of the weights being scored, and the trainer's snapshot of them."""
        self.ranked_by = ranked_by(evaluator.job)
        # The trainer's, not a file of the controller's: a new leader may run elsewhere (spec.roles.controller).
        self.best: float | None = trainer.best().get(f"eval_{self.ranked_by}")
        """The score of the best checkpoint so far, kept over a resume or a change of leader."""
        self.carried: dict[str, Any] = {}
        """A resumed run's held-out result that a superseded record held, for the next record without one."""

    def before_training(self, version: int) -> None:
        """Score the weights training starts from: the accuracy every later one is compared with."""
        if self._may_start(version):
            self._start(version)

    def carry(self, superseded: list[dict[str, Any]], step: int) -> None:
        """On a resume from `step`: the result of a version up to `step` that a record of a later step held (the
        evaluation of the checkpoint's weights, collected after it) is no step's to redo, so it goes into the
        next record that collects none of its own (resumed at the step before the last, the one record left holds
        the last version's: it then stays in metrics.superseded.jsonl only)."""
        held = [r for r in superseded if r.get("eval_policy_version", step + 1) <= step]
        if held:
            self.carried = {k: v for k, v in held[0].items() if k.startswith("eval_")}
            self.meters.observe_eval(self.carried)

    def after_step(self, version: int) -> dict[str, Any]:
        """Collect a finished evaluation, start one of `version` when due (the last step always is, and waits for
        it); returns the metrics.jsonl fields of the result collected. A step's record holds one result, so the
        step before the last waits for one still running, and none starts there."""
        if version == self.steps:
            self._start(version)
            return self._collect(wait=True) or self._take_carried()
        fields = self._collect(wait=version == self.steps - 1) or self._take_carried()
        if version % self.every == 0 and self._may_start(version):
            self._start(version)
        return fields

    def trainer_returned(self) -> None:
        """The trainer restarted, and the snapshot it kept is gone: the evaluation under way is no best candidate."""
        self.snapshot = None

    def _take_carried(self) -> dict[str, Any]:
        fields, self.carried = self.carried, {}
        return fields

    def _collect(self, wait: bool) -> dict[str, Any]:
        if not wait:
            return self._settle(self.evaluator.take())
        with self.trainer.clock.idle("waiting_for_eval"):
            result = self.evaluator.take(wait=True)
        return self._settle(result)

    def _may_start(self, version: int) -> bool:
        """Whether a record before the last can still take the result (the last one's is its own)."""
        if version < self.steps - 1:
            return True
        log.info("evaluation of version %d left to the last step's", version)
        return False

    def _start(self, version: int) -> None:
        if self.evaluator.busy():
            log.warning("evaluation of version %d skipped: the previous one is still running", version)
            return
        self.snapshot = (version, self.guard(self.trainer.snapshot))
        self.evaluator.start(version)

    def _settle(self, result: EvalResult | None) -> dict[str, Any]:
        if result is None:
            return {}
        fields = result.fields()
        self.meters.observe_eval(fields)
        version, snapshot = self.snapshot or (None, None)
        measured = fields[f"eval_{self.ranked_by}"]
        if result.policy_version == version and (self.best is None or measured > self.best):
            self.guard(lambda: self.trainer.save_best(snapshot, {"step": version, "policy_version": version, **fields}),
                       again=False)
            if self.snapshot is not None:  # not lost to a trainer restart
                self.best = measured
        elif result.policy_version != version:
            log.info("the generator scored version %d, not the snapshot's %s: best checkpoint left as it is",
                     result.policy_version, version)
        return {**fields, f"eval_best_{self.ranked_by}": self.best}


def ranked_by(job: Any) -> str:
    """What the best checkpoint is chosen by: the accuracy in a job with an answer-grading scorer, else the mean
    reward (a job of format or python scorers only)."""
    return "accuracy" if any(spec.grades_answers for spec in job.spec.scorers) else "reward_mean"

