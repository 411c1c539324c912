"""`rlfleet bench chaos`: a run under random faults, then proof that nothing was lost or mixed.

The job runs every executor kind (generator, scorer, reward model, reference, critic, trainer, and the controller
as an executor of its own, a leader and a standby). For `--minutes`, every few seconds one random worker of the next
kind in turn is SIGKILLed, or SIGSTOPped and continued a few seconds later; of the controllers, always the leader
(its standby takes over from a dead one). A dead worker of any other kind is restarted by `rlfleet run`, the trainer
too (the next leader restores it from the checkpoint); a run that ends anyway (a job without controllers of its own
whose trainer died) is resumed with `rlfleet run --resume`, and no fault follows until the resumed run has
trained a step (so faults land during training, not during start-up). When the time is up the run is stopped
(SIGTERM) and resumed, without faults, to a last step a few steps past its checkpoint. Then the run directory
must show: the run completed; every step trained exactly once with policy version = step, and critic version
= step where a critic runs; no trained sample staler than maxStaleness; every prompt handed out appears exactly
once in prompts.jsonl with a counted outcome; and no generator ever received a weight version whose content
differs from what the trainers sent (the job runs with `weightSync.verify`, so every push is checked by content
on arrival).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.workers.executors import ROLES

DEFAULT_JOB = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "tiny-every-executor.yaml"
# Steps the faultless last leg trains past the last checkpoint.
TAIL_STEPS = 5
# The first step of a cold start (vLLM engines, a model built) on a loaded machine; also how long a resumed run
# may take to train a step before the bench calls it stuck.
START_SECONDS = 600
CLI = [sys.executable, "-m", "rlfleet.workers.cli"]
KILL, STOP = "SIGKILL", "SIGSTOP"


@dataclass
class Faults:
    """What was injected, by (role, kind) and when, and the stopped processes to continue.

    Roles take turns, in a shuffled order each round with the trainer last (its death pauses the faults until
    the run trains again), so even a short run hits every kind of executor; the worker within the role and the
    kind of fault are drawn at random.
    """

    rng: random.Random
    every: float
    roles: tuple[str, ...] = ROLES
    counts: Counter = field(default_factory=Counter)
    times: list[tuple[float, str]] = field(default_factory=list)
    """(Unix time, role) of each fault."""
    stopped: dict[int, float] = field(default_factory=dict)
    """pid -> monotonic time to continue it."""
    turns: list[str] = field(default_factory=list)

    def inject(self, workers: dict[int, str]) -> str | None:
        """SIGKILL or SIGSTOP one random worker (pid -> role) of the next role in turn; the role, or None."""
        if not self.turns:
            others = [role for role in self.roles if role != "trainer"]
            self.turns = self.rng.sample(others, len(others)) + ["trainer"]
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
        self.counts[(role, kind)] += 1
        self.times.append((time.time(), role))
        return role

    def continue_due(self, everything: bool = False) -> None:
        for pid, due in list(self.stopped.items()):
            if everything or time.monotonic() >= due:
                _signal(pid, signal.SIGCONT)
                del self.stopped[pid]


@dataclass
class Leg:
    """The faulty leg's course: trainer deaths resumed, and how long each resumed run took to train a step."""

    resumes: int = 0
    recoveries: list[float] = field(default_factory=list)
    """Seconds from a trainer death to the resumed run's first step."""
    ended: float = 0.0
    """Unix time the faults ended."""


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def targets(run_pid: int, run_dir: Path) -> dict[int, str]:
    """The run's workers that faults may hit: of the controllers, the leader only (a standby's loss tests nothing)."""
    leading = leader_pid(run_dir)
    return {pid: role for pid, role in workers_of(run_pid).items() if role != "control" or pid == leading}


