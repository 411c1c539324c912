"""`rlfleet run` refuses every job of the corpus (tests/bad_jobs.py) before anything starts: it exits 1, names
the field path, prints no "running" line, creates no run directory and builds no model. Workers are spawned
only inside the run directory (their logs and working directory are there), so no run directory means no worker.

A cold start of the console script costs ~0.4 s of CPU, over a minute for the corpus on two busy cores. So one
Python process imports the CLI once and forks a child per file that runs the installed `rlfleet` script itself
(runpy, fresh sys.argv, its own stdout and stderr files, the interpreter's own handling of sys.exit); a few
files also go through a cold start, to show the two agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bad_jobs import files

pytestmark = pytest.mark.integration
RLFLEET = Path(sys.executable).with_name("rlfleet")
COLD = ["max-staleness-negative", "billion-laughs", "not-utf8"]

DRIVER = r"""
import gc, json, os, runpy, sys
import rlfleet.workers.cli, rlfleet.workers.local, rlfleet.workers.models  # what `run` imports, once

gc.freeze()  # the children's collections then skip (and do not copy) the parent's objects
script, cases = sys.argv[1], json.load(sys.stdin)
running, codes = {}, {}
for id_, job_file, out_dir, output in cases:
    if len(running) >= 4:  # each child mostly exits an interpreter; a few at once keep both cores busy
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    pid = os.fork()
    if pid == 0:
        for fd, suffix in ((1, ".out"), (2, ".err")):
            os.dup2(os.open(output + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [script, "run", job_file, "--out", out_dir]
        runpy.run_path(script, run_name="__main__")  # raises SystemExit up to the interpreter, like `rlfleet`
        os._exit(99)  # the script returned without exiting
    running[pid] = id_
while running:
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
json.dump(codes, sys.stdout)
"""


@pytest.fixture
def corpus(tmp_path):
    jobs, runs, cache = tmp_path / "jobs", tmp_path / "runs", tmp_path / "cache"
    for directory in (jobs, runs, cache):
        directory.mkdir()
    cases = {}
    for id_, content, path in files():
        job_file = jobs / f"{id_}.yaml"
        job_file.write_bytes(content if isinstance(content, bytes) else content.encode())
        cases[id_] = (job_file, path)
    env = os.environ | {"RLFLEET_CACHE": str(cache)}
    yield cases, runs, env
    assert list(runs.iterdir()) == [], "a refused job created a run directory"
    assert list(cache.iterdir()) == [], "a refused job built a model"


def problems(cases: dict, outcomes: dict[str, tuple[int, str, str]]) -> list[str]:
    wrong = []
    for id_, (code, out, err) in outcomes.items():
        job_file, path = cases[id_]
        if code != 1 or not err.startswith(f"rlfleet: {job_file}: invalid RLJob:\n") or f"\n  {path}: " not in err \
                or "Traceback" in err or out:
            wrong.append(f"{id_} (exit {code}, want {path!r}):\n{out}{err[:2000]}")
    return wrong


def test_rlfleet_run_refuses_every_bad_job_and_creates_nothing(corpus, tmp_path):
    cases, runs, env = corpus
    output = tmp_path / "output"
    output.mkdir()
    request = [(id_, str(job_file), str(runs / id_), str(output / id_)) for id_, (job_file, _) in cases.items()]
    driver = subprocess.run([sys.executable, "-c", DRIVER, str(RLFLEET)], input=json.dumps(request), env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert driver.returncode == 0, driver.stderr
    codes = json.loads(driver.stdout)
    assert set(codes) == set(cases)
    outcomes = {id_: (code, (output / f"{id_}.out").read_text(), (output / f"{id_}.err").read_text(errors="replace"))
                for id_, code in codes.items()}
    wrong = problems(cases, outcomes)
    assert not wrong, "\n".join(wrong)


def test_a_cold_rlfleet_run_refuses_the_same_way(corpus, tmp_path):
    cases, runs, env = corpus
    outcomes = {}
    for id_ in COLD:
        job_file, _ = cases[id_]
        done = subprocess.run([str(RLFLEET), "run", str(job_file), "--out", str(runs / id_)], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        outcomes[id_] = (done.returncode, done.stdout, done.stderr)
    wrong = problems(cases, outcomes)
    assert not wrong, "\n".join(wrong)
