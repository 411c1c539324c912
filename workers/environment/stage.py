"""The environment executor as the controller uses it: the producers open each rollout of a job that runs one as an
episode, and hand every turn the policy finishes to its environment, whose answer joins the rollout as unsampled
tokens (or starts a new training sample) until the environment says done.

An episode lives on one environment replica (by its id), which keeps its environment's state. A step runs in a
thread of this stage's pool: the producer goes on generating for the episodes that are not waiting, so an
environment's latency overlaps the others' generation. An environment that fails, hangs or is lost ends its
episode with a counted error; the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import grpc

from rlfleet.v1 import environment_pb2, environment_pb2_grpc, generator_pb2
from rlfleet.workers import message_budget, wire
from rlfleet.workers.controller.calls import call_replica
from rlfleet.workers.controller.producer import extend_rollout, generates
from rlfleet.workers.controller.rollouts import OBSERVATION, EpisodeLog, Group, Rollout, Turn, unsampled_turn
from rlfleet.workers.controller.stages import Stage, StageRun
from rlfleet.workers.plan import WorkerContext

log = logging.getLogger(__name__)
# Steps in flight at once from this controller (each a blocking call in a thread of the pool).
STEP_THREADS = 64
# Over an environment step's own timeout: the call's framing and a busy replica's queue.
CALL_MARGIN_SECONDS = 30.0
# Start renders a prompt (no user code but reset); a replica that does not answer this fast is lost.
START_SECONDS = 60.0
# A replica that is down (restarting: it loads a tokenizer and the user's environment) gets this long to come back
# before the episodes meant for it end as lost.
RETURN_SECONDS = 60.0


class Episodes(Stage):
    drives_turns = True

    def __init__(self, ctx: WorkerContext, run: StageRun):
        self.spec = ctx.job.spec.roles.environment
        self.job = ctx.job
        self.job_id = ctx.job.metadata.name
        self.limit = ctx.job.spec.generation.max_new_tokens
        self.prompt_budget = run.prompt_budget
        # Their stages annotate one sample per rollout: with them, a drifted episode ends instead of restarting.
        self.restarts = ctx.job.spec.roles.reference is None and ctx.job.spec.roles.critic is None
        self.stubs = [environment_pb2_grpc.EnvironmentStub(wire.channel(a, ctx.token, ctx.leader_epoch))
                      for a in ctx.endpoints.of("env")]
        self.plays = self.spec.type == "agent"
        """An agent's episodes: the environment runs them whole against a generator's endpoint (`play`)."""
        self.endpoints = ctx.endpoints
        self.pool = ThreadPoolExecutor(STEP_THREADS, thread_name_prefix="env-call")
        self.pending: dict[str, Future] = {}
        """The step in flight of each episode waiting for its environment, by sample id (any producer's)."""

    @classmethod
    def built(cls, ctx: WorkerContext, run: StageRun) -> Episodes:
        return cls(ctx, run)

    def begin(self, groups: list[Group], replica: int, lock: Any) -> None:
        """Before a claim's first visit: open its episodes, or play an agent's whole on generator `replica`."""
        if self.plays:  # an agent's episodes generate through the endpoint
            self.play(groups, replica, lock)
        else:
            self.open(groups, lock)

    def open(self, groups: list[Group], lock: Any) -> None:
        """Start the episodes not started yet; one restored from a checkpoint starts over (its environment's state
        went with the run that checkpointed it)."""
        by_replica: dict[int, list[tuple[Rollout, Any]]] = {}
        for group in groups:
            for rollout in group.rollouts:
                if rollout.episode is None:
                    by_replica.setdefault(self._replica(rollout), []).append((rollout, group.example))
        for replica, new in by_replica.items():
            openings = self._start(replica, new)
            with lock:
                for rollout, _ in new:
                    self._opened(rollout, openings.get(rollout.sample_id))

    def advance(self, rollouts: list[Rollout], lock: Any) -> None:
        """Hand the environment every finished turn, and take its answers; return once some episode may generate
        (or none is waiting)."""
        for rollout in rollouts:
            if rollout.turn_ended and rollout.sample_id not in self.pending:
                self.pending[rollout.sample_id] = self.pool.submit(self._step, rollout)
        while True:
            waiting = {r.sample_id: r for r in rollouts if r.sample_id in self.pending}
            for sample_id, rollout in waiting.items():
                if self.pending[sample_id].done():
                    with lock:
                        self._answered(rollout, self.pending.pop(sample_id).result())
            if not waiting or any(not r.finished and not r.turn_ended for r in rollouts):
                return
            wait([self.pending[s] for s in waiting if s in self.pending], return_when=FIRST_COMPLETED)

    def play(self, groups: list[Group], replica: int, lock: Any) -> None:
        """Run an agent's episodes, each whole, against generator `replica`'s endpoint (one replica for the episode:
        its record and prefix cache live there); returns when every one ended."""
        base_url = f"http://{self.endpoints.http_of('generator')[replica]}/v1"
        calls = {self.pool.submit(self._play, r, g.example, base_url): r
                 for g in groups for r in g.rollouts if not r.finished}
        for call in calls:
            reply = call.result()
            with lock:
                self._played(calls[call], reply)

    def play_greedy(self, groups: list[Group], generator: Any, replica: int) -> int:
        """Episodes of the held-out examples, the policy greedy on one replica (the evaluation's; an agent's
        episodes sample at the job's temperature: the endpoint's calls train); returns the newest version that
        generated, and frees them."""
        lock, rollouts = threading.Lock(), [r for g in groups for r in g.rollouts]
        newest = 0
        self.begin(groups, replica, lock)
        while any(not r.finished for r in rollouts):
            self.advance(rollouts, lock)
            ready = [r for r in rollouts if generates(r)]
            if not ready:
                continue
            newest = max(newest, self._greedy_visit(ready, generator))
        self.annotate(-1, groups)
        return newest

    def _greedy_visit(self, ready: list[Rollout], generator: Any) -> int:
        """One greedy segment for each of `ready`, in as many calls as fit; returns the newest version that sampled."""
        generation, newest = self.job.spec.generation, 0
        room = min(generation.segment_tokens or self.limit, self.limit - max(len(r.completion_ids) for r in ready))
        sizes = [message_budget.generate_size(r.sample_id, len(r.prompt_ids), len(r.completion_ids), room)
                 for r in ready]
        for part, reply in message_budget.call_in_parts(sizes, lambda part: generator.Generate(
                self._greedy(ready[part.start:part.stop], room), timeout=generation.timeout_seconds),
                "held-out Generate", message_budget.SEGMENT_FIELD):
            newest = max(newest, reply.policy_version)
            for rollout, segment in zip(ready[part.start:part.stop], reply.segments):
                extend_rollout(rollout, segment, reply.policy_version, self.limit)
        return newest

    def _greedy(self, rollouts: list[Rollout], room: int) -> generator_pb2.GenerateRequest:
        return generator_pb2.GenerateRequest(
            job_id=self.job_id, temperature=0.0, top_p=1.0, seed=0, max_tokens=room,
            sequences=[generator_pb2.Sequence(sample_id=r.sample_id, prompt_ids=r.prompt_ids,
                                              completion_ids=r.completion_ids) for r in rollouts])

    def annotate(self, index: int, groups: list[Group]) -> None:
        """The batch's episodes are over: the environment's rewards join the scorers', and the replicas free them."""
        rollouts = [r for g in groups for r in g.rollouts if r.episode is not None]
        for rollout in rollouts:
            rollout.reward += rollout.episode.reward
        by_replica: dict[int, list[str]] = {}
        for rollout in rollouts:
            by_replica.setdefault(self._replica(rollout), []).append(rollout.sample_id)
        for replica, ids in by_replica.items():
            try:
                self.stubs[replica].End(environment_pb2.EndRequest(job_id=self.job_id, episode_ids=ids),
                                        timeout=START_SECONDS)
            except grpc.RpcError as error:  # a lost replica freed them already
                wire.raise_if_misconfigured(error, f"End on environment replica {replica}")

    def shape(self, fresh: list[Rollout]) -> dict[str, float]:
        return episode_metrics(fresh)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _replica(self, rollout: Rollout) -> int:
        """Where the episode lives: the same replica for all its life (it holds the environment's state)."""
        return zlib.crc32(rollout.sample_id.encode()) % len(self.stubs)

    def _start(self, replica: int, new: list[tuple[Rollout, Any]]) -> dict[str, environment_pb2.Opening]:
        request = environment_pb2.StartRequest(job_id=self.job_id, episodes=[
            environment_pb2.EpisodeStart(episode_id=r.sample_id, example_json=json.dumps(dataclasses.asdict(example)))
            for r, example in new])
        # A replica that is down (restarting) is waited for: episodes ended at once for want of it would each make a
        # batch of nothing and let the run race through its data. A repeated Start opens the episodes afresh.
        try:
            reply = call_replica([self.stubs[replica]], lambda stub: stub.Start, request,
                                 what=f"Start on environment replica {replica}",
                                 deadline=START_SECONDS + self.spec.step_timeout_seconds, grace=RETURN_SECONDS)
        except grpc.RpcError as error:
            log.warning("environment replica %d did not start %d episodes: %s", replica, len(new), error.code())
            return {}
        return {opening.episode_id: opening for opening in reply.openings}

    def _opened(self, rollout: Rollout, opening: environment_pb2.Opening | None) -> None:
        rollout.episode = EpisodeLog()
        rollout.turns, rollout.earlier, rollout.finished = [], [], False
        if opening is None or opening.error:
            rollout.episode.error = opening.error if opening else "lost: its environment replica did not answer"
            rollout.finished = True
        elif len(opening.prompt_ids) > self.prompt_budget:
            rollout.episode.error, rollout.finished = "too_long: the environment's opening", True
        else:
            rollout.prompt_ids = list(opening.prompt_ids)

    def _step(self, rollout: Rollout) -> environment_pb2.Observation:
        turn = rollout.turns[-1]
        request = environment_pb2.StepRequest(job_id=self.job_id, turns=[
            environment_pb2.PolicyTurn(episode_id=rollout.sample_id, token_ids=turn.token_ids)])
        replica = self._replica(rollout)
        try:
            reply = self.stubs[replica].Step(request, timeout=self.spec.step_timeout_seconds + CALL_MARGIN_SECONDS)
        except grpc.RpcError as error:
            wire.raise_if_misconfigured(error, f"Step on environment replica {replica}")
            return environment_pb2.Observation(episode_id=rollout.sample_id, done=True,
                                               error=f"lost: environment replica {replica}: {error.code().name}")
        return reply.observations[0]

    def _play(self, rollout: Rollout, example: Any, base_url: str) -> environment_pb2.PlayResponse:
        replica = self._replica(rollout)
        request = environment_pb2.PlayRequest(job_id=self.job_id, episode_id=rollout.sample_id, base_url=base_url,
                                              example_json=json.dumps(dataclasses.asdict(example)))
        seconds = self.spec.step_timeout_seconds * self.spec.max_turns + CALL_MARGIN_SECONDS
        try:
            return self.stubs[replica].Play(request, timeout=seconds)
        except grpc.RpcError as error:
            wire.raise_if_misconfigured(error, f"Play on environment replica {replica}")
            return environment_pb2.PlayResponse(episode_id=rollout.sample_id,
                                                error=f"lost: environment replica {replica}: {error.code().name}")

    def _played(self, rollout: Rollout, reply: environment_pb2.PlayResponse) -> None:
        """An agent's episode as the endpoint recorded it: its samples, the last the rollout's own."""
        rollout.episode = EpisodeLog(reward=reply.reward, seconds=reply.seconds, error=reply.error)
        rollout.finished = True
        samples = [(list(s.prompt_ids), [_turn(t) for t in s.turns]) for s in reply.samples]
        if len(samples) > 1:
            rollout.episode.drifted = True
            if not self.restarts:  # as a drifted episode of steps: it ends where it drifted
                samples, rollout.episode.truncated = samples[:1], True
        if samples:
            *rollout.earlier, (rollout.prompt_ids, rollout.turns) = samples

    def _answered(self, rollout: Rollout, answer: environment_pb2.Observation) -> None:
        """The environment's answer joins the episode (under the ledger's lock: a checkpoint reads rollouts)."""
        episode = rollout.episode
        episode.reward += answer.reward
        episode.seconds += answer.seconds
        _count(episode.tool_calls, answer.tool_calls)
        _count(episode.tool_errors, answer.tool_errors)
        episode.error = answer.error
        rollout.turn_ended = False
        if answer.done:
            rollout.finished = True
        elif answer.restart_ids:
            self._restart(rollout, list(answer.restart_ids))
        elif len(rollout.completion_ids) + len(answer.token_ids) >= self.limit:
            episode.truncated = rollout.finished = True
        else:
            rollout.turns.append(unsampled_turn(OBSERVATION, list(answer.token_ids), rollout.versions[-1]))

    def _restart(self, rollout: Rollout, prompt_ids: list[int]) -> None:
        rollout.episode.drifted = True
        if self.restarts and len(prompt_ids) <= self.prompt_budget:
            rollout.restart(prompt_ids)
        else:
            rollout.episode.truncated = rollout.finished = True


def _turn(record: environment_pb2.TurnRecord) -> Turn:
    return Turn(record.kind, tuple(record.token_ids), tuple(record.versions), tuple(record.logprobs))


def _count(counts: dict[str, int], more: Any) -> None:
    for name, count in more.items():
        counts[name] = counts.get(name, 0) + count


def episode_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """metrics.jsonl's view of a step's episodes: turns, tools (by tool too), errors, latency, restarts, versions."""
    episodes = [r for r in rollouts if r.episode is not None]
    if not episodes:
        return {}
    calls: dict[str, int] = {}
    errors: dict[str, int] = {}
    for rollout in episodes:
        _count(calls, rollout.episode.tool_calls)
        _count(errors, rollout.episode.tool_errors)
    count = len(episodes)
    return {
        "turns_mean": sum(r.policy_turns for r in episodes) / count,
        "tool_calls": sum(calls.values()),
        "tool_errors": sum(errors.values()),
        "tool_episode_share": sum(bool(r.episode.tool_calls) for r in episodes) / count,
        "environment_errors": sum(bool(r.episode.error) for r in episodes),
        "environment_seconds_mean": sum(r.episode.seconds for r in episodes) / count,
        "episodes_truncated": sum(r.episode.truncated for r in episodes),
        "episodes_drifted": sum(r.episode.drifted for r in episodes),
        "episodes_restarted": sum(bool(r.earlier) for r in episodes),
        "episodes_across_versions": sum(len({v for v, s in zip(r.versions, r.sampled) if s}) > 1 for r in episodes),
        **{f"tool_calls/{name}": n for name, n in sorted(calls.items())},
        **{f"tool_errors/{name}": n for name, n in sorted(errors.items())},
    }
