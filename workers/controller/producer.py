"""Rollout producers: one thread per generator replica turns prompts into scored rollout batches.

Partial rollouts: a visit gives every unfinished sequence at most `segmentTokens` new tokens, and the
next visit resumes it, under newer weights if the generator loaded some in between (every token keeps
its version). A batch is emitted once all its groups have finished.

Every call has a deadline. A Generate error is classified: a replica that is lost (unavailable, past
its deadline, or failing in its engine) hands its batch back and is marked down; a request the
generator can never serve (INVALID_ARGUMENT) costs only the prompts it names, each dropped once and
counted; a call refused for its credentials stops the run, since no retry can fix it. A message too large for gRPC
(RESOURCE_EXHAUSTED) loses nothing: it is split and sent again (message_budget), as every large call is.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from rlfleet.v1 import generator_pb2, scorer_pb2
from rlfleet.workers import message_budget, wire
from rlfleet.workers.controller.dispatch import Claim, Dispatch, Prompt
from rlfleet.workers.controller.ledger import REFUSED, PromptLedger
from rlfleet.workers.controller.links import SyncLinks
from rlfleet.workers.controller.critic import CriticLink
from rlfleet.workers.controller.guidance import guide_for, unsolved
from rlfleet.workers.controller.reference import ReferencePolicy
from rlfleet.workers.controller.rollouts import Batch, GeneratorDown, Group, Refused, Rollout, RolloutBuffer, Stopped
from rlfleet.workers.scorer.batch import scorer_names
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
# A scorer replica that went away gets this long to come back before the run fails.
SCORER_RETRY_SECONDS = 120.0
# A scorer call may take each scorer's own timeout for each item, plus a child process start.
SCORER_START_SECONDS = 60.0
# A reward-model call answers within its timeout per item (the server's own budget); this covers the transfer.
REWARD_MODEL_MARGIN_SECONDS = 30.0
# A batch whose Generate calls fail in the engine this often (on any replica) fails the run: it would
# otherwise go round the replicas forever.
MAX_ENGINE_FAILURES = 3
REFUSED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
ENGINE_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
# A Score's reward, framing, and the reward model's one error name.
SCORE_BYTES = 64


class EngineFailed(GeneratorDown):
    """The generator answered with an error of its own: the replica is down, and the batch counts it."""


@dataclass
class ProducerParts:
    """What every producer shares."""

    job: RLJob
    dispatch: Dispatch
    links: SyncLinks
    buffer: RolloutBuffer
    ledger: PromptLedger
    decode: Callable[[list[int]], str]
    scorers: list[Any]
    reference: ReferencePolicy | None = None
    """log pi_ref of every completion, in a job with a reference executor."""
    reward_models: list[Any] = field(default_factory=list)
    """Scorer stubs of the reward-model replicas, in a job with a reward model."""
    critic: CriticLink | None = None
    """Values of every completion, in a job with a critic."""
    completion_ids: Callable[[str], list[int]] | None = None
    """A text as completion tokens, end-of-text included: how guidance (algorithm.guidance) sends a solution."""


class RolloutProducer(threading.Thread):
    def __init__(self, parts: ProducerParts, generator: Any, index: int):
        super().__init__(name=f"producer-{index}", daemon=True)
        self.parts = parts
        self.generator = generator
        self.index = index

    def run(self) -> None:
        try:
            while True:
                self._produce(self.parts.dispatch.claim(self.index))
        except Stopped:
            return
        except Exception as error:  # noqa: BLE001 - handed to the trainer loop, which fails the run
            log.exception("rollout producer %d failed", self.index)
            self.parts.buffer.fail(error)

    def _produce(self, claim: Claim) -> None:
        if claim.groups is None:
            claim.groups = [self.parts.dispatch.feed.restored(p.position) or self._new_group(claim.index, p)
                            for p in claim.prompts]
        try:
            batch = self.roll(claim, claim.groups)
        except GeneratorDown as down:
            # Its groups go back with their tokens so far: a replica lost or removed costs only its last segment,
            # and those tokens are fresh enough (the batch was claimed under the staleness bound it trains under).
            self._hand_back(claim, down)
            return
        self.parts.buffer.put(batch)

    def _hand_back(self, claim: Claim, down: GeneratorDown) -> None:
        if isinstance(down, EngineFailed):
            claim.failures += 1
            if claim.failures >= MAX_ENGINE_FAILURES:
                raise RuntimeError(f"batch {claim.index} failed in the generators' engine {claim.failures} times; "
                                   f"last: {down}") from down
        self.parts.dispatch.give_back(claim)
        self.parts.links.mark_down(self.index, down)

    def roll(self, claim: Claim, groups: list[Group]) -> Batch:
        """Generate, one segment a visit, until every group has finished; then score."""
        visits = resumed = 0
        while any(not g.finished for g in groups):
            try:
                resumed += self.visit(claim.index, visits, groups)
            except Refused as refused:
                groups = claim.groups = self._without_refused(claim, visits, groups, refused)
            visits += 1
        rollouts = []
        if groups:  # every prompt of the batch may have been refused
            self.score(claim.index, groups)
            if self.parts.job.spec.algorithm.guidance == "answer":
                self.guide(claim.index, groups)  # replaces rollouts: the batch's list is taken after it
            rollouts = [r for g in groups for r in g.rollouts]
            if self.parts.reference:
                self.parts.reference.annotate(claim.index, rollouts)
            if self.parts.critic:
                self.parts.critic.annotate(rollouts)
        return Batch(claim.index, rollouts, claim.data_position, visits=visits, resumed=resumed,
                     dropped=dict(claim.dropped), replica=self.index)

    def visit(self, index: int, visit: int, groups: list[Group]) -> int:
        """One segment for every unfinished rollout, in as many calls as fit gRPC's message limit; returns how many
        of them were resumed."""
        spec = self.parts.job.spec
        limit = spec.generation.max_new_tokens
        open_ = [r for g in groups for r in g.rollouts if not r.finished]
        # Bounded by the longest open completion, so no sequence is asked past maxNewTokens (and past
        # the prompt budget the feed checked) when restored partial rollouts are further along.
        room = min(spec.generation.segment_tokens or limit, limit - max(len(r.completion_ids) for r in open_))
        resumed = sum(1 for r in open_ if r.completion_ids)
        sizes = [message_budget.generate_size(r.sample_id, len(r.prompt_ids), len(r.completion_ids), room)
                 for r in open_]
        replies = message_budget.call_in_parts(sizes, lambda part: self._generate(index, visit, open_, part, room),
                                               f"Generate on generator replica {self.index}",
                                               message_budget.SEGMENT_FIELD)
        for part, reply in replies:
            with self.parts.ledger.lock:
                for rollout, segment in zip(open_[part.start:part.stop], reply.segments):
                    _extend(rollout, segment, reply.policy_version, limit)
        return resumed

    def _generate(self, index: int, visit: int, open_: list[Rollout], part: range, room: int) -> Any:
        """One Generate call for the `part` of the visit's open rollouts."""
        spec = self.parts.job.spec
        request = generator_pb2.GenerateRequest(
            job_id=self.parts.job.metadata.name,
            sequences=[generator_pb2.Sequence(sample_id=r.sample_id, prompt_ids=r.prompt_ids,
                                              completion_ids=r.completion_ids) for r in open_[part.start:part.stop]],
            max_tokens=room, temperature=spec.generation.temperature, top_p=spec.generation.top_p,
            # The engine seeds sequence i with seed + i: a part samples as the visit's one call would.
            seed=_seed(spec.algorithm.seed, index, visit) + part.start,
        )
        try:
            return self.generator.Generate(request, timeout=spec.generation.timeout_seconds)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise  # too large a message, not a lost replica: call_in_parts splits the call
            raise _classified(error, self.index) from error

    def _without_refused(self, claim: Claim, visit: int, groups: list[Group], refused: Refused) -> list[Group]:
        """Find the groups the generator refuses by asking for each alone; drop those, once and counted. Each leaves
        the claim at once: if the replica is lost before the last is asked, the batch goes back without it."""
        log.warning("generator %d refused batch %d (%s); trying its prompts one by one", self.index, claim.index,
                    refused)
        for group in groups:
            try:
                if not group.finished:
                    self.visit(claim.index, visit, [group])
            except Refused as alone:
                log.error("prompt %d dropped: generator %d refuses it (%s)", group.position, self.index, alone)
                self.parts.ledger.dropped(group.position, claim.index, REFUSED)
                claim.groups = [g for g in claim.groups if g is not group]
                claim.prompts = [p for p in claim.prompts if p.position != group.position]
                claim.dropped[REFUSED] = claim.dropped.get(REFUSED, 0) + 1
        return claim.groups

    def score(self, index: int, groups: list[Group]) -> None:
        rollouts = [r for g in groups for r in g.rollouts]
        items = [scorer_pb2.ScoreItem(sample_id=r.sample_id, prompt=g.example.prompt,
                                      completion=self.parts.decode(r.completion_ids), answer=r.answer)
                 for g in groups for r in g.rollouts]
        job = self.parts.job
        scores = self._scores(self.parts.scorers, "scorer", index, items, lambda n: score_deadline(job, n))
        for rollout, score in zip(rollouts, scores):
            rollout.reward = score.reward
            rollout.scorer_errors = list(score.errors)
        model = job.spec.roles.reward_model
        if model:
            learned = self._scores(self.parts.reward_models, "reward model", index, items,
                                   lambda n: reward_model_deadline(job, n))
            for rollout, score in zip(rollouts, learned):
                rollout.reward_model_score = score.reward
                rollout.reward += model.weight * score.reward
                rollout.scorer_errors += list(score.errors)

    def _scores(self, replicas: list[Any], what: str, index: int, items: list[Any],
                deadline: Callable[[int], float]) -> list[Any]:
        """Every item's Score, in as many calls as fit gRPC's message limit (each with the deadline of its items)."""
        job_id = self.parts.job.metadata.name
        # A Score's errors name the scorers that failed on it.
        reply = SCORE_BYTES + sum(message_budget.text_bytes(n) for n in scorer_names(self.parts.job.spec.scorers))
        sizes = [message_budget.Size(message_budget.FIELD_BYTES + item.ByteSize(),
                                     reply + message_budget.text_bytes(item.sample_id)) for item in items]

        def call(part: range) -> Any:
            request = scorer_pb2.ScoreRequest(job_id=job_id, items=items[part.start:part.stop])
            return _score_anywhere(replicas, what, index, request, deadline(len(part)))

        replies = message_budget.call_in_parts(sizes, call, f"Score on the {what}s", message_budget.COMPLETION_FIELD)
        return [score for _, answer in replies for score in answer.scores]

    def guide(self, index: int, groups: list[Group]) -> None:
        """Each group that scored nothing gets its example's solution (or answer) as its last completion, if it fits
        in maxNewTokens and the scorers reward it (guidance.py)."""
        limit = self.parts.job.spec.generation.max_new_tokens
        solutions = [(g, self.parts.completion_ids(g.example.solution or g.example.answer)) for g in unsolved(groups)]
        targets = [(group, guide_for(group, ids)) for group, ids in solutions if len(ids) <= limit]
        if not targets:
            return
        self.score(index, [Group(group.position, group.example, [guide]) for group, guide in targets])
        with self.parts.ledger.lock:
            for group, guide in targets:
                if guide.reward > 0.0:
                    group.rollouts[-1] = guide

    def _new_group(self, index: int, prompt: Prompt) -> Group:
        size = self.parts.job.spec.algorithm.group_size
        rollouts = [Rollout(sample_id=f"{index}-{prompt.position}-{g}", prompt=prompt.position,
                            prompt_ids=prompt.ids, answer=prompt.example.answer)
                    for g in range(size)]
        group = Group(prompt.position, prompt.example, rollouts)
        self.parts.ledger.opened(group)
        return group


