"""The environment a job names (`spec.roles.environment`), as a factory of one episode's Environment, and the checks
that refuse its code (a python environment's class, an in-process OpenEnv class) when it cannot load, before any
worker starts (user_code.py's)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from rlfleet.workers.environment.config import PythonEnvironment
from rlfleet.workers.environment.protocol import Environment
from rlfleet.workers.user_code import (UserCode, check_child, import_problem, load_attribute, source_problem,
                                       with_source)

WHERE = "spec.roles.environment"


def load_environment(spec: Any) -> Callable[[], Environment]:
    """A new episode's environment for each call: the user's class, or an adapter to an ecosystem's environment."""
    if spec.type == "python":
        return functools.partial(load_class(spec), **spec.kwargs)
    if spec.type == "openenv":
        from rlfleet.workers.environment.openenv import episodes

        return episodes(spec)
    if spec.type == "tools":
        from rlfleet.workers.environment.tools import ToolUse

        return functools.partial(ToolUse, spec)
    raise ValueError(f"{WHERE}.type {spec.type!r}: no loader here (an agent's episodes run through Play)")


def load_class(spec: PythonEnvironment) -> type[Environment]:
    """The class a python environment names, imported from its source, its file or its module."""
    value = load_attribute(spec)
    if not (isinstance(value, type) and issubclass(value, Environment)):
        raise TypeError(f"{spec.class_name!r} in {spec.module or spec.path} is not a subclass of Environment: "
                        f"{spec.fix()}")
    return value


# ---------------------------------------------------------------- refusals before any worker starts


def with_environment_source(spec: Any) -> tuple[Any, list[str]]:
    """The environment with its code's `path` content in `source`, and the problem if the file cannot be read."""
    if (found := _code(spec)) is None:
        return spec, []
    where, code = found
    code, problem = with_source(code, where)
    if problem:
        return spec, [problem]
    return (spec.model_copy(update={"in_process": code}) if spec.type == "openenv" else code), []


def environment_import_problems(spec: Any) -> list[str]:
    """The problem of environment code that does not load, found by importing it in a child process."""
    problem = import_problem(found[1], found[0]) if (found := _code(spec)) else None
    return [problem] if problem else []


def environment_source_problems(spec: Any) -> list[str]:
    """What can be known of the environment's code without running it (the operator never does)."""
    problem = source_problem(found[1], found[0]) if (found := _code(spec)) else None
    return [problem] if problem else []


def _code(spec: Any) -> tuple[str, UserCode] | None:
    # The user's code in the environment's spec, and its field: a python environment, an agent, an in-process OpenEnv
    # class.
    if spec is not None and spec.type in ("python", "agent"):
        return WHERE, spec
    if spec is not None and spec.type == "openenv" and spec.in_process is not None:
        return f"{WHERE}.inProcess", spec.in_process
    return None


def check_main() -> None:
    """The child of `environment_import_problems`: load the class named by the spec on stdin; exit 1 saying why
    not."""
    check_child(lambda text: load_class(PythonEnvironment.model_validate_json(text)))
