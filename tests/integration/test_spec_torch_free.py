"""The schema and the planner import no torch, transformers or vLLM: the operator imports them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
HEAVY = ("torch", "transformers", "vllm")
PROBE = f"""
import json, sys
import rlfleet.workers.spec, rlfleet.workers.plan
heavy = {HEAVY!r}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
print(json.dumps({{"heavy": loaded, "ours": sorted(m for m in sys.modules if m.startswith("rlfleet.workers."))}}))
"""


def test_spec_and_plan_import_no_heavy_module():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"rlfleet.workers.spec", "rlfleet.workers.plan"} <= set(found["ours"])
    assert found["heavy"] == [], f"importing the schema pulled in {found['heavy'][:10]}"
