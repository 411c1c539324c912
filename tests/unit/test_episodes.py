"""Multi-turn episodes (environment/): the controller's producers, a real Environment server on loopback and a
scripted generator. The policy's tokens train exactly as sampled, with their log mu and versions; the environment's
tokens are context only; a chat template that would render the policy's turn differently starts a new sample; an
environment that raises, hangs or is lost costs its episode a counted error, never the run."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import make_job
from fleet_fakes import make_parts, start_producers, train
from rlfleet.v1 import generator_pb2
from rlfleet.workers.controller.rollouts import training_samples
from rlfleet.workers.controller.stages import StageRun
from rlfleet.workers.environment.protocol import Environment, Step
from rlfleet.workers.environment.server import EnvironmentService, serve_environment
from rlfleet.workers.environment import stage
from rlfleet.workers.environment.stage import Episodes
from rlfleet.workers.models.tiny import build_tokenizer
from rlfleet.workers.plan import Endpoints

TOKEN = "t" * 32
TOOLS_TOKENIZER = build_tokenizer(tool_calls=True)  # its template ends the policy's turns with its end-of-text token
PLAIN_TOKENIZER = build_tokenizer()  # its template ends them with a newline: the policy's tokens would not match
EOS = TOOLS_TOKENIZER.eos_token_id


def ids(text: str) -> list[int]:
    return TOOLS_TOKENIZER(text, add_special_tokens=False)["input_ids"]


class Again(Environment):
    """Answers "again" twice, then ends with reward 0.5; counts a calculator call each time it answers."""

    def reset(self, example):
        self.turns = 0

    def step(self, reply):
        self.turns += 1
        if self.turns == 3:
            return Step(reward=0.5, done=True)
        return Step(messages=[{"role": "user", "content": "again"}], tool_calls={"calculator": 1})


class Raises(Again):
    def step(self, reply):
        raise RuntimeError("the environment's own bug")


class Hangs(Again):
    def step(self, reply):
        time.sleep(3)


class Turns:
    """A generator whose every turn is "42" then its end-of-text token, over two visits; its weights move on a
    version at every call when `moving`."""

    def __init__(self, moving: bool = False):
        self.version, self.moving, self.calls, self.alive = 0, moving, 0, True

    def Generate(self, request, timeout=None):
        self.calls += 1
        version = self.version
        self.version += self.moving
        segments = []
        for s in request.sequences:
            first = not s.completion_ids or s.completion_ids[-1] != ids("4")[0]
            tokens = ids("4") if first else ids("2") + [EOS]
            segments.append(generator_pb2.Segment(sample_id=s.sample_id, token_ids=tokens,
                                                  logprobs=[-0.5 - version] * len(tokens), finished=not first))
        return generator_pb2.GenerateResponse(job_id=request.job_id, policy_version=version, segments=segments)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(tmp_path, env, tokenizer=TOOLS_TOKENIZER, generator=None, timeout=30.0, serve=True, serve_after=0.0,
        **roles):
    """One step of one prompt (a group of 2 episodes) through producers, the Episodes stage and a real server
    (started `serve_after` seconds late, as a replica that restarts)."""
    job = make_job(algorithm={"steps": 1, "promptsPerStep": 1, "groupSize": 2, "maxStaleness": 4},
                   generation={"maxNewTokens": 64},
                   roles={"environment": {"type": "tools", "stepTimeoutSeconds": timeout}, **roles})
    service = EnvironmentService(job, env, tokenizer)
    port = free_port()
    servers = []
    starting = threading.Timer(serve_after, lambda: servers.append(
        serve_environment(job, service, port, "127.0.0.1", token=TOKEN)))
    if serve:
        starting.start()
    ctx = SimpleNamespace(job=job, token=TOKEN, endpoints=Endpoints("", servers={"env": [f"127.0.0.1:{port}"]}),
                          leader_epoch=None)
    episodes = Episodes(ctx, StageRun(None, None, decode=str, prompt_budget=200))
    generator = generator or Turns()
    parts, fleet = make_parts(job, tmp_path, [generator], encode=lambda example: [9])
    parts.stages.append(episodes)
    try:
        start_producers(parts, [generator])
        [(_, batch)] = train(parts, fleet, range(1))
    finally:
        episodes.close()
        starting.cancel()  # a server not started yet never starts after the test
        if serve:
            starting.join()
        for server in servers:
            server.stop(0)
    return batch.rollouts, service


def test_the_policys_tokens_train_as_sampled_and_the_environments_as_context(tmp_path):
    rollouts, service = run(tmp_path, Again)
    rollout = rollouts[0]
    opening = TOOLS_TOKENIZER.apply_chat_template([{"role": "user", "content": f"{rollout.prompt}+0="}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    observation = ids("\nuser: again\nassistant: ")
    turn = ids("42") + [EOS]
    assert rollout.prompt_ids == list(opening)  # the environment opened the episode
    assert rollout.completion_ids == turn + observation + turn + observation + turn
    assert rollout.sampled == [True] * 3 + [False] * len(observation) + [True] * 3 + [False] * len(observation) + \
        [True] * 3
    assert rollout.trained == rollout.sampled
    [sample] = training_samples([rollout])
    mu = [x for x, sampled in zip(sample.gen_logprobs, sample.sampled) if sampled]
    assert mu == [-0.5] * 9 and all(x == 0.0 for x, s in zip(sample.gen_logprobs, sample.sampled) if not s)
    assert rollout.finished and rollout.policy_turns == 3 and rollout.answer_ids == turn
    assert rollout.reward == pytest.approx(0.5 + rollout.scorer_scores.get("math_answer", 0.0))
    assert rollout.episode.tool_calls == {"calculator": 2} and rollout.episode.error == ""
    assert service.counts.tool_calls == {"calculator": 4} and service.sessions == {}  # ended and freed


def test_an_episode_split_across_weight_versions_keeps_each_tokens_own(tmp_path):
    rollouts, _ = run(tmp_path, Again, generator=Turns(moving=True))
    for rollout in rollouts:
        sampled = [v for v, s in zip(rollout.versions, rollout.sampled) if s]
        assert len(set(sampled)) > 1 and rollout.version == min(sampled)
        mu = [x for x, s in zip(rollout.gen_logprobs, rollout.sampled) if s]
        assert mu == [-0.5 - v for v in sampled]  # each token's log mu under the weights that sampled it
        # An observation's tokens take the version of the context before them, and never count for staleness.
        for turn, before in zip(rollout.turns[1:], rollout.turns):
            if not turn.sampled:
                assert set(turn.versions) == {before.versions[-1]}
    assert Episodes.shape(None, rollouts)["episodes_across_versions"] == 2


def test_a_template_that_renders_the_policys_turn_otherwise_starts_a_new_sample(tmp_path):
    """The plain tiny template ends an assistant turn with a newline, the policy with its end-of-text token: the
    rendered chat is no longer an exact prefix of the policy's tokens, which are never re-tokenised."""
    rollouts, _ = run(tmp_path, Again, tokenizer=PLAIN_TOKENIZER)
    rollout = rollouts[0]
    turn = ids("42") + [EOS]
    assert len(rollout.earlier) == 2 and rollout.completion_ids == turn
    for prompt_ids, turns in rollout.earlier:
        assert [t for part in turns for t in part.token_ids] == turn and all(part.sampled for part in turns)
    second_prompt = PLAIN_TOKENIZER.decode(rollout.earlier[1][0])
    assert second_prompt.endswith("assistant: 42\nuser: again\nassistant: ")  # the chat rendered anew
    samples = training_samples(rollouts)
    assert len(samples) == 6 and {s.advantage for s in samples[:4]} <= {r.advantage for r in rollouts}
    assert Episodes.shape(None, rollouts)["episodes_restarted"] == 2


