"""A sampling temperature that follows how alike the samples are (generation.adaptiveTemperature).

Once RL has made the policy nearly deterministic on a prompt, its group samples one completion groupSize times: the
rewards are equal, every advantage is 0, and the group teaches nothing (on letter_counting, past step 15, most steps'
groups were all right or all wrong: BENCHMARKS.md). SamplingTemperature raises the generators' temperature while
their samples are too alike, and lowers it again, never below generation.temperature, once they are not. `follows`
picks the measure: the entropy per sampled token, or the share of groups the policy solved in every sample. Groups
that all scored 0 are left out of that share: a hotter sample solves less, so counting them kept letter_counting at
maxTemperature from the second step on (BENCHMARKS.md, "A temperature that follows the groups").

The trainer's log pi stays at generation.temperature: the policy it learns is the job's, and a hotter sample is an
off-policy one, which the loss's importance ratio pi / mu weighs as it weighs a stale one (AIPO's truncation at
rho, PPO's clip). Its tokens that the policy finds unlikely count for less, the likely ones as before.
"""

from __future__ import annotations

import collections
import json
import math
import threading
from pathlib import Path

from rlfleet.workers.controller.rollouts import Rollout, group_rewards, sampled_entropy
from rlfleet.workers.controller.stages import Stage, StageRun
from rlfleet.workers.generator.config import Generation
from rlfleet.workers.plan import WorkerContext

# How far one step moves the temperature: by exp(GAIN x how far the signal is from its target, as a share), so a
# batch sampled at half the target entropy raises it by a quarter at most. Small, because each step's estimate is
# noisy and a change shows only in the batches sampled after it.
GAIN = 0.5
# follows solvedGroups: how many of the newest groups the share is taken over, so that one batch's luck (4 groups
# by default) does not decide.
WINDOW = 32
STATE_FILE = "temperature.jsonl"


def next_temperature(temperature: float, error: float, lowest: float, highest: float) -> float:
    """The temperature after a step whose samples, drawn at `temperature`, were `error` too alike (negative: too
    varied): the entropy's shortfall as a share of its target, or the share of solved groups above its own."""
    return min(highest, max(lowest, temperature * math.exp(GAIN * error)))


class SamplingTemperature(Stage):
    """The temperature every producer samples at (`temperature()`), moved after each step towards its target: the
    entropy per sampled token at `targetRatio` of the first step's, or the share of the newest groups solved in every
    sample at `solvedShare`. Saved with each checkpoint, so a resumed run goes on from it."""

    def __init__(self, generation: Generation, run_dir: str):
        self.lowest = generation.temperature
        self.settings = generation.adaptive_temperature
        self.current = self.lowest
        self.target: float | None = None
        """follows entropy: set from the first step's samples, which are drawn at generation.temperature."""
        self.solved: collections.deque[bool] = collections.deque(maxlen=WINDOW)
        """follows solvedGroups: whether each of the newest groups was solved in every sample alike."""
        self.path = Path(run_dir) / STATE_FILE
        self.lock = threading.Lock()  # producers read `current` while the loop moves it

    @classmethod
    def built(cls, ctx: WorkerContext, run: StageRun) -> SamplingTemperature:
        return cls(ctx.job.spec.generation, ctx.run_dir)

    def temperature(self) -> float:
        with self.lock:
            return self.current

    def start(self, step: int) -> None:
        saved = [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []
        state = next((s for s in reversed(saved) if s["step"] == step), None)
        if state:  # none at a fresh start: nothing is saved at step 0
            self.current, self.target = state["temperature"], state["target"]
            self.solved.extend(state.get("solved", []))  # none in a state saved before solvedGroups

    def shape(self, fresh: list[Rollout]) -> dict[str, float]:
        with self.lock:
            by_groups = self.settings.follows == "solvedGroups"
            error = self._solved_error(fresh) if by_groups else self._entropy_error(fresh)
            if error is not None:
                self.current = next_temperature(self.current, error, self.lowest, self.settings.max_temperature)
            if by_groups:
                return {"sampling_temperature": self.current, "solved_groups": self._solved_share() or 0.0}
            return {"sampling_temperature": self.current, "target_entropy": self.target or 0.0}

    def _entropy_error(self, fresh: list[Rollout]) -> float | None:
        entropy = sampled_entropy(fresh)
        if entropy is not None and self.target is None:
            self.target = self.settings.target_ratio * entropy
        return (self.target - entropy) / self.target if entropy is not None and self.target else None

    def _solved_error(self, fresh: list[Rollout]) -> float | None:
        self.solved.extend(len(rewards) == 1 and min(rewards) > 0 for rewards in group_rewards(fresh))
        share = self._solved_share()
        return None if share is None else share - self.settings.solved_share

    def _solved_share(self) -> float | None:
        return sum(self.solved) / len(self.solved) if self.solved else None

    def save(self, step: int) -> None:
        state = {"step": step, "temperature": self.current, "target": self.target, "solved": list(self.solved)}
        with self.lock, self.path.open("a") as out:
            out.write(json.dumps(state) + "\n")
