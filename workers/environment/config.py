"""What an environment pod is and which environment it runs (`spec.roles.environment`). Torch-free: part of the
RLJob schema.

The environment executor answers the policy's turns: a job with one runs multi-turn episodes (tools, feedback,
games) instead of single completions. `type` chooses the environment: the built-in tool environment, a class of
the user's own (protocol.py), or an adapter to an ecosystem's environments.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from rlfleet.workers.roles import Role
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


EnvironmentRole = Annotated[Union[ToolEnvironment], Field(discriminator="type")]
