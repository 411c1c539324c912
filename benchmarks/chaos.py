"""`rlfleet bench chaos`: a run under random faults, then proof that nothing was lost or mixed.

For `--minutes`, every few seconds one random worker of the run (generator, scorer or trainer rank) is
SIGKILLed, or SIGSTOPped and continued a few seconds later. A dead generator or scorer is restarted by
`rlfleet run`; a dead trainer ends the run, which is resumed with `rlfleet run --resume`. When the time
is up the run is stopped (SIGTERM) and resumed, without faults, to a last step a few steps past its
checkpoint. Then the run directory must show: the run completed; every step trained exactly once with
policy version = step; every prompt handed out appears exactly once in prompts.jsonl with a counted
outcome; and no generator ever received a weight version whose content differs from what the trainers
sent (the job runs with `weightSync.verify`, so every push is checked by content on arrival).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "tiny-local.yaml"
# Steps the faultless last leg trains past the last checkpoint.
TAIL_STEPS = 5
# The first step of a cold start (vLLM engines, a model built) on a loaded machine.
START_SECONDS = 600
CLI = [sys.executable, "-m", "rlfleet.workers.cli"]
KILL, STOP = "SIGKILL", "SIGSTOP"


ROLES = ("generator", "scorer", "trainer")


@dataclass
class Faults:
    """What was injected, by (role, kind), and the stopped processes to continue.

    Roles take turns, in a shuffled order each round, so even a short run hits every kind of executor;
    the worker within the role and the kind of fault are drawn at random.
    """

    rng: random.Random
    every: float
    counts: Counter = field(default_factory=Counter)
    stopped: dict[int, float] = field(default_factory=dict)
    """pid -> monotonic time to continue it."""
    turns: list[str] = field(default_factory=list)

    def inject(self, workers: dict[int, str]) -> str | None:
        """SIGKILL or SIGSTOP one random worker (pid -> role) of the next role in turn; the role, or None."""
        if not self.turns:
            self.turns = self.rng.sample(ROLES, len(ROLES))
        role = self.turns[0]
        candidates = [pid for pid, r in workers.items() if r == role and pid not in self.stopped]
        if not candidates:
            return None
        self.turns.pop(0)
        pid = self.rng.choice(candidates)
        kind = self.rng.choice((KILL, STOP))
        try:
            os.kill(pid, signal.SIGKILL if kind == KILL else signal.SIGSTOP)
        except ProcessLookupError:
            return None
        if kind == STOP:
            self.stopped[pid] = time.monotonic() + self.rng.uniform(1.0, 2 * self.every)
        self.counts[(workers[pid], kind)] += 1
        return workers[pid]

    def continue_due(self, everything: bool = False) -> None:
        for pid, due in list(self.stopped.items()):
            if everything or time.monotonic() >= due:
                _signal(pid, signal.SIGCONT)
                del self.stopped[pid]


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def workers_of(run_pid: int) -> dict[int, str]:
    """The run's worker processes (its direct children), pid -> role, from the environment the planner set."""
    try:
        children = Path(f"/proc/{run_pid}/task/{run_pid}/children").read_text().split()
    except FileNotFoundError:
        return {}
    found = {}
    for pid in map(int, children):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
        if "RLFLEET_ROLE" in env:
            found[pid] = env["RLFLEET_ROLE"]
    return found


def chaos_job(job_path: str, run_root: Path) -> Path:
    """The job, made to survive faults: two generators and scorers, frequent checkpoints, short deadlines,
    every push checked by content, restarts without end, and steps without end (the last leg sets them)."""
    from rlfleet.workers.spec import load_job

    job = load_job(job_path).to_dict()
    spec = job["spec"]
    for role in ("generator", "scorer"):
        spec["roles"][role]["replicas"] = max(2, spec["roles"][role]["replicas"])
    spec["algorithm"]["steps"] = 10**7
    spec["checkpoint"] = {"everySteps": 5, "keep": 2}
    spec["failurePolicy"] = {"maxRestarts": 1000}
    spec["generation"]["timeoutSeconds"] = 5.0
    spec["weightSync"] |= {"timeoutSeconds": 10.0, "verify": True}
    path = run_root / "chaos-job.json"
    path.write_text(json.dumps(job))
    return path


