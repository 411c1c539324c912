"""The Environment gRPC service: one environment instance and one token record per open episode.

Start opens episodes and returns their prompts, rendered with the model's chat template; Step gives each episode
the policy's finished turn and returns the environment's answer as tokens (episode.py); End frees them. A step runs
in a thread of its own, bounded by stepTimeoutSeconds: one that raises or hangs ends its episode with a counted
error, never the run (a hung step's thread is abandoned; it frees its episode whenever it returns).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, TimeoutError as StepTimeout
from dataclasses import dataclass
from typing import Any, Callable

from rlfleet.v1 import environment_pb2, environment_pb2_grpc
from rlfleet.workers import wire
from rlfleet.workers.data.tasks import Example
from rlfleet.workers.environment.episode import Conversation
from rlfleet.workers.environment.protocol import Environment, Step
from rlfleet.workers.metrics.exporter import WorkerMetrics
from rlfleet.workers.metrics.families import EnvironmentMetrics
from rlfleet.workers.spec import RLJob

log = logging.getLogger(__name__)
SERVICE = environment_pb2.DESCRIPTOR.services_by_name["Environment"].full_name
# Open episodes at most on one replica: a controller that never ends its episodes cannot exhaust memory.
MAX_SESSIONS = 65536
# Threads that run environment steps at once; more steps wait for one (environment latency overlaps generation
# because the controller keeps generating for the episodes that are not waiting).
STEP_THREADS = 64


@dataclass
class Session:
    env: Environment
    conversation: Conversation
    turns: int = 0


class EnvironmentService(environment_pb2_grpc.EnvironmentServicer):
    def __init__(self, job: RLJob, make_env: Callable[[], Environment] | None, tokenizer: Any,
                 metrics: WorkerMetrics | None = None, token: str = ""):
        """`make_env`: one environment per episode (None for an agent's episodes, which Play runs); `token`: the
        job's, which an agent's client shows the generators' endpoint."""
        self.job_id = job.metadata.name
        self.token = token
        self.spec = job.spec.roles.environment
        self.make_env = make_env
        self.tokenizer = tokenizer
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.steps = ThreadPoolExecutor(STEP_THREADS, thread_name_prefix="env-step")
        self.counts = EnvironmentCounts()
        worker = metrics or WorkerMetrics("env", job=self.job_id, namespace=job.metadata.namespace)
        self.metrics = EnvironmentMetrics(worker, self.counts)

    def Start(self, request, context):
        self._check(request.job_id, len(request.episodes), context)
        with self.metrics.clock.busy():
            openings = [self._open(e.episode_id, e.example_json) for e in request.episodes]
        return environment_pb2.StartResponse(job_id=self.job_id, openings=openings)

    def Step(self, request, context):
        self._check(request.job_id, len(request.turns), context)
        unknown = [t.episode_id for t in request.turns if t.episode_id not in self.sessions]
        if unknown:
            wire.invalid(context, f"turns: episode {unknown[0][:80]!r} is not open on this replica (Start it first)")
        with self.metrics.clock.busy():
            observations = [self._step(turn.episode_id, list(turn.token_ids)) for turn in request.turns]
        return environment_pb2.StepResponse(job_id=self.job_id, observations=observations)

    def End(self, request, context):
        self._check(request.job_id, len(request.episode_ids), context)
        for episode_id in request.episode_ids:
            self._close(episode_id)
        return environment_pb2.EndResponse(job_id=self.job_id)

    def Play(self, request, context):
        self._check(request.job_id, 1, context)
        if self.spec.type != "agent":
            wire.invalid(context, f"Play runs an agent's episode: this job's environment is of type {self.spec.type}")
        started = time.monotonic()
        with self.metrics.clock.busy():
            try:
                samples, reward = self.steps.submit(self._play, request).result(timeout=self._episode_seconds())
            except StepTimeout:
                return self._played(request, "timeout", started)
            except Exception as error:  # noqa: BLE001 - the user's agent: its episode fails, counted
                log.warning("episode %s: the agent raised %r", request.episode_id, error)
                return self._played(request, "raised", started, f": {error!r}")
        seconds = time.monotonic() - started
        self.metrics.step_seconds.observe(seconds)
        return environment_pb2.PlayResponse(job_id=self.job_id, episode_id=request.episode_id, reward=reward,
                                            seconds=seconds, samples=[sample_record(s) for s in samples])

    def _play(self, request) -> tuple[list[Any], float]:
        from rlfleet.workers.environment.agent import run_agent_episode

        example = Example(**json.loads(request.example_json))
        return run_agent_episode(self.spec, example, request.base_url, self.token, request.episode_id)

    def _episode_seconds(self) -> float:
        """An agent's episode is its calls: maxTurns of them, each bounded by stepTimeoutSeconds."""
        return self.spec.step_timeout_seconds * self.spec.max_turns

    def _played(self, request, reason: str, started: float, detail: str = "") -> environment_pb2.PlayResponse:
        self.counts.error(reason)
        return environment_pb2.PlayResponse(job_id=self.job_id, episode_id=request.episode_id,
                                            error=f"{reason}{detail}"[:1000], seconds=time.monotonic() - started)

    def _check(self, job_id: str, items: int, context: Any) -> None:
        if job_id != self.job_id:
            wire.invalid(context, f"job_id {job_id[:80]!r} is not this environment's job ({self.job_id!r})")
        if not 1 <= items <= wire.MAX_SEQUENCES:
            wire.invalid(context, f"need 1..{wire.MAX_SEQUENCES} episodes in one call, got {items}")

    def _open(self, episode_id: str, example_json: str) -> environment_pb2.Opening:
        try:
            example = Example(**json.loads(example_json))
            env = self.make_env()
            messages = env.reset(example) or example.messages or [{"role": "user", "content": example.prompt}]
            session = Session(env, Conversation(self.tokenizer, messages, env.tools))
        except Exception as error:  # noqa: BLE001 - the user's environment: its episode fails, counted
            self.counts.error("start_failed")
            log.warning("episode %s could not start: %r", episode_id, error)
            return environment_pb2.Opening(episode_id=episode_id, error=f"start_failed: {error!r}"[:1000])
        with self.lock:
            if len(self.sessions) >= MAX_SESSIONS:
                self.sessions.pop(next(iter(self.sessions))).env.close()
            self.sessions[episode_id] = session
        return environment_pb2.Opening(episode_id=episode_id, prompt_ids=session.conversation.ids)

    def _step(self, episode_id: str, token_ids: list[int]) -> environment_pb2.Observation:
        session = self.sessions[episode_id]
        session.turns += 1
        reply = session.conversation.reply(token_ids)
        started = time.monotonic()
        try:
            step = self.steps.submit(session.env.step, reply).result(timeout=self.spec.step_timeout_seconds)
        except StepTimeout:
            return self._failed(episode_id, "timeout", started)
        except Exception as error:  # noqa: BLE001 - the user's environment: its episode fails, counted
            log.warning("episode %s: the environment's step raised %r", episode_id, error)
            return self._failed(episode_id, "raised", started, f": {error!r}")
        seconds = time.monotonic() - started
        self.counts.stepped(step)
        self.metrics.step_seconds.observe(seconds)
        return self._answer(episode_id, session, step, seconds)

    def _answer(self, episode_id: str, session: Session, step: Step, seconds: float) -> environment_pb2.Observation:
        done = step.done or not step.messages or session.turns >= self.spec.max_turns
        answer = environment_pb2.Observation(episode_id=episode_id, done=done, reward=step.reward, seconds=seconds,
                                             tool_calls=step.tool_calls, tool_errors=step.tool_errors)
        if not done:
            appended = session.conversation.observe(step.messages)
            answer.token_ids.extend(appended.token_ids)
            answer.restart_ids.extend(appended.restart_ids)
        return answer

    def _failed(self, episode_id: str, reason: str, started: float, detail: str = "") -> environment_pb2.Observation:
        self.counts.error(reason)
        self._close(episode_id)
        return environment_pb2.Observation(episode_id=episode_id, done=True, error=f"{reason}{detail}"[:1000],
                                           seconds=time.monotonic() - started)

    def _close(self, episode_id: str) -> None:
        with self.lock:
            session = self.sessions.pop(episode_id, None)
        if session is not None:
            self.steps.submit(session.env.close)  # behind a hung step of its own, never in the caller's way

    def close(self) -> None:
        self.steps.shutdown(wait=False, cancel_futures=True)


def sample_record(sample: Any) -> environment_pb2.SampleRecord:
    """An agent's sample (record.AgentSample) on the wire."""
    return environment_pb2.SampleRecord(prompt_ids=sample.prompt_ids, turns=[
        environment_pb2.TurnRecord(kind=t.kind, token_ids=t.token_ids, logprobs=t.logprobs, versions=t.versions)
        for t in sample.turns])


class EnvironmentCounts:
    """What the replica's environments did since it started: the Prometheus counters read these."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tool_calls: Counter[str] = Counter()
        self.tool_errors: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.steps = 0

    def stepped(self, step: Step) -> None:
        with self.lock:
            self.steps += 1
            self.tool_calls.update(step.tool_calls)
            self.tool_errors.update(step.tool_errors)

    def error(self, reason: str) -> None:
        with self.lock:
            self.errors[reason] += 1


def serve_environment(job: RLJob, service: EnvironmentService, port: int, host: str = "0.0.0.0", *,
                      token: str) -> Any:
    server, _ = wire.serve(port, [lambda s: environment_pb2_grpc.add_EnvironmentServicer_to_server(service, s)],
                           [SERVICE], host, threads=32, token=token)
    return server