def test_with_a_reference_a_drifted_episode_ends_where_it_drifted(tmp_path):
    rollouts, _ = run(tmp_path, Again, tokenizer=PLAIN_TOKENIZER, reference={})
    assert all(r.earlier == [] and r.episode.drifted and r.episode.truncated for r in rollouts)
    assert rollouts[0].completion_ids == ids("42") + [EOS]


@pytest.mark.parametrize("env, timeout, reason", [(Raises, 30.0, "raised"), (Hangs, 0.3, "timeout")])
def test_an_environment_that_raises_or_hangs_ends_its_episode_counted(tmp_path, env, timeout, reason):
    rollouts, service = run(tmp_path, env, timeout=timeout)
    assert all(r.finished and r.episode.error.startswith(reason) for r in rollouts)
    assert service.counts.errors == {reason: 2}
    assert Episodes.shape(None, rollouts)["environment_errors"] == 2


def test_a_restarting_environment_replica_is_waited_for_and_plays_its_episodes(tmp_path):
    """Once, episodes whose replica was down ended at once as lost, without a token: in a chaos run every batch of a
    replica's restart was dropped, and the run raced through 370 steps of its data training nothing."""
    rollouts, _ = run(tmp_path, Again, serve_after=1.0)
    assert all(r.finished and r.episode.error == "" and r.policy_turns == 3 for r in rollouts)


def test_a_lost_environment_replica_ends_its_episodes_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "RETURN_SECONDS", 0.5)
    rollouts, _ = run(tmp_path, Again, serve=False)
    assert all(r.finished and r.episode.error.startswith("lost") and not r.completion_ids for r in rollouts)
