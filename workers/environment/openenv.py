"""OpenEnv environments (PyPI `openenv-core`) as RLFleet environments: one episode is one session on the server's
WebSocket (OpenEnv's generic client: actions and observations as plain dicts, so the environment's own package need
not be installed here). The policy's turn is the action's `actionField`; the observation's `observationField` (or the
whole observation, as JSON) is the next user turn; the server's reward and done are the step's."""

from __future__ import annotations

import json
from typing import Any

from rlfleet.workers.environment.config import OpenEnvEnvironment
from rlfleet.workers.environment.protocol import Environment, Message, Step


class OpenEnvAdapter(Environment):
    """One episode on an OpenEnv server."""

    def __init__(self, spec: OpenEnvEnvironment):
        from openenv.core.generic_client import GenericEnvClient

        self.spec = spec
        # A server that stops answering fails the step within the step's own deadline.
        self.client = GenericEnvClient(base_url=spec.url, message_timeout_s=spec.step_timeout_seconds).sync()

    def reset(self, example: Any) -> list[Message]:
        return [self._turn(self.client.reset(**self.spec.reset_kwargs).observation)]

    def step(self, reply: str) -> Step:
        result = self.client.step({self.spec.action_field: reply})
        return Step(messages=[] if result.done else [self._turn(result.observation)],
                    reward=float(result.reward or 0.0), done=bool(result.done))

    def close(self) -> None:
        self.client.close()

    def _turn(self, observation: dict[str, Any]) -> Message:
        field = self.spec.observation_field
        if field is None:
            return {"role": "user", "content": json.dumps(observation)}
        if field not in observation:
            raise KeyError(f"the observation has no {field!r} (it has {sorted(observation)}): set "
                           "spec.roles.environment.observationField to one of them, or null for all of it")
        return {"role": "user", "content": str(observation[field])}
