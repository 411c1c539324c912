"""OpenEnv environments (`type: openenv`): a real OpenEnv environment plays whole episodes through the adapter's reset
and step, served by openenv-core's own app (uvicorn on 127.0.0.1, each episode a session of its own) or run
in-process. Needs the `env` extra (openenv-core)."""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.types import Observation

from rlfleet.workers.environment.config import OpenEnvClass
from rlfleet.workers.environment.loading import environment_import_problems, load_environment
from rlfleet.workers.environment.openenv import load_openenv_class
from rlfleet.workers.environment.protocol import Step
from rlfleet.workers.spec import parse_job

GUESS_ENV = textwrap.dedent("""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State


    class GuessAction(Action):
        message: str


    class GuessObservation(Observation):
        hint: str = ""


    class GuessEnv(Environment):
        \"\"\"Guess the number the reset names: "higher" or "lower" until found (reward 1).\"\"\"

        SUPPORTS_CONCURRENT_SESSIONS = True

        def reset(self, seed=None, episode_id=None, target: int = 37, **kwargs) -> GuessObservation:
            self.target, self.steps = target, 0
            return GuessObservation(hint="guess a number from 1 to 100")

        def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
            self.steps += 1
            guess = int(action.message.strip())
            if guess == self.target:
                return GuessObservation(hint="right", done=True, reward=1.0)
            return GuessObservation(hint="higher" if guess < self.target else "lower", reward=-0.1)

        @property
        def state(self) -> State:
            return State(step_count=self.steps)
""")
WHERE = "spec.roles.environment.inProcess"


@pytest.fixture(scope="module")
def guess_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("openenv") / "guess_env.py"
    path.write_text(GUESS_ENV)
    return path


def in_process(path: Path, **fields) -> dict:
    return {"path": str(path), "source": path.read_text(), "class": "GuessEnv", "action": "GuessAction", **fields}


@pytest.fixture(scope="module")
def server_url(guess_file):
    environment, action = load_openenv_class(OpenEnvClass.model_validate(in_process(guess_file)))
    app = create_fastapi_app(environment, action, Observation, max_concurrent_envs=4)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    listener.close()


def openenv(**fields):
    environment = {"type": "openenv", **fields}
    return parse_job({"metadata": {"name": "j"}, "spec": {"roles": {"environment": environment}}}).spec.roles.environment


@pytest.mark.parametrize("where", ["server", "in-process"])
def test_a_whole_episode(server_url, guess_file, where):
    place = {"url": server_url} if where == "server" else {"inProcess": in_process(guess_file, kwargs={})}
    environment = load_environment(openenv(**place, observationField="hint", resetKwargs={"target": 42}))()
    try:
        assert environment.reset(None) == [{"role": "user", "content": "guess a number from 1 to 100"}]
        assert environment.step("50") == Step(messages=[{"role": "user", "content": "lower"}], reward=-0.1)
        assert environment.step(" 40") == Step(messages=[{"role": "user", "content": "higher"}], reward=-0.1)
        assert environment.step("42") == Step(messages=[], reward=1.0, done=True)
    finally:
        environment.close()


def test_episodes_at_once_are_sessions_of_their_own(server_url):
    make_low = load_environment(openenv(url=server_url, observationField="hint", resetKwargs={"target": 5}))
    make_high = load_environment(openenv(url=server_url, observationField="hint", resetKwargs={"target": 95}))
    low, high = make_low(), make_high()
    try:
        low.reset(None), high.reset(None)
        assert low.step("50").messages[0]["content"] == "lower"
        assert high.step("50").messages[0]["content"] == "higher"
        assert low.step("5").done and not high.step("5").done
    finally:
        low.close(), high.close()


def test_without_an_observation_field_the_policy_reads_the_whole_observation(server_url):
    environment = load_environment(openenv(url=server_url))()
    try:
        [opening] = environment.reset(None)
        assert json.loads(opening["content"]) == {"hint": "guess a number from 1 to 100"}
    finally:
        environment.close()


def test_an_observation_without_the_field_ends_the_episode_naming_the_fix(server_url):
    environment = load_environment(openenv(url=server_url, observationField="text"))()
    try:
        with pytest.raises(KeyError, match=r"no 'text' \(it has \['hint'\]\): set spec.roles.environment."
                                           "observationField"):
            environment.reset(None)
    finally:
        environment.close()


def test_a_server_that_is_not_there_fails_the_episode():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    environment = load_environment(openenv(url=url))()
    try:
        with pytest.raises(ConnectionError):
            environment.reset(None)
    finally:
        environment.close()


@pytest.mark.parametrize("fields, expected", [
    ({"class": "GuessAction"}, f"{WHERE}.path: TypeError: {{path}} has no OpenEnv environment class 'GuessAction'"),
    ({"action": "GuessObservation"}, f"{WHERE}.path: TypeError: {{path}} has no OpenEnv Action class 'GuessObservation'"),
    ({"action": "Missing"}, f"{WHERE}.path: TypeError: {{path}} has no OpenEnv Action class 'Missing'"),
])
def test_an_in_process_class_that_does_not_load_is_refused(guess_file, fields, expected):
    spec = openenv(inProcess=in_process(guess_file, **fields))
    [problem] = environment_import_problems(spec)
    assert problem.startswith(expected.format(path=guess_file))


def test_an_in_process_class_that_loads_has_no_problem(guess_file):
    """The cases above, with their fields right (each check imports OpenEnv, and gradio with it, in a child: 8 s)."""
    assert environment_import_problems(openenv(inProcess=in_process(guess_file))) == []
