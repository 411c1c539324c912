"""Rollout producers: one thread per generator replica turns prompts into scored rollout batches, or parts of them.

Partial rollouts: a visit gives every unfinished sequence at most `segmentTokens` new tokens, and the
next visit resumes it, under newer weights if the generator loaded some in between (every token keeps
its version). A part of a batch (dispatch.py) is emitted once all its groups have finished and gone through the job's
stages (scores, guidance, reference log-probs, critic values: controller/stages.py); its Generate time and tokens
are its replica's measured throughput.

Every call has a deadline. A Generate error is classified: a replica that is lost (unavailable, past
its deadline, or failing in its engine) hands its part back and is marked down; a request the
generator can never serve (INVALID_ARGUMENT) costs only the prompts it names, each dropped once and
counted; a call refused for its credentials stops the run, since no retry can fix it. A message too large for gRPC
(RESOURCE_EXHAUSTED) loses nothing: it is split and sent again (message_budget), as every large call is.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from rlfleet.v1 import generator_pb2
from rlfleet.workers import message_budget, wire
from rlfleet.workers.controller.dispatch import Claim, Dispatch, Prompt
from rlfleet.workers.controller.ledger import REFUSED, PromptLedger
from rlfleet.workers.controller.receivers import WeightReceivers
from rlfleet.workers.controller.rollouts import Batch, GeneratorDown, Group, Refused, Rollout, RolloutBuffer, Stopped
from rlfleet.workers.controller.stages import Stage
from rlfleet.workers.controller.temperature import SamplingTemperature
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
# A batch whose Generate calls fail in the engine this often (on any replica) fails the run: it would
# otherwise go round the replicas forever.
MAX_ENGINE_FAILURES = 3
REFUSED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
ENGINE_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


class EngineFailed(GeneratorDown):
    """The generator answered with an error of its own: the replica is down, and the batch counts it."""


@dataclass
class ProducerParts:
    """What every producer shares."""

    job: RLJob
    dispatch: Dispatch
    receivers: WeightReceivers
    buffer: RolloutBuffer
    ledger: PromptLedger
    stages: list[Stage]
    """What every finished batch goes through, in order (controller/stages.py): scores, guidance, and the stages of
    the job's optional executors."""

    def temperature(self) -> float:
        """What a batch samples at now: generation.temperature, or where its adaptiveTemperature has moved it."""
        adapting = next((stage for stage in self.stages if isinstance(stage, SamplingTemperature)), None)
        return adapting.temperature() if adapting else self.job.spec.generation.temperature

    @property
    def episodes(self) -> Any:
        """The stage that answers each finished turn (a job with an environment), or None."""
        return next((stage for stage in self.stages if stage.drives_turns), None)


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
        self.parts.receivers.mark_down(self.index, down)

    def roll(self, claim: Claim, groups: list[Group]) -> Batch:
        """Generate, one segment a visit, until every group has finished; then the job's stages, in order."""
        visits = resumed = generated = 0
        seconds = 0.0
        episodes = self.parts.episodes
        if episodes is not None:
            episodes.begin(groups, self.index, self.parts.ledger.lock)
        while any(not g.finished for g in groups):
            if episodes is not None:
                episodes.advance([r for g in groups for r in g.rollouts], self.parts.ledger.lock)
                if not any(generates(r) for g in groups for r in g.rollouts):
                    continue
            before, started = completion_tokens(groups), time.perf_counter()
            try:
                resumed += self.visit(claim, visits, groups)
            except Refused as refused:
                groups = claim.groups = self._without_refused(claim, visits, groups, refused)
            seconds += time.perf_counter() - started
            generated += max(0, completion_tokens(groups) - before)
            visits += 1
        self.parts.dispatch.throughput.observe(self.index, generated, seconds)
        if groups:  # every prompt of the batch may have been refused
            for stage in self.parts.stages:
                stage.annotate(claim.index, groups)
        rollouts = [r for g in groups for r in g.rollouts]  # after the stages: guidance replaces rollouts
        return Batch(claim.index, rollouts, claim.data_position, visits=visits, resumed=resumed,
                     dropped=dict(claim.dropped), replica=self.index, parts=claim.parts,
                     shares={self.index: len(rollouts)})

    def visit(self, claim: Claim, visit: int, groups: list[Group]) -> int:
        """One segment for every unfinished rollout, in as many calls as fit gRPC's message limit; returns how many
        of them were resumed."""
        spec = self.parts.job.spec
        limit = spec.generation.max_new_tokens
        open_ = [r for g in groups for r in g.rollouts if generates(r)]
        if not open_:
            return 0
        # Bounded by the longest open completion, so no sequence is asked past maxNewTokens (and past
        # the prompt budget the feed checked) when restored partial rollouts are further along.
        room = min(spec.generation.segment_tokens or limit, limit - max(len(r.completion_ids) for r in open_))
        resumed = sum(1 for r in open_ if r.completion_ids)
        sizes = [message_budget.generate_size(r.sample_id, len(r.prompt_ids), len(r.completion_ids), room)
                 for r in open_]
        replies = message_budget.call_in_parts(sizes, lambda part: self._generate(claim, visit, open_, part, room),
                                               f"Generate on generator replica {self.index}",
                                               message_budget.SEGMENT_FIELD)
        for part, reply in replies:
            with self.parts.ledger.lock:
                for rollout, segment in zip(open_[part.start:part.stop], reply.segments):
                    extend_rollout(rollout, segment, reply.policy_version, limit)
        return resumed

    def _generate(self, claim: Claim, visit: int, open_: list[Rollout], part: range, room: int) -> Any:
        """One Generate call for the `part` of the visit's open rollouts."""
        spec = self.parts.job.spec
        request = generator_pb2.GenerateRequest(
            job_id=self.parts.job.metadata.name,
            sequences=[generator_pb2.Sequence(sample_id=r.sample_id, prompt_ids=r.prompt_ids,
                                              completion_ids=r.completion_ids) for r in open_[part.start:part.stop]],
            max_tokens=room, temperature=self.parts.temperature(), top_p=spec.generation.top_p,
            # The engine seeds sequence i with seed + i: a part samples as the visit's one call would, and the parts
            # of a split batch go on from where the one before ends.
            seed=_seed(spec.algorithm.seed, claim.index, visit) + claim.offset * spec.algorithm.group_size
            + part.start,
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
                    self.visit(claim, visit, [group])
            except Refused as alone:
                log.error("prompt %d dropped: generator %d refuses it (%s)", group.position, self.index, alone)
                self.parts.ledger.dropped(group.position, claim.index, REFUSED)
                claim.groups = [g for g in claim.groups if g is not group]
                claim.prompts = [p for p in claim.prompts if p.position != group.position]
                claim.dropped[REFUSED] = claim.dropped.get(REFUSED, 0) + 1
        return claim.groups

    def _new_group(self, index: int, prompt: Prompt) -> Group:
        size = self.parts.job.spec.algorithm.group_size
        rollouts = [Rollout(sample_id=f"{index}-{prompt.position}-{g}", prompt=prompt.position,
                            prompt_ids=prompt.ids, answer=prompt.example.answer)
                    for g in range(size)]
        group = Group(prompt.position, prompt.example, rollouts)
        self.parts.ledger.opened(group)
        return group


def _classified(error: grpc.RpcError, replica: int) -> Exception:
    code = error.code()
    wire.raise_if_misconfigured(error, f"Generate on generator replica {replica}")
    if code in REFUSED_CODES:
        return Refused(f"{code.name}: {error.details()}")
    if code in ENGINE_CODES:
        return EngineFailed(f"Generate failed in the engine: {code.name}: {error.details()}")
    return GeneratorDown(f"Generate failed: {code.name}")


def completion_tokens(groups: list[Group]) -> int:
    return sum(len(r.completion_ids) for g in groups for r in g.rollouts)


def generates(rollout: Rollout) -> bool:
    """Whether the policy's turn is under way (not over, nor waiting for its environment)."""
    return not rollout.finished and not rollout.turn_ended


def extend_rollout(rollout: Rollout, segment: Any, version: int, limit: int) -> None:
    room = limit - len(rollout.completion_ids)
    tokens = list(segment.token_ids)[:room]
    rollout.extend(tokens, list(segment.logprobs)[:room], version)
    full = len(rollout.completion_ids) >= limit
    if rollout.episode is not None and not full:
        rollout.turn_ended = segment.finished  # the environment answers; the episode goes on or ends
    else:
        rollout.finished = segment.finished or full
        if rollout.episode is not None and not segment.finished:
            rollout.episode.truncated = True


def _seed(job_seed: int, batch: int, visit: int) -> int:
    """Distinct per job, batch and visit; the engine adds the sequence index."""
    return (job_seed * 1_000_003 + batch * 1_009 + visit) * 65_536 % (1 << 63)
