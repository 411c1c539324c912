"""`rlfleet eval` prints its result lines alone: the model loaders' logs (vLLM's ~50 lines on stdout, its processes',
transformers' progress bars, torch's warnings) are held back unless --verbose, and shown when it fails."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from bad_jobs import job

pytestmark = pytest.mark.integration
RLFLEET = Path(sys.executable).with_name("rlfleet")
RESULT = re.compile(r"accuracy [01]\.\d{3} \(\d/4 held-out prompts, greedy\)\n"
                    r"reward [01]\.\d{3} \(mean over 4 held-out prompts, greedy, scorer/math_answer [01]\.\d{3}\)\n")


def eval_job(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    spec = {"model": {"type": "tiny"}, "data": {"type": "arithmetic", "heldOut": 20},
            "roles": {"generator": {"engine": "vllm", "kvCacheMB": 64}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job(**spec)))
    return subprocess.run([str(RLFLEET), "eval", "job.yaml", "--limit", "4", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


def test_eval_prints_its_result_and_nothing_else(tmp_path, model_cache):
    done = eval_job(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert RESULT.fullmatch(done.stdout), done.stdout[-3000:]
    assert done.stderr == ""


def test_a_failing_eval_shows_what_was_held_back(tmp_path, model_cache):
    done = eval_job(tmp_path, "--model-dir", str(tmp_path / "no-model"))
    assert done.returncode == 1
    assert done.stdout == ""
    assert "Traceback" in done.stderr and "no-model" in done.stderr
