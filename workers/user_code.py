"""The job's own Python code (a python scorer's function, a python environment's class): named by a file (`path`,
whose content travels in the job as `source`) or an installed module (`module`), loaded where it runs, and the
checks that refuse code that cannot load before any worker starts. Torch-free: UserCode is part of the RLJob schema.

Where the job runs (`rlfleet validate`, `run`) the code is imported in a child process; where it would run with
rights the job does not have (the operator, `rlfleet render`) it is only parsed, never run.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import Field, field_validator, model_validator

from rlfleet.workers.strict import Strict

# The code travels inside the job (its ConfigMap on a cluster, which Kubernetes caps at 1 MiB with the rest).
MAX_SOURCE_BYTES = 256 * 1024
MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
# Importing the user's code to check it: a module that takes longer at import would stall every worker start. Not
# less: the libraries such code imports are heavy (openenv's server interfaces alone take 6 s on two idle cores, and
# took over 30 on a busy CI machine).
CHECK_SECONDS = 120.0
# What the check's child prints once the code loaded.
LOADED = "rlfleet: loaded"


class UserCode(Strict):
    """Where the code is: a file (`path`) or an installed module (`module`), exactly one."""

    kind: ClassVar[str]
    """What the code is for ("reward", "environment"): part of the module name its file is executed as."""
    checker: ClassVar[str]
    """The module whose `check_main` loads this kind of code in `import_problem`'s child (with `check_child`)."""

    path: str | None = Field(None, min_length=1, max_length=4096)
    """A .py file, relative to where rlfleet runs; the CLI copies its content into `source`."""
    module: str | None = Field(None, max_length=256, pattern=MODULE_PATTERN)
    """Instead of path: a module installed in the image (`my_pkg.rewards`)."""
    source: str | None = None
    """The file's content (at most 256 KiB). `rlfleet validate`, `run` and `render` fill it from `path`; for
    `kubectl apply` write it here yourself (`path` then only names it)."""

    def attribute(self) -> str:
        """The name the code defines at its top level (the function, the class)."""
        raise NotImplementedError

    def fix(self) -> str:
        """How to define it, for the refusal of code that does not."""
        raise NotImplementedError

    @field_validator("source")
    @classmethod
    def _source_fits(cls, value: str | None) -> str | None:
        if value is not None and len(value.encode()) > MAX_SOURCE_BYTES:
            raise ValueError(f"{len(value.encode())} bytes: at most {MAX_SOURCE_BYTES} (it travels in the job's "
                             "ConfigMap): install larger code in the image and name it by `module`")
        return value

    @model_validator(mode="after")
    def _one_place(self) -> UserCode:
        if (self.path is None) == (self.module is None):
            raise ValueError("give exactly one of path (a .py file) and module (an installed module)")
        if self.source is not None and self.path is None:
            raise ValueError("source is the content of the file at path: give path with it, not module")
        return self


def load_attribute(spec: UserCode) -> Any:
    """What the spec names, imported from its source, its file or its module."""
    value = load_namespace(spec).get(spec.attribute())
    if value is None:
        raise AttributeError(f"{spec.module or spec.path} defines no {spec.attribute()!r}: {spec.fix()}")
    return value


def load_namespace(spec: UserCode) -> dict[str, Any]:
    """The top level of the spec's code: its source, its file or its module, imported (executed again each call)."""
    if spec.module is not None:
        return vars(importlib.import_module(spec.module))
    source = spec.source if spec.source is not None else Path(spec.path).read_text(encoding="utf-8")
    return _executed(source, spec.path, spec.kind)


def _executed(source: str, path: str, kind: str) -> dict[str, Any]:
    # A module object, registered, so that dataclasses and pickling inside the user's code find their module.
    name = f"rlfleet_{kind}_{Path(path).stem}"
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102 - the job's own code, by design
    return module.__dict__


def with_source(spec: UserCode, where: str) -> tuple[UserCode, str | None]:
    """The spec with its `path`'s content in `source` (read from where rlfleet runs), or a problem line naming the
    field when the file cannot be read or is too large. A spec that needs no reading comes back as it is."""
    if spec.path is None or spec.source is not None:
        return spec, None
    try:
        data = Path(spec.path).read_bytes()
        if len(data) > MAX_SOURCE_BYTES:
            raise ValueError(f"{len(data)} bytes: at most {MAX_SOURCE_BYTES} (it travels in the job's "
                             "ConfigMap); install larger code in the image and name it by `module`")
        return spec.model_copy(update={"source": data.decode("utf-8")}), None
    except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
        return spec, (f"{where}.path {spec.path!r}: {getattr(err, 'strerror', None) or err}"
                      " (a relative path is taken from where rlfleet runs)")


def import_problem(spec: UserCode, where: str) -> str | None:
    """A problem line when the code does not load, found by importing it in a child process (the user's code may
    hang, exit or crash at import), where rlfleet runs, which is where its workers run."""
    # -P: the current directory is not on the path, as it is not for the workers (they run in the run directory).
    command = [sys.executable, "-P", "-c", f"from {spec.checker} import check_main; check_main()"]
    field = f"{where}.{'module' if spec.module else 'path'}"
    try:
        done = subprocess.run(command, input=spec.model_dump_json(), capture_output=True, text=True,
                              timeout=CHECK_SECONDS)
    except subprocess.TimeoutExpired:
        return f"{field}: importing it took over {CHECK_SECONDS:.0f} s"
    if done.returncode == 0 and done.stdout.endswith(LOADED):
        return None
    lines = done.stderr.strip().splitlines()
    return f"{field}: {lines[-1] if lines else f'the import ended the process (status {done.returncode})'}"


def check_child(load: Callable[[str], Any]) -> None:
    """The child of `import_problem`: `load` the spec on stdin (JSON); exit 1 saying why it does not load."""
    try:
        load(sys.stdin.read())
    except BaseException as err:  # noqa: BLE001 - whatever the user's import does is the answer
        sys.exit(f"{type(err).__name__}: {err}")
    print(LOADED, end="")  # an import that exits the process itself (status 0 included) never gets here


def source_problem(spec: UserCode, where: str) -> str | None:
    """What can be known without running the user's code: a path spec carries its source, the source parses, and
    it defines the name at the top level. A module is in the workers' image: its worker refuses it at start."""
    if spec.module is not None:
        return None
    if spec.source is None:
        return (f"{where}.source: missing: the pods cannot read {spec.path!r} from your machine; put the file's "
                "content in source (`rlfleet render` does), or name an installed module")
    problem = _definition_problem(spec)
    return f"{where}.source: {problem}" if problem else None


def _definition_problem(spec: UserCode) -> str | None:
    try:
        tree = ast.parse(spec.source, spec.path)
    except SyntaxError as err:
        return f"does not parse: {err.msg} (line {err.lineno})"
    except (ValueError, RecursionError, MemoryError) as err:
        return f"does not parse: {type(err).__name__}"
    name = spec.attribute()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return None
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (alias.asname or alias.name) == name for alias in node.names):
            return None
    return f"defines no {name!r} at the top level: {spec.fix()}"
