"""A short `rlfleet bench peer`: the tiny model on one task, RLFleet and TRL's GRPOTrainer each for 45 seconds. It
checks that the bench produces both curves, their table and their picture; never a speed or an accuracy (the
comparison itself is BENCHMARKS.md's, on SmolLM2 and four tasks)."""

from __future__ import annotations

import json

import pytest
from runs import rlfleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Each side's wall time includes its start: RLFleet's tiny run took over 20 s to log its first step in a loaded suite.
SECONDS = 45


def test_a_short_peer_bench_draws_both_curves(tmp_path, model_cache):
    result = rlfleet("bench", "peer", "--model", "tiny", "--tasks", "arith99", "--seconds", str(SECONDS),
                     "--marks", "1", "--limit", "10", "--eval-every", "5", "--out", str(tmp_path), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    [found] = json.loads((tmp_path / "peer.json").read_text())
    ours, theirs = found["curves"]["RLFleet"], found["curves"]["TRL"]
    # RLFleet's evaluation before training, then at least one of trained weights; TRL's base and its one mark's.
    assert ours[0][0] == 0.0 and len(ours) >= 2 and all(0.0 <= t <= SECONDS for t, _ in ours)
    assert len(theirs) == 2 and theirs[0] == [0.0, found["base"]] and theirs[1][0] >= SECONDS
    assert all(0.0 <= value <= 1.0 for _, value in ours + theirs)
    assert found["samples"]["RLFleet"] > 0 and found["samples"]["TRL"] > 0
    assert "| RLFleet |" in result.stdout and "| TRL |" in result.stdout
    assert (tmp_path / "peer.png").read_bytes().startswith(b"\x89PNG")
    assert not list((tmp_path / "arith99-trl").glob("at-*")), "TRL's evaluated weights are left behind"
