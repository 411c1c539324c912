"""The environment a job names (`spec.roles.environment`), as a factory of one episode's Environment, and the checks
that refuse a python environment whose class cannot load before any worker starts (user_code.py's)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from rlfleet.workers.environment.config import PythonEnvironment
from rlfleet.workers.environment.protocol import Environment
from rlfleet.workers.user_code import check_child, import_problem, load_attribute, source_problem, with_source

WHERE = "spec.roles.environment"


def load_environment(spec: Any) -> Callable[[], Environment]:
    """A new episode's environment for each call: the user's class, or an adapter to an ecosystem's environment."""
    if spec.type == "python":
        return functools.partial(load_class(spec), **spec.kwargs)
    if spec.type == "openenv":
        from rlfleet.workers.environment.openenv import OpenEnvAdapter

        return functools.partial(OpenEnvAdapter, spec)
    raise ValueError(f"{WHERE}.type {spec.type!r}: no loader here")


def load_class(spec: PythonEnvironment) -> type[Environment]:
    """The class a python environment names, imported from its source, its file or its module."""
    value = load_attribute(spec)
    if not (isinstance(value, type) and issubclass(value, Environment)):
        raise TypeError(f"{spec.class_name!r} in {spec.module or spec.path} is not a subclass of Environment: "
                        f"{spec.fix()}")
    return value


# ---------------------------------------------------------------- refusals before any worker starts


def with_environment_source(spec: Any) -> tuple[Any, list[str]]:
    """The environment with a python `path`'s content in `source`, and the problem if the file cannot be read."""
    if spec is None or spec.type != "python":
        return spec, []
    spec, problem = with_source(spec, WHERE)
    return spec, [problem] if problem else []


def environment_import_problems(spec: Any) -> list[str]:
    """The problem of a python environment whose class does not load, found by importing it in a child process."""
    problem = import_problem(spec, WHERE) if spec is not None and spec.type == "python" else None
    return [problem] if problem else []


def environment_source_problems(spec: Any) -> list[str]:
    """What can be known of a python environment without running its code (the operator never does)."""
    problem = source_problem(spec, WHERE) if spec is not None and spec.type == "python" else None
    return [problem] if problem else []


def check_main() -> None:
    """The child of `environment_import_problems`: load the class named by the spec on stdin; exit 1 saying why
    not."""
    check_child(lambda text: load_class(PythonEnvironment.model_validate_json(text)))
