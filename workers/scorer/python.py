"""The user's reward functions (`type: python`, docs/rewards.md): loaded in the scorer's child process, their
results checked, and the checks that refuse a job whose function cannot load before any worker starts."""

from __future__ import annotations

import ast
import importlib
import json
import math
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Callable

from rlfleet.workers.scorer.config import MAX_SOURCE_BYTES, PythonScorer

# Importing the user's code to check it: a module that takes longer at import would stall every scorer start.
CHECK_SECONDS = 30.0
# What the check's child prints once the function loaded.
LOADED = "rlfleet: loaded"
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
    if spec.module is not None:
        namespace = vars(importlib.import_module(spec.module))
    else:
        source = spec.source if spec.source is not None else Path(spec.path).read_text(encoding="utf-8")
        namespace = _executed(source, spec.path)
    function = namespace.get(spec.function)
    if function is None:
        raise AttributeError(f"{spec.module or spec.path} defines no {spec.function!r}{_fix(spec)}")
    if not callable(function):
        raise TypeError(f"{spec.function!r} in {spec.module or spec.path} is a {type(function).__name__}, "
                        "not a function")
    return function


def _executed(source: str, path: str) -> dict[str, Any]:
    # A module object, registered, so that dataclasses and pickling inside the user's code find their module.
    name = f"rlfleet_reward_{Path(path).stem}"
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102 - the job's own reward code, by design
    return module.__dict__


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
        if spec.type == "python" and spec.path is not None and spec.source is None:
            try:
                data = Path(spec.path).read_bytes()
                if len(data) > MAX_SOURCE_BYTES:
                    raise ValueError(f"{len(data)} bytes: at most {MAX_SOURCE_BYTES} (it travels in the job's "
                                     "ConfigMap); install larger code in the image and name it by `module`")
                spec = spec.model_copy(update={"source": data.decode("utf-8")})
            except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
                problems.append(f"spec.scorers.{index}.path {spec.path!r}: {getattr(err, 'strerror', None) or err}"
                                " (a relative path is taken from where rlfleet runs)")
        filled.append(spec)
    return filled, problems


def import_problems(scorers: list[Any]) -> list[str]:
    """A line per python scorer whose function does not load, found by importing it in a child process (the
    user's code may hang, exit or crash at import): where rlfleet runs, which is where its workers run."""
    problems = []
    for index, spec in enumerate(scorers):
        if spec.type == "python":
            problem = _import_problem(spec)
            if problem:
                problems.append(f"spec.scorers.{index}.{'module' if spec.module else 'path'}: {problem}")
    return problems


def _import_problem(spec: PythonScorer) -> str | None:
    # -P: the current directory is not on the path, as it is not for the workers (they run in the run directory).
    command = [sys.executable, "-P", "-c", "from rlfleet.workers.scorer.python import check_main; check_main()"]
    try:
        done = subprocess.run(command, input=spec.model_dump_json(), capture_output=True, text=True,
                              timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        return f"importing it took over {CHECK_SECONDS:.0f} s"
    if done.returncode == 0 and done.stdout.endswith(LOADED):
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"the import ended the process (status {done.returncode})"


def check_main() -> None:
    """The child of `import_problems`: load the function named by the spec on stdin; exit 1 saying why not."""
    try:
        load_function(PythonScorer.model_validate(json.loads(sys.stdin.read())))
    except BaseException as err:  # noqa: BLE001 - whatever the user's import does is the answer
        sys.exit(f"{type(err).__name__}: {err}")
    print(LOADED, end="")  # an import that exits the process itself (status 0 included) never gets here


def source_problems(scorers: list[Any]) -> list[str]:
    """What the operator can know without running the user's code (it never does: the code would run with the
    operator's service account): a path scorer carries its source, the source parses, and it defines the
    function at the top level."""
    problems = []
    for index, spec in enumerate(scorers):
        if spec.type != "python" or spec.module is not None:
            continue  # a module is in the workers' image, not the operator's: the scorer refuses it at start
        where = f"spec.scorers.{index}"
        if spec.source is None:
            problems.append(f"{where}.source: missing: the pods cannot read {spec.path!r} from your machine; put "
                            "the file's content in source (`rlfleet render` does), or name an installed module")
        elif (problem := _definition_problem(spec)) is not None:
            problems.append(f"{where}.source: {problem}")
    return problems


def _definition_problem(spec: PythonScorer) -> str | None:
    try:
        tree = ast.parse(spec.source, spec.path)
    except SyntaxError as err:
        return f"does not parse: {err.msg} (line {err.lineno})"
    except (ValueError, RecursionError, MemoryError) as err:
        return f"does not parse: {type(err).__name__}"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == spec.function:
            return None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == spec.function for t in targets):
            return None
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (alias.asname or alias.name) == spec.function for alias in node.names):
            return None
    return f"defines no {spec.function!r} at the top level{_fix(spec)}"


def _fix(spec: PythonScorer) -> str:
    return f": define `def {spec.function}(completion, answer, prompt, **fields)`, or set function to its name"
