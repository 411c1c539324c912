"""A sampling temperature that follows the entropy (generation.adaptiveTemperature).

Once RL has made the policy nearly deterministic on a prompt, its group samples one completion groupSize times: the
rewards are equal, every advantage is 0, and the group teaches nothing (on letter_counting, past step 15, most steps'
groups were all right or all wrong: BENCHMARKS.md). EntropyTemperature raises the generators' temperature while the
entropy of what they sample is below a target, and lowers it again, never below generation.temperature, once it is
above. Measured on letter_counting, the groups that teach nothing grew while the entropy per token did not fall, so
there it never moves (BENCHMARKS.md, "A temperature that follows the entropy"): off by default.

The trainer's log pi stays at generation.temperature: the policy it learns is the job's, and a hotter sample is an
off-policy one, which the loss's importance ratio pi / mu weighs as it weighs a stale one (AIPO's truncation at
rho, PPO's clip). Its tokens that the policy finds unlikely count for less, the likely ones as before.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

from rlfleet.workers.controller.rollouts import Rollout, sampled_entropy
from rlfleet.workers.controller.stages import Stage, StageRun
from rlfleet.workers.generator.config import Generation
from rlfleet.workers.plan import WorkerContext

# How far one step moves the temperature: by exp(GAIN x the entropy's shortfall as a share of the target), so a
# batch sampled at half the target entropy raises it by a quarter at most. Small, because each step's estimate is
# noisy and a change shows only in the batches sampled after it.
GAIN = 0.5
STATE_FILE = "temperature.jsonl"


def next_temperature(temperature: float, entropy: float, target: float, lowest: float, highest: float) -> float:
    """The temperature after a step whose samples, drawn at `temperature`, had `entropy` per token."""
    moved = temperature * math.exp(GAIN * (target - entropy) / target)
    return min(highest, max(lowest, moved))


class EntropyTemperature(Stage):
    """Holds the entropy per token of the sampled tokens at `targetRatio` of the first step's, by the temperature
    every producer samples at (`current`); saved with each checkpoint, so a resumed run goes on from it."""

    def __init__(self, generation: Generation, run_dir: str):
        self.lowest = generation.temperature
        self.settings = generation.adaptive_temperature
        self.current = self.lowest
        self.target: float | None = None
        """Set from the first step's samples, which are drawn at generation.temperature."""
        self.path = Path(run_dir) / STATE_FILE
        self.lock = threading.Lock()  # producers read `current` while the loop moves it

    @classmethod
    def built(cls, ctx: WorkerContext, run: StageRun) -> EntropyTemperature:
        return cls(ctx.job.spec.generation, ctx.run_dir)

    def temperature(self) -> float:
        with self.lock:
            return self.current

    def start(self, step: int) -> None:
        saved = [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []
        state = next((s for s in reversed(saved) if s["step"] == step), None)
        if state:  # none at a fresh start: nothing is saved at step 0
            self.current, self.target = state["temperature"], state["target"]

    def shape(self, fresh: list[Rollout]) -> dict[str, float]:
        entropy = sampled_entropy(fresh)
        with self.lock:
            if entropy is not None and self.target is None:
                self.target = self.settings.target_ratio * entropy
            if entropy is not None and self.target:
                self.current = next_temperature(self.current, entropy, self.target, self.lowest,
                                                self.settings.max_temperature)
            return {"sampling_temperature": self.current, "target_entropy": self.target or 0.0}

    def save(self, step: int) -> None:
        with self.lock, self.path.open("a") as out:
            out.write(json.dumps({"step": step, "temperature": self.current, "target": self.target}) + "\n")