def leader_pid(run_dir: Path) -> int | None:
    """The leading controller's process, as it wrote it into the lock file (None: none leads yet)."""
    from rlfleet.workers.controller.leadership import LOCK_FILE

    try:
        found = re.match(r"pid (\d+) ", (run_dir / LOCK_FILE).read_text())
    except FileNotFoundError:
        return None
    return int(found[1]) if found else None


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
    """The job, made to survive faults: two generators and scorers, a controller of its own with a standby, frequent
    checkpoints, short deadlines, every push checked by content, restarts without end, and steps without end (the
    last leg sets them)."""
    from rlfleet.workers.spec import load_job

    job = load_job(job_path).to_dict()
    spec = job["spec"]
    for role in ("generator", "scorer"):
        spec["roles"][role]["replicas"] = max(2, spec["roles"][role]["replicas"])
    spec["roles"]["controller"] = {"replicas": 2} | (spec["roles"].get("controller") or {})
    if spec["roles"].get("rewardModel"):
        spec["roles"]["rewardModel"]["path"] = str(reward_model(spec["roles"]["rewardModel"]["path"], run_root))
    spec["algorithm"]["steps"] = 10**7
    spec["checkpoint"] = {"everySteps": 5, "keep": 2}
    spec["failurePolicy"] = {"maxRestarts": 1000}
    spec["generation"]["timeoutSeconds"] = 5.0
    spec["weightSync"] |= {"timeoutSeconds": 10.0, "verify": True}
    path = run_root / "chaos-job.json"
    path.write_text(json.dumps(job))
    return path


def reward_model(path: str, run_root: Path) -> Path:
    """The job's reward model, absolute; a relative path is taken under the bench's directory, and the examples'
    toy reward model is made there when it is missing (as the every-executor example's comment says to)."""
    found = Path(path)
    if found.is_absolute():
        return found
    found = (run_root / found).resolve()
    if not found.exists():
        from rlfleet.workers.reward_model.toy import train_digit_preference

        train_digit_preference(found, "7")
    return found


