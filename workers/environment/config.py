"""What an environment pod is and which environment it runs (`spec.roles.environment`). Torch-free: part of the
RLJob schema.

The environment executor answers the policy's turns: a job with one runs multi-turn episodes (tools, feedback,
games) instead of single completions. `type` chooses the environment: the built-in tool environment, a class of
the user's own (protocol.py), or an adapter to an ecosystem's environments.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from rlfleet.workers.roles import Role
from rlfleet.workers.scorer.config import MODULE_PATTERN
from rlfleet.workers.strict import Strict

TOOL_NAMES = ("calculator", "python")


class Sandbox(Strict):
    """Limits of one run of the python tool's code (workers/environment/sandbox.py)."""

    timeout_seconds: float = Field(5.0, gt=0.0, le=300.0)
    """Wall-clock time of one run; past it the run is killed and the call is a tool error."""
    memory_mib: int = Field(256, ge=16, le=16384)
    """Address space of the run."""
    processes: int = Field(16, ge=1, le=1024)
    """Processes and threads the run may have at once (a fork bomb stops here)."""


class EnvironmentBase(Role):
    max_turns: int = Field(8, ge=1, le=1000)
    """The policy's turns per episode at most; an episode still going then ends (truncated, counted)."""
    step_timeout_seconds: float = Field(60.0, gt=0.0, le=3600.0)
    """An environment step slower than this ends its episode with an error (counted), never the run."""
    egress: bool = False
    """On Kubernetes, whether environment pods may open connections outside the job (their NetworkPolicy)."""


class ToolEnvironment(EnvironmentBase):
    """The policy answers the prompt, calling tools on the way: a turn with tool calls (chat-template format) gets
    their results as the next turn; the first turn without one is the final answer, which the job's scorers grade."""

    type: Literal["tools"] = "tools"
    tools: list[Literal["calculator", "python"]] = Field(default_factory=lambda: ["calculator"], min_length=1,
                                                         max_length=len(TOOL_NAMES))
    """Built-in tools the policy may call."""
    sandbox: Sandbox = Field(default_factory=Sandbox)
    """Limits of the python tool's runs."""


class AgentEnvironment(EnvironmentBase):
    """An agent program the user already has, written against the `openai` client: the function
    `run(client: openai.OpenAI, example) -> float` plays one episode against the policy (a generator's
    OpenAI-compatible endpoint, generator/openai_api.py) and returns its reward; the run trains on exactly the tokens
    the endpoint recorded for the episode (environment/record.py). docs/environments.md."""

    type: Literal["agent"] = "agent"
    module: str | None = Field(None, max_length=256, pattern=MODULE_PATTERN)
    """A module installed in the image that defines the function (`my_agents.search`)."""
    path: str | None = Field(None, min_length=1, max_length=4096, pattern=r"\.py$")
    """Instead of module: a .py file that defines it, where the environment workers run (on Kubernetes, in the
    image or on the job's storage)."""
    function: str = Field("run", max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The function's name in the module or file."""

    @model_validator(mode="after")
    def _one_place(self) -> AgentEnvironment:
        if (self.path is None) == (self.module is None):
            raise ValueError("give exactly one of module (an installed module) and path (a .py file)")
        return self


EnvironmentRole = Annotated[Union[ToolEnvironment, AgentEnvironment], Field(discriminator="type")]
