"""The schema and the planner import no torch, transformers or vLLM: the operator imports them. The controller's
loop imports no transformers or vLLM: a controller pod of its own (spec.roles.controller) starts without them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
HEAVY = ("torch", "transformers", "vllm")
PROBE = """
import json, sys
import {modules}
heavy = {heavy!r}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
print(json.dumps({{"heavy": loaded, "ours": sorted(m for m in sys.modules if m.startswith("rlfleet.workers."))}}))
"""


def _imported(modules: list[str], heavy: tuple[str, ...]) -> dict:
    probe = PROBE.format(modules=", ".join(modules), heavy=heavy)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(modules) <= set(found["ours"])
    return found


def test_spec_and_plan_import_no_heavy_module():
    found = _imported(["rlfleet.workers.spec", "rlfleet.workers.plan"], HEAVY)
    assert found["heavy"] == [], f"importing the schema pulled in {found['heavy'][:10]}"


def test_the_controllers_loop_imports_none_of_the_trainers_libraries():
    found = _imported(["rlfleet.workers.controller.loop"], HEAVY[1:])
    assert found["heavy"] == [], f"importing the controller pulled in {found['heavy'][:10]}"