def last_checkpoint_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (what a resume starts from), 0 if none."""
    from rlfleet.workers.trainer.checkpoint import STATE_FILE, latest_checkpoint

    found = latest_checkpoint(run_dir / "checkpoints")
    return json.loads((found / STATE_FILE).read_text())["step"] if found else 0


def final_job(job_path: Path, run_dir: Path) -> tuple[Path, int]:
    """The job with `steps` a few past the last checkpoint: the faultless last leg ends there."""
    job = json.loads(job_path.read_text())
    steps = last_checkpoint_step(run_dir) + TAIL_STEPS
    job["spec"]["algorithm"]["steps"] = steps
    path = job_path.with_name("chaos-final.json")
    path.write_text(json.dumps(job))
    return path, steps


def start(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([*CLI, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def first_step(run: subprocess.Popen, run_dir: Path, log: Path) -> None:
    """Wait for the run's first step: the faults' time starts there, so a slow start (a loaded machine took a
    minute) does not eat it."""
    deadline = time.monotonic() + START_SECONDS
    while not (run_dir / "metrics.jsonl").exists():
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rlfleet run trained no step (see {log})")
        time.sleep(0.5)


def faulty_leg(job: Path, run_dir: Path, faults: Faults, seconds: float, log: Path) -> int:
    """Run under faults for `seconds`; returns how often the run had to be resumed after a trainer died."""
    run = start("run", str(job), "--out", str(run_dir), log=log)
    first_step(run, run_dir, log)
    resumes, deadline, next_fault = 0, time.monotonic() + seconds, time.monotonic() + faults.every
    while time.monotonic() < deadline:
        faults.continue_due()
        if run.poll() is not None:
            if run.returncode != 1:
                raise RuntimeError(f"rlfleet run exited {run.returncode} under chaos (see {log})")
            faults.continue_due(everything=True)
            resumes += 1
            run = start("run", "--resume", str(run_dir), log=log)
        elif time.monotonic() >= next_fault:
            faults.inject(workers_of(run.pid))
            next_fault = time.monotonic() + faults.rng.uniform(0.5, 1.5) * faults.every
        time.sleep(0.1)
    faults.continue_due(everything=True)
    run.send_signal(signal.SIGTERM)
    run.wait(120)
    return resumes


def check(run_dir: Path, steps: int) -> list[str]:
    """What the run directory shows went wrong (empty: nothing)."""
    problems = ledger_problems(run_dir, steps)
    verified, mixed = _pushes(run_dir)
    if mixed:
        problems.append(f"{mixed} weight pushes arrived with content other than what the trainers sent")
    if not verified:
        problems.append("no push was checked by content")
    return problems


def ledger_problems(run_dir: Path, steps: int) -> list[str]:
    """What metrics.jsonl and prompts.jsonl show went wrong: a step lost or trained twice, a prompt lost or
    handed out twice, an uncounted outcome (empty: nothing)."""
    from rlfleet.workers.controller.ledger import OUTCOMES

    problems = []
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if [r["step"] for r in records] != list(range(1, steps + 1)):
        problems.append("metrics.jsonl does not hold steps 1..N exactly once each: a step was lost or trained twice")
    if any(r["policy_version"] != r["step"] for r in records):
        problems.append("a step's policy version is not its step")
    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    positions = sorted(p["prompt"] for p in prompts)
    if positions != list(range(len(positions))):
        problems.append("prompts.jsonl does not hold every prompt handed out exactly once")
    if {p["outcome"] for p in prompts} - set(OUTCOMES):
        problems.append("prompts.jsonl holds an outcome that is not a counted one")
    if sum(p["samples_trained"] for p in prompts) != sum(r["samples_trained"] for r in records):
        problems.append("samples trained by prompts.jsonl and by metrics.jsonl differ")
    return problems


def _pushes(run_dir: Path) -> tuple[int, int]:
    """(pushes verified by content, pushes that differed) over every generator log."""
    from rlfleet.workers.sync.checksum import MIXED, VERIFIED

    verified = mixed = 0
    for log in (run_dir / "logs").glob("*-generator-*.log"):
        text = log.read_text(errors="replace")
        verified, mixed = verified + text.count(VERIFIED), mixed + text.count(MIXED)
    return verified, mixed


def markdown(faults: Faults, resumes: int, run_dir: Path, steps: int, minutes: float, problems: list[str]) -> str:
    from rlfleet.workers.controller.ledger import OUTCOMES

    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    outcomes = Counter(p["outcome"] for p in prompts)
    verified, mixed = _pushes(run_dir)
    lines = [f"Chaos for {minutes:g} min, a fault every ~{faults.every:g} s; {resumes} trainer deaths resumed; "
             f"{steps} steps in all.", "", "| role | SIGKILL | SIGSTOP |", "|---|---|---|"]
    for role in ROLES:
        lines.append(f"| {role} | {faults.counts[(role, KILL)]} | {faults.counts[(role, STOP)]} |")
    lines += ["", "| prompts handed out | " + " | ".join(OUTCOMES) + " |",
              "|---" * (len(OUTCOMES) + 1) + "|",
              f"| {len(prompts)} | " + " | ".join(str(outcomes[o]) for o in OUTCOMES) + " |", "",
              f"Pushes checked by content: {verified}, differing: {mixed}.",
              "Lost: nothing." if not problems else "PROBLEMS:\n- " + "\n- ".join(problems)]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(DEFAULT_JOB), help="RLJob YAML (default: the built-in tiny job)")
    parser.add_argument("--minutes", type=float, default=15.0, help="how long faults are injected")
    parser.add_argument("--every", type=float, default=5.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument("--keep", default=None, help="keep the run directory here (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-chaos-") as temp:
        root = Path(args.keep or temp)
        root.mkdir(parents=True, exist_ok=True)
        run_dir, log = root / "run", root / "rlfleet.log"
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: pick another --keep")
        job = chaos_job(args.job, root)
        faults = Faults(random.Random(args.seed), args.every)
        resumes = faulty_leg(job, run_dir, faults, args.minutes * 60, log)
        last, steps = final_job(job, run_dir)
        done = subprocess.run([*CLI, "run", "--resume", str(run_dir), str(last)], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True)
        problems = [] if done.returncode == 0 else [f"the last leg exited {done.returncode}: {done.stdout[-2000:]}"]
        problems += check(run_dir, steps)
        print(markdown(faults, resumes, run_dir, steps, args.minutes, problems))
    return 1 if problems else 0