def last_checkpoint_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (what a resume starts from), 0 if none."""
    from rlfleet.workers.trainer.checkpoint import CHECKPOINTS_DIR, STATE_FILE, latest_checkpoint

    found = latest_checkpoint(run_dir / CHECKPOINTS_DIR)
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


def step_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's whole lines (one being written is left for the next look)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def trained_since(run_dir: Path, since: float) -> bool:
    """Whether a step was trained after Unix time `since` (a resume cuts back metrics.jsonl, so its lines'
    times, not their count, tell)."""
    return any(record["time"] > since for record in step_records(run_dir))


def first_step(run: subprocess.Popen, run_dir: Path, log: Path) -> None:
    """Wait for the run's first step: the faults' time starts there, so a slow start (a loaded machine took a
    minute) does not eat it."""
    deadline = time.monotonic() + START_SECONDS
    while not step_records(run_dir):
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rlfleet run trained no step (see {log})")
        time.sleep(0.5)


def faulty_leg(job: Path, run_dir: Path, faults: Faults, seconds: float, log: Path) -> Leg:
    """Run under faults for `seconds`. After a trainer death the run is resumed, and the next fault waits until
    it has trained a step; one that trains none in START_SECONDS fails the bench."""
    run = start("run", str(job), "--out", str(run_dir), log=log)
    leg, died = Leg(), None
    try:
        first_step(run, run_dir, log)
        deadline, next_fault = time.monotonic() + seconds, time.monotonic() + faults.every
        while time.monotonic() < deadline:
            faults.continue_due()
            if run.poll() is not None:
                if run.returncode != 1:
                    raise RuntimeError(f"rlfleet run exited {run.returncode} under chaos (see {log})")
                faults.continue_due(everything=True)
                died = died or time.time()
                leg.resumes += 1
                run = start("run", "--resume", str(run_dir), log=log)
            elif died is not None:
                if trained_since(run_dir, died):
                    leg.recoveries.append(time.time() - died)
                    died, next_fault = None, time.monotonic() + faults.every
                elif time.time() - died > START_SECONDS:
                    raise RuntimeError(f"the run resumed after a trainer death trained no step in {START_SECONDS} s "
                                       f"(see {log})")
            elif time.monotonic() >= next_fault:
                faults.inject(targets(run.pid, run_dir))
                next_fault = time.monotonic() + faults.rng.uniform(0.5, 1.5) * faults.every
            time.sleep(0.1)
    finally:
        leg.ended = time.time()
        faults.continue_due(everything=True)
        run.send_signal(signal.SIGTERM)
        run.wait(120)
    return leg


def check(run_dir: Path, steps: int) -> list[str]:
    """What the run directory shows went wrong (empty: nothing)."""
    bound = json.loads((run_dir / "config.json").read_text())["spec"]["algorithm"]["maxStaleness"]
    problems = ledger_problems(run_dir, steps, bound)
    verified, mixed = _pushes(run_dir)
    if mixed:
        problems.append(f"{mixed} weight pushes arrived with content other than what the trainers sent")
    if not verified:
        problems.append("no push was checked by content")
    return problems


def ledger_problems(run_dir: Path, steps: int, max_staleness: int) -> list[str]:
    """What metrics.jsonl and prompts.jsonl show went wrong: a step lost or trained twice, a critic behind or
    ahead of the policy, a sample trained staler than the job allows, a prompt lost or handed out twice, an
    uncounted outcome (empty: nothing)."""
    from rlfleet.workers.controller.ledger import OUTCOMES

    problems = []
    records = step_records(run_dir)
    if [r["step"] for r in records] != list(range(1, steps + 1)):
        problems.append("metrics.jsonl does not hold steps 1..N exactly once each: a step was lost or trained twice")
    if any(r["policy_version"] != r["step"] for r in records):
        problems.append("a step's policy version is not its step")
    if off := critic_off(records):
        problems.append(f"the critic's version is not the step at steps {_some(off)}: it missed or repeated a batch")
    if stale := [r["step"] for r in records if r["max_trained_staleness"] > max_staleness]:
        problems.append(f"samples staler than maxStaleness ({max_staleness}) trained at steps {_some(stale)}")
    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    positions = sorted(p["prompt"] for p in prompts)
    if positions != list(range(len(positions))):
        problems.append("prompts.jsonl does not hold every prompt handed out exactly once")
    if {p["outcome"] for p in prompts} - set(OUTCOMES):
        problems.append("prompts.jsonl holds an outcome that is not a counted one")
    if sum(p["samples_trained"] for p in prompts) != sum(r["samples_trained"] for r in records):
        problems.append("samples trained by prompts.jsonl and by metrics.jsonl differ")
    return problems


def critic_off(records: list[dict]) -> list[int]:
    """Steps whose critic version is not one per batch it learned: the step, less the earlier steps that sent it
    nothing (none of their samples trained; their records have no critic_version)."""
    learned, off = 0, []
    for record in records:
        if "critic_version" in record:
            learned += 1
            if record["critic_version"] != learned:
                off.append(record["step"])
    return off


def _some(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")


def _pushes(run_dir: Path) -> tuple[int, int]:
    """(pushes verified by content, pushes that differed) over every generator log."""
    from rlfleet.workers.sync.checksum import MIXED, VERIFIED

    verified = mixed = 0
    for log in (run_dir / "logs").glob("*-generator-*.log"):
        text = log.read_text(errors="replace")
        verified, mixed = verified + text.count(VERIFIED), mixed + text.count(MIXED)
    return verified, mixed


def next_step_seconds(faults: Faults, step_times: list[float]) -> dict[str, list[float]]:
    """By role: seconds from each of its faults to the next step the run kept (a fault with none after it is left
    out)."""
    step_times = sorted(step_times)
    found: dict[str, list[float]] = {}
    for when, role in faults.times:
        index = bisect_right(step_times, when)
        if index < len(step_times):
            found.setdefault(role, []).append(step_times[index] - when)
    return found


def under_fault(faults: Faults, leg: Leg, step_times: list[float]) -> int:
    """Steps the run kept that trained between the first fault and the end of the faults."""
    first = min((when for when, _ in faults.times), default=leg.ended)
    return sum(first < when <= leg.ended for when in step_times)


def markdown(faults: Faults, leg: Leg, run_dir: Path, steps: int, minutes: float, problems: list[str]) -> str:
    from rlfleet.workers.controller.ledger import OUTCOMES

    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    outcomes = Counter(p["outcome"] for p in prompts)
    verified, mixed = _pushes(run_dir)
    records = step_records(run_dir)
    times = [r["time"] for r in records]
    waits = next_step_seconds(faults, times)
    # A step of dropped samples only counts as trained, with no loss: many of them are a fault the run raced past.
    empty = sum(1 for r in records if not r["samples_trained"])
    lines = [f"Chaos for {minutes:g} min, a fault every ~{faults.every:g} s; {steps} steps in all, "
             f"{under_fault(faults, leg, times)} of them trained under fault (after the first fault, before the "
             f"last), {empty} with no sample trained.", "",
             f"{leg.resumes} resumes of a run ended by a trainer death (or by a critic restarted behind the "
             f"policy); a resumed run's first step came {_spread(leg.recoveries)} s (median / max) after the end.",
             "",
             "| role | SIGKILL | SIGSTOP | next step after a fault, s (median / max) |", "|---|---|---|---|"]
    for role in faults.roles:
        lines.append(f"| {role} | {faults.counts[(role, KILL)]} | {faults.counts[(role, STOP)]} | "
                     f"{_spread(waits.get(role, []))} |")
    lines += ["", "| prompts handed out | " + " | ".join(OUTCOMES) + " |",
              "|---" * (len(OUTCOMES) + 1) + "|",
              f"| {len(prompts)} | " + " | ".join(str(outcomes[o]) for o in OUTCOMES) + " |", "",
              f"Pushes checked by content: {verified}, differing: {mixed}.",
              "Lost: nothing." if not problems else "PROBLEMS:\n- " + "\n- ".join(problems)]
    return "\n".join(lines)


def _spread(seconds: list[float]) -> str:
    return f"{statistics.median(seconds):.0f} / {max(seconds):.0f}" if seconds else "-"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet bench chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(DEFAULT_JOB),
                        help="RLJob YAML (default: the tiny job with every executor kind); a relative "
                             "rewardModel.path is under the bench's directory, the toy reward model made there "
                             "if missing")
    parser.add_argument("--minutes", type=float, default=15.0, help="how long faults are injected")
    parser.add_argument("--every", type=float, default=5.0, help="mean seconds between faults")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument("--keep", default=None, help="keep the run directory here (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from rlfleet.workers.plan import job_roles
    from rlfleet.workers.spec import load_job

    args = _parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-chaos-") as temp:
        root = Path(args.keep or temp).resolve()
        root.mkdir(parents=True, exist_ok=True)
        run_dir, log = root / "run", root / "rlfleet.log"
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: pick another --keep")
        job = chaos_job(args.job, root)
        faults = Faults(random.Random(args.seed), args.every, tuple(job_roles(load_job(str(job)))))
        try:
            leg = faulty_leg(job, run_dir, faults, args.minutes * 60, log)
        except RuntimeError as error:
            raise SystemExit(f"rlfleet bench chaos failed: {error}") from None
        last, steps = final_job(job, run_dir)
        done = subprocess.run([*CLI, "run", "--resume", str(run_dir), str(last)], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True)
        problems = [] if done.returncode == 0 else [f"the last leg exited {done.returncode}: {done.stdout[-2000:]}"]
        problems += check(run_dir, steps)
        print(markdown(faults, leg, run_dir, steps, args.minutes, problems))
    return 1 if problems else 0
