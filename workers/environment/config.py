"""What an environment pod is and which environment it runs (`spec.roles.environment`). Torch-free: part of the
RLJob schema.

The environment executor answers the policy's turns: a job with one runs multi-turn episodes (tools, feedback,
games) instead of single completions. `type` chooses the environment: the built-in tool environment, a class of
the user's own (protocol.py), or an adapter to an ecosystem's environments.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from rlfleet.workers.roles import Role
from rlfleet.workers.strict import Strict
from rlfleet.workers.user_code import UserCode

TOOL_NAMES = ("calculator", "python")
IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"


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
    seccomp_profile: str | None = Field(None, min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._/-]+$")
    """On Kubernetes, a `Localhost` seccomp profile for the environment pods (a path under the kubelet's seccomp
    directory, installed on the nodes) that allows `unshare`, `mount`, `umount2` and `pivot_root`: the python tool's
    sandbox then gets namespaces of its own under the restricted Pod Security profile (docs/environments.md). Unset:
    `RuntimeDefault`, which refuses them, and the sandbox falls back to rlimits only."""
    app_armor_profile: str | None = Field(None, min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._/-]+$")
    """On Kubernetes nodes that use AppArmor, a `Localhost` AppArmor profile for the environment pods that allows
    `mount` (with seccompProfile). Unset: the runtime's default."""


class ToolEnvironment(EnvironmentBase):
    """The policy answers the prompt, calling tools on the way: a turn with tool calls (chat-template format) gets
    their results as the next turn; the first turn without one is the final answer, which the job's scorers grade."""

    type: Literal["tools"] = "tools"
    tools: list[Literal["calculator", "python"]] = Field(default_factory=lambda: ["calculator"], min_length=1,
                                                         max_length=len(TOOL_NAMES))
    """Built-in tools the policy may call."""
    sandbox: Sandbox = Field(default_factory=Sandbox)
    """Limits of the python tool's runs."""
    call_reward: float = Field(0.0, ge=0.0, le=1.0)
    """Added once to an episode's reward when one of its turns makes a call that runs without error: a foothold for a
    model that rarely calls a tool well (the answer's reward stays the scorers')."""
    demonstration: bool = False
    """Open each episode with a worked example (a question, a call of the first tool, its result, the answer) after
    the system prompt: a small model that never calls a tool from the instructions alone sees one done."""


class AgentEnvironment(EnvironmentBase, UserCode):
    """An agent program the user already has, written against the `openai` client: the function
    `run(client: openai.OpenAI, example) -> float` plays one episode against the policy (a generator's
    OpenAI-compatible endpoint, generator/openai_api.py) and returns its reward; the run trains on exactly the tokens
    the endpoint recorded for the episode (environment/record.py). From a file (`path`, whose content travels in the
    job as `source`) or an installed module (`module`); docs/environments.md."""

    kind: ClassVar[str] = "agent"
    checker: ClassVar[str] = "rlfleet.workers.environment.agent"
    type: Literal["agent"] = "agent"
    function: str = Field("run", max_length=256, pattern=IDENTIFIER)
    """The function's name in the file or module."""

    def attribute(self) -> str:
        return self.function

    def fix(self) -> str:
        return f"define `def {self.function}(client, example)` returning the episode's reward, or set function"


class UserClass(UserCode):
    """A class of the user's own, made for each episode with `kwargs`."""

    class_name: str = Field(alias="class", max_length=256, pattern=IDENTIFIER)
    """The class's name in the file or module."""
    kwargs: dict[str, Any] = Field(default_factory=dict, max_length=64)
    """Keyword arguments of each instance."""

    def attribute(self) -> str:
        return self.class_name


class PythonEnvironment(EnvironmentBase, UserClass):
    """Your own environment: a subclass of protocol.py's Environment, from a file (`path`) or an installed module
    (`module`); docs/environments.md. Each episode gets an instance of its own, `Class(**kwargs)`."""

    kind: ClassVar[str] = "environment"
    checker: ClassVar[str] = "rlfleet.workers.environment.loading"
    type: Literal["python"] = "python"

    def fix(self) -> str:
        return (f"define `class {self.class_name}(Environment)` (rlfleet.workers.environment.protocol), or set "
                "class to its name")


class OpenEnvClass(UserClass):
    """An OpenEnv environment class (a subclass of openenv.core.env_server.interfaces.Environment) run in the
    environment executor's own process, without a server: `Class(**kwargs)` for each episode."""

    kind: ClassVar[str] = "openenv"
    checker: ClassVar[str] = "rlfleet.workers.environment.openenv"
    action: str = Field(max_length=256, pattern=IDENTIFIER)
    """The name of its Action class (the one its server's create_app takes), in the same file or module."""

    def fix(self) -> str:
        return (f"define `class {self.class_name}(Environment)` (openenv.core.env_server.interfaces), or set class "
                "to its name")


class OpenEnvEnvironment(EnvironmentBase):
    """An OpenEnv environment (PyPI `openenv-core`, TRL's environments): a server at `url`, each episode a session of
    its own on its WebSocket, or a class run in-process (`inProcess`); docs/environments.md. The policy's turn is
    sent as the action's `actionField`, the observation's `observationField` comes back as the next user turn, and
    the environment's reward and done are the step's. On Kubernetes, a server outside the job needs `egress: true`."""

    type: Literal["openenv"] = "openenv"
    url: str | None = Field(None, min_length=1, max_length=2048, pattern=r"^(http|ws)s?://")
    """The server's base URL (`http://host:8000`), as OpenEnv's clients take it."""
    in_process: OpenEnvClass | None = None
    """Instead of url: the environment's class, from a file (`path`) or an installed module (`module`)."""
    action_field: str = Field("message", min_length=1, max_length=256)
    """The action's field that carries the policy's reply (the environment's Action model names it)."""
    observation_field: str | None = Field(None, min_length=1, max_length=256)
    """The observation's field shown to the policy as the next user turn; null: the whole observation as JSON."""
    reset_kwargs: dict[str, Any] = Field(default_factory=dict, max_length=64)
    """Keyword arguments of each episode's reset (`seed`, or what the environment's reset takes)."""

    @model_validator(mode="after")
    def _one_environment(self) -> OpenEnvEnvironment:
        if (self.url is None) == (self.in_process is None):
            raise ValueError("give exactly one of url (a running OpenEnv server) and inProcess (its class)")
        return self


EnvironmentRole = Annotated[Union[ToolEnvironment, PythonEnvironment, OpenEnvEnvironment, AgentEnvironment],
                            Field(discriminator="type")]
