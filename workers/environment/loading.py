"""The job's environment as a factory of one instance per episode, by `spec.roles.environment.type`."""

from __future__ import annotations

import importlib
from typing import Callable

from rlfleet.workers.environment.protocol import Environment

# Each type's factory, "module:function(spec) -> Callable[[], Environment]", imported when a worker starts.
FACTORIES = {
    "tools": "rlfleet.workers.environment.tools:tool_environment",
}


def load_environment(spec) -> Callable[[], Environment]:
    module, name = FACTORIES[spec.type].split(":")
    return getattr(importlib.import_module(module), name)(spec)
