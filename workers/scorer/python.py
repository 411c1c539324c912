"""The user's reward functions (`type: python`, docs/rewards.md): loaded in the scorer's child process, their
results checked, and the checks that refuse a job whose function cannot load before any worker starts."""

from __future__ import annotations

import math
from typing import Any, Callable

from rlfleet.workers.scorer.config import PythonScorer
from rlfleet.workers.user_code import check_child, import_problem, load_attribute, source_problem, with_source

# A component's name becomes a metrics key (reward/<name>) and a Prometheus label value; each is a metric and part of
# every Score reply, so their number is bounded too.
MAX_COMPONENT_CHARS = 64
MAX_COMPONENTS = 16


class BadResult(ValueError):
    """The function returned something that is not a score; `reason` says which failure it counts as."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def load_function(spec: PythonScorer) -> Callable[..., Any]:
    """The function a scorer names, imported from its source, its file or its module."""
    function = load_attribute(spec)
    if not callable(function):
        raise TypeError(f"{spec.function!r} in {spec.module or spec.path} is a {type(function).__name__}, "
                        "not a function")
    return function


def checked_result(value: Any) -> tuple[float, dict[str, float]]:
    """(score, components) of what the function returned: a finite number, or a dict of named finite numbers
    whose sum is the score. Raises BadResult (reason `wrong_type` or `nonfinite`) for anything else."""
    if isinstance(value, dict):
        if len(value) > MAX_COMPONENTS:
            raise BadResult("wrong_type", f"{len(value)} components: at most {MAX_COMPONENTS}")
        components = {}
        for name, part in value.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_COMPONENT_CHARS:
                raise BadResult("wrong_type", f"component name {name!r}: a string of 1 to {MAX_COMPONENT_CHARS} "
                                "characters")
            components[name] = _number(part, f"component {name!r}")
        return sum(components.values()), components
    return _number(value, "the score"), {}


def _number(value: Any, what: str) -> float:
    # bool is an int to Python, but a True returned for a score is a bug more often than a 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadResult("wrong_type", f"{what} is a {type(value).__name__}, not a number")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        raise BadResult("nonfinite", f"{what} does not fit a float") from None
    if not math.isfinite(number):
        raise BadResult("nonfinite", f"{what} is {number}")
    return number


# ---------------------------------------------------------------- refusals before any worker starts


def with_sources(scorers: list[Any]) -> tuple[list[Any], list[str]]:
    """The scorers with each python `path`'s content in `source` (read from where rlfleet runs), and a problem
    line naming the field for each file that cannot be read or is too large."""
    filled, problems = [], []
    for index, spec in enumerate(scorers):
        if spec.type == "python":
            spec, problem = with_source(spec, f"spec.scorers.{index}")
            problems += [problem] if problem else []
        filled.append(spec)
    return filled, problems


def import_problems(scorers: list[Any]) -> list[str]:
    """A line per python scorer whose function does not load, found by importing it in a child process."""
    problems = [import_problem(spec, f"spec.scorers.{index}")
                for index, spec in enumerate(scorers) if spec.type == "python"]
    return [problem for problem in problems if problem]


def check_main() -> None:
    """The child of `import_problems`: load the function named by the spec on stdin; exit 1 saying why not."""
    check_child(lambda text: load_function(PythonScorer.model_validate_json(text)))


def source_problems(scorers: list[Any]) -> list[str]:
    """What the operator can know without running the user's code (it never does: the code would run with the
    operator's service account): a path scorer carries its source, the source parses, and it defines the
    function at the top level."""
    problems = [source_problem(spec, f"spec.scorers.{index}")
                for index, spec in enumerate(scorers) if spec.type == "python"]
    return [problem for problem in problems if problem]