def _score_anywhere(replicas: list[Any], what: str, index: int, request: Any, deadline: float) -> Any:
    """Any replica (of the scorers, or of the reward model) will do; one that is restarting or stopped gets a grace
    period. Score is read-only, so a call retried after its deadline changes nothing."""
    give_up = None
    for attempt in itertools.count():
        replica = (index + attempt) % len(replicas)
        try:
            return replicas[replica].Score(request, timeout=deadline)
        except grpc.RpcError as error:
            give_up = give_up or time.monotonic() + SCORER_RETRY_SECONDS
            if error.code() not in wire.TRANSIENT or time.monotonic() > give_up:
                raise
            log.warning("%s %d unavailable (%s), trying another", what, replica, error.code().name)
            time.sleep(min(1.0, 0.1 * attempt))


def reward_model_deadline(job: RLJob, items: int) -> float:
    """Deadline of one Score call to the reward model: it answers within its own timeout per item."""
    return REWARD_MODEL_MARGIN_SECONDS + items * job.spec.roles.reward_model.timeout_seconds


def score_deadline(job: RLJob, items: int) -> float:
    """Deadline of one Score call: every scorer may take its own timeout on every item, one after another,
    in a child process that may have to start first."""
    return SCORER_START_SECONDS + items * sum(s.timeout_seconds for s in job.spec.scorers)


def _classified(error: grpc.RpcError, replica: int) -> Exception:
    code = error.code()
    wire.raise_if_misconfigured(error, f"Generate on generator replica {replica}")
    if code in REFUSED_CODES:
        return Refused(f"{code.name}: {error.details()}")
    if code in ENGINE_CODES:
        return EngineFailed(f"Generate failed in the engine: {code.name}: {error.details()}")
    return GeneratorDown(f"Generate failed: {code.name}")


def _extend(rollout: Rollout, segment: Any, version: int, limit: int) -> None:
    room = limit - len(rollout.completion_ids)
    tokens = list(segment.token_ids)[:room]
    rollout.extend(tokens, list(segment.logprobs)[:room], version)
    rollout.finished = segment.finished or len(rollout.completion_ids) >= limit


def _seed(job_seed: int, batch: int, visit: int) -> int:
    """Distinct per job, batch and visit; the engine adds the sequence index."""
    return (job_seed * 1_000_003 + batch * 1_009 + visit) * 65_536 % (1 << 63)
