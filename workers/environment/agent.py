"""One episode of an agent the user already has (config.AgentEnvironment): their function runs against a generator's
OpenAI-compatible endpoint under a session of its own; what the endpoint recorded becomes the training samples.

The caller picks the generator replica and keeps it for the whole episode (sticky: the session's record lives there,
and vLLM's prefix cache holds the chat so far).
"""

from __future__ import annotations

import functools
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

from rlfleet.workers.environment.config import AgentEnvironment
from rlfleet.workers.environment.record import AgentSample, Call, assemble
from rlfleet.workers.generator.openai_api import SESSION_HEADER
from rlfleet.workers.user_code import check_child, load_attribute

# Fetching or deleting a record is a dictionary look-up on the generator.
SESSION_CALL_SECONDS = 30.0


def run_agent_episode(spec: AgentEnvironment, example: Any, base_url: str, token: str,
                      session_id: str) -> tuple[list[AgentSample], float]:
    """Run the user's agent on `example` against the endpoint at `base_url` (`http://host:port/v1`) and return the
    session's training samples and the agent's reward. The session's record is deleted whatever happens."""
    import openai  # the environment workers' dependency only

    # No retries: a call the server served but whose answer was lost would be recorded twice.
    client = openai.OpenAI(base_url=base_url, api_key=token, default_headers={SESSION_HEADER: session_id},
                           timeout=spec.step_timeout_seconds, max_retries=0)
    try:
        reward = agent_function(spec.model_dump_json())(client, example)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"{spec.function} returned {reward!r:.80}: an agent returns its reward, a finite number")
        calls = fetch_session(base_url, token, session_id)
    finally:
        client.close()
        delete_session(base_url, token, session_id)
    return assemble(calls), float(reward)


@functools.lru_cache(maxsize=8)
def agent_function(spec_json: str) -> Callable[[Any, Any], Any]:
    """The agent's function, from its source, its file or its module, loaded once per process (keyed by the spec's
    JSON: a pydantic model is no dictionary key)."""
    spec = AgentEnvironment.model_validate_json(spec_json)
    found = load_attribute(spec)
    if not callable(found):
        raise TypeError(f"{spec.function!r} in {spec.module or spec.path} is not a function: {spec.fix()}")
    return found


def check_main() -> None:
    """The child of `rlfleet validate`'s import check (user_code.import_problem): load the agent's function."""
    check_child(agent_function)


def fetch_session(base_url: str, token: str, session_id: str) -> list[Call]:
    """The calls a generator recorded under `session_id`, in order (none: the agent called nothing)."""
    try:
        with urllib.request.urlopen(_session_request(base_url, token, session_id, "GET"),
                                    timeout=SESSION_CALL_SECONDS) as reply:
            return [Call.from_json(call) for call in json.load(reply)["calls"]]
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return []
        raise


def delete_session(base_url: str, token: str, session_id: str) -> None:
    """Free the record (a session that recorded nothing has none: nothing to free)."""
    try:
        urllib.request.urlopen(_session_request(base_url, token, session_id, "DELETE"),
                               timeout=SESSION_CALL_SECONDS).close()
    except urllib.error.HTTPError as error:
        if error.code != 404:
            raise


def _session_request(base_url: str, token: str, session_id: str, method: str) -> urllib.request.Request:
    url = f"{base_url.rstrip('/')}/sessions/{urllib.parse.quote(session_id, safe='')}"
    return urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {token}"})
