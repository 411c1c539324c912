"""The job's environment as a factory of one instance per episode, by `spec.roles.environment.type`."""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from rlfleet.workers.environment.protocol import Environment

# Each type's Environment class, "module:Class", built with its spec; imported when a worker starts.
CLASSES = {
    "tools": "rlfleet.workers.environment.tools:ToolUse",
}


def load_environment(spec) -> Callable[[], Environment]:
    module, name = CLASSES[spec.type].split(":")
    return functools.partial(getattr(importlib.import_module(module), name), spec)
