"""The chaos bench's pacing, against a stand-in for `rlfleet run` whose trainer dies once: no fault lands while the
resumed run has not trained a step yet, and a resumed run that never trains fails the bench instead of stalling it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rlfleet.benchmarks import chaos
from rlfleet.benchmarks.chaos import Faults, faulty_leg, step_records

pytestmark = pytest.mark.integration

# `run JOB --out DIR`: a step, then its trainer dies (exit 1), noting when. `run --resume DIR`: a start-up of
# `resume_seconds` (or none that ends, when negative), then a step; it lives until stopped.
FAKE_RUN = """
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
resume = "--resume" in args
out = Path(args[args.index("--resume" if resume else "--out") + 1])
out.mkdir(exist_ok=True)
start_up = {resume_seconds}
if resume:
    time.sleep(start_up if start_up >= 0 else 3600)
with open(out / "metrics.jsonl", "a") as handle:
    handle.write(json.dumps({{"step": 1, "time": time.time()}}) + "\\n")
if not resume:
    time.sleep(0.3)
    (out / "died").write_text(str(time.time()))
    sys.exit(1)
time.sleep(3600)
"""


class Recorded(Faults):
    """Faults that only note when they would have been injected."""

    def inject(self, workers):
        self.times.append((time.time(), "scorer"))
        return "scorer"


def _leg(tmp_path: Path, monkeypatch, resume_seconds: float, seconds: float):
    script = tmp_path / "fake_rlfleet.py"
    script.write_text(FAKE_RUN.format(resume_seconds=resume_seconds))
    monkeypatch.setattr(chaos, "CLI", [sys.executable, str(script)])
    faults = Recorded(chaos.random.Random(0), every=0.05)
    leg = faulty_leg(tmp_path / "job.json", tmp_path / "run", faults, seconds, tmp_path / "run.log")
    return faults, leg


def test_after_a_trainer_death_faults_wait_for_a_step_of_the_resumed_run(tmp_path, monkeypatch):
    faults, leg = _leg(tmp_path, monkeypatch, resume_seconds=1.5, seconds=4.0)
    died = float((tmp_path / "run" / "died").read_text())
    resumed_step = step_records(tmp_path / "run")[-1]["time"]
    during = [when for when, _ in faults.times if died < when < resumed_step]
    assert not during, f"{len(during)} faults while the resumed run had trained nothing"
    assert any(when > resumed_step for when, _ in faults.times), "faults never came back after the recovery"
    assert leg.resumes == 1 and len(leg.recoveries) == 1


def test_a_resumed_run_that_never_trains_fails_the_bench(tmp_path, monkeypatch):
    monkeypatch.setattr(chaos, "START_SECONDS", 1.0)
    with pytest.raises(RuntimeError, match="trained no step in 1.0 s"):
        _leg(tmp_path, monkeypatch, resume_seconds=-1, seconds=60.0)
