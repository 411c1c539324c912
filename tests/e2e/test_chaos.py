"""A short `rlfleet bench chaos`: random kills and stops of every kind of worker (the job runs every executor kind),
trainer deaths resumed, and nothing lost or mixed (the bench's own checks; BENCHMARKS.md has the 15-minute run)."""

from __future__ import annotations

import pytest
from runs import rlfleet

from rlfleet.benchmarks.chaos import ROLES

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_short_chaos_run_loses_nothing(tmp_path, model_cache):
    # Two minutes: a run ended by a trainer or critic fault takes about one to train again, and faults wait for it.
    result = rlfleet("bench", "chaos", "--minutes", "1.5", "--every", "1.5", "--seed", "7", "--keep", str(tmp_path),
                     timeout=1500)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Lost: nothing." in result.stdout
    faults = {cells[0]: int(cells[1]) + int(cells[2]) for line in result.stdout.splitlines()
              if (cells := [c.strip() for c in line.strip("|").split("|")])[0] in ROLES}
    assert set(faults) == set(ROLES) and all(faults.values()), f"some role was never hit: {faults}"
