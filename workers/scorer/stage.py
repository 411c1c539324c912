"""The scorers as the controller uses them: each finished completion's reward from the job's rule scorers (the Scorer
service), the first stage of every batch. `score_calls` is also how the reward model's stage calls its replicas, and
`remote_grader` how evaluation in the loop grades held-out completions."""

from __future__ import annotations

import json
from typing import Any, Callable

from rlfleet.v1 import scorer_pb2, scorer_pb2_grpc
from rlfleet.workers import message_budget, wire
from rlfleet.workers.controller.calls import call_replica
from rlfleet.workers.controller.rollouts import Group, Rollout
from rlfleet.workers.controller.stages import Stage, StageRun
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.evaluation.held_out import Grader
from rlfleet.workers.plan import WorkerContext
from rlfleet.workers.scorer.batch import ItemScore, scorer_names
from rlfleet.workers.scorer.python import MAX_COMPONENT_CHARS, MAX_COMPONENTS
from rlfleet.workers.spec import RLJob

# A scorer replica that went away gets this long to come back before the run fails.
SCORER_RETRY_SECONDS = 120.0
# A scorer call may take each scorer's own timeout for each item, plus a child process start.
SCORER_START_SECONDS = 60.0
# What a scorer child's restart may take on a busy node (about 2 s on two busy cores: the own-task example).
CHILD_RESTART_SECONDS = 5.0
# A Score's reward, framing, and the reward model's one error name.
SCORE_BYTES = 64


class ScoreStage(Stage):
    """A stage whose executor serves the Scorer service: every rollout scored by any of its replicas."""

    scores = True
    role = ""
    """The executor kind whose replicas it calls."""

    def __init__(self, job: RLJob, stubs: list[Any], decode: Callable[[list[int]], str]):
        self.job = job
        self.stubs = stubs
        self.decode = decode

    @classmethod
    def built(cls, ctx: WorkerContext, run: StageRun) -> ScoreStage:
        stubs = [scorer_pb2_grpc.ScorerStub(wire.channel(a, ctx.token, ctx.leader_epoch))
                 for a in ctx.endpoints.of(cls.role)]
        return cls(ctx.job, stubs, run.decode)

    def scored(self, what: str, index: int, groups: list[Group],
               deadline: Callable[[int], float]) -> list[tuple[Rollout, scorer_pb2.Score]]:
        scores = score_calls(self.job, self.stubs, what, index, score_items(groups, self.decode), deadline)
        return list(zip((r for g in groups for r in g.rollouts), scores))


class RuleScoring(ScoreStage):
    role = "scorer"

    def annotate(self, index: int, groups: list[Group]) -> None:
        """Set each rollout's reward, each scorer's part of it, and the scorers that failed on it and why."""
        for rollout, score in self.scored("scorer", index, groups, lambda n: score_deadline(self.job, n)):
            rollout.reward = score.reward
            rollout.scorer_errors = list(score.errors)
            rollout.scorer_failures = list(score.reasons)
            rollout.scorer_scores = dict(score.scorer_scores)
            rollout.components = dict(score.components)


def score_items(groups: list[Group], decode: Callable[[list[int]], str]) -> list[scorer_pb2.ScoreItem]:
    return [score_item(r.sample_id, g.example, decode(r.answer_ids), r.answer) for g in groups for r in g.rollouts]


def score_item(sample_id: str, example: Example, completion: str, answer: str) -> scorer_pb2.ScoreItem:
    return scorer_pb2.ScoreItem(sample_id=sample_id, prompt=example.prompt, completion=completion, answer=answer,
                                fields_json=json.dumps(example.fields) if example.fields else "")


def remote_grader(job: RLJob, stubs: list[Any]) -> Grader:
    """Held-out completions graded the way training's are: by the job's scorer executor, so that user code runs where
    it runs in training."""

    def grade(examples: list[Example], texts: list[str]) -> list[ItemScore]:
        items = [score_item(f"eval-{i}", e, text, e.answer) for i, (e, text) in enumerate(zip(examples, texts))]
        scores = score_calls(job, stubs, "scorer", 0, items, lambda n: score_deadline(job, n))
        return [ItemScore(s.reward, list(s.errors), list(s.reasons), dict(s.scorer_scores), dict(s.components))
                for s in scores]

    return grade


def score_calls(job: RLJob, stubs: list[Any], what: str, index: int, items: list[scorer_pb2.ScoreItem],
                deadline: Callable[[int], float]) -> list[scorer_pb2.Score]:
    """Every item's Score from any replica, in as many calls as fit gRPC's message limit (each with the deadline of
    its items). Score is read-only, so a call retried after its deadline changes nothing."""
    names = scorer_names(job.spec.scorers)
    reply = SCORE_BYTES + sum(score_bytes(spec, name) for spec, name in zip(job.spec.scorers, names))
    sizes = [message_budget.Size(message_budget.FIELD_BYTES + item.ByteSize(),
                                 reply + message_budget.text_bytes(item.sample_id)) for item in items]

    def call(part: range) -> Any:
        request = scorer_pb2.ScoreRequest(job_id=job.metadata.name, items=items[part.start:part.stop])
        return call_replica(stubs, lambda stub: stub.Score, request, what=f"Score on the {what}s",
                            deadline=deadline(len(part)), grace=SCORER_RETRY_SECONDS, start=index)

    replies = message_budget.call_in_parts(sizes, call, f"Score on the {what}s", message_budget.COMPLETION_FIELD)
    return [score for _, answer in replies for score in answer.scores]


def score_bytes(spec: Any, name: str) -> int:
    """What one scorer may add to a Score: its name in errors with a reason (SCORE_BYTES holds the longest), its
    entry in scorer_scores (a name and a double), and a python scorer's components (names prefixed with its own)."""
    size = 2 * (message_budget.text_bytes(name) + SCORE_BYTES)
    if spec.type == "python":
        size += MAX_COMPONENTS * (message_budget.text_bytes(f"{name}/" + "x" * MAX_COMPONENT_CHARS) + SCORE_BYTES)
    return size


def score_deadline(job: RLJob, items: int) -> float:
    """Deadline of one Score call: every scorer may take its own timeout on every item, one after another,
    in a child process that may have to start first; a python scorer's call that hangs or crashes also costs the
    start of a new child (user code fails that way far more often than a rule)."""
    return SCORER_START_SECONDS + items * sum(s.timeout_seconds + (CHILD_RESTART_SECONDS if s.type == "python" else 0)
                                              for s in job.spec.scorers)
