"""OpenEnv environments (PyPI `openenv-core`) as RLFleet environments. An episode is a session on the server's
WebSocket (OpenEnv's generic client: actions and observations as plain dicts, so the environment's own package need
not be installed here), or an instance of the environment's class in this process. The policy's turn is the
action's `actionField`; the observation's `observationField` (or the whole observation, as JSON) is the next user
turn; the environment's reward and done are the step's."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

from rlfleet.workers.environment.config import OpenEnvClass, OpenEnvEnvironment
from rlfleet.workers.environment.protocol import Environment, Message, Step
from rlfleet.workers.user_code import check_child, load_namespace


def episodes(spec: OpenEnvEnvironment) -> Callable[[], Environment]:
    """A new episode's adapter for each call; an in-process class is loaded once, here."""
    if spec.url is not None:
        return functools.partial(OpenEnvAdapter, spec, functools.partial(_remote, spec))
    environment, action = load_openenv_class(spec.in_process)
    return functools.partial(OpenEnvAdapter, spec,
                             functools.partial(InProcess, environment, action, spec.in_process.kwargs))


def _remote(spec: OpenEnvEnvironment) -> Any:
    from openenv.core.generic_client import GenericEnvClient

    # A server that stops answering fails the step within the step's own deadline.
    return GenericEnvClient(base_url=spec.url, message_timeout_s=spec.step_timeout_seconds).sync()


class InProcess:
    """An OpenEnv environment instance behind the generic client's interface (reset, step, close on dicts), its
    observations serialized as its server would send them."""

    def __init__(self, environment: type, action: type, kwargs: dict[str, Any]):
        self.environment = environment(**kwargs)
        self.action = action

    def reset(self, **kwargs: Any) -> Any:
        return _result(self.environment.reset(**kwargs))

    def step(self, action: dict[str, Any]) -> Any:
        from openenv.core.env_server.serialization import deserialize_action

        return _result(self.environment.step(deserialize_action(action, self.action)))

    def close(self) -> None:
        self.environment.close()


def _result(observation: Any) -> Any:
    from openenv.core.client_types import StepResult
    from openenv.core.env_server.serialization import serialize_observation

    return StepResult(**serialize_observation(observation))


class OpenEnvAdapter(Environment):
    """One episode of an OpenEnv environment, on a `session` (the generic client of a server, or InProcess)."""

    def __init__(self, spec: OpenEnvEnvironment, session: Callable[[], Any]):
        self.spec = spec
        self.session = session()

    def reset(self, example: Any) -> list[Message]:
        return [self._turn(self.session.reset(**self.spec.reset_kwargs).observation)]

    def step(self, reply: str) -> Step:
        result = self.session.step({self.spec.action_field: reply})
        return Step(messages=[] if result.done else [self._turn(result.observation)],
                    reward=float(result.reward or 0.0), done=bool(result.done))

    def close(self) -> None:
        self.session.close()

    def _turn(self, observation: dict[str, Any]) -> Message:
        field = self.spec.observation_field
        if field is None:
            return {"role": "user", "content": json.dumps(observation)}
        if field not in observation:
            raise KeyError(f"the observation has no {field!r} (it has {sorted(observation)}): set "
                           "spec.roles.environment.observationField to one of them, or null for all of it")
        return {"role": "user", "content": str(observation[field])}


def load_openenv_class(spec: OpenEnvClass) -> tuple[type, type]:
    """The environment class and its Action class that an in-process OpenEnv spec names."""
    from openenv.core.env_server.interfaces import Environment as OpenEnvBase
    from openenv.core.env_server.types import Action

    namespace = load_namespace(spec)
    environment, action = namespace.get(spec.class_name), namespace.get(spec.action)
    where = spec.module or spec.path
    if not (isinstance(environment, type) and issubclass(environment, OpenEnvBase)):
        raise TypeError(f"{where} has no OpenEnv environment class {spec.class_name!r}: {spec.fix()}")
    if not (isinstance(action, type) and issubclass(action, Action)):
        raise TypeError(f"{where} has no OpenEnv Action class {spec.action!r}: set action to the name of the class "
                        f"{spec.class_name}.step takes")
    return environment, action


def check_main() -> None:
    """The child of loading.environment_import_problems for an in-process class: load it; exit 1 saying why not."""
    check_child(lambda text: load_openenv_class(OpenEnvClass.model_validate_json(text)))
