"""The learning rate of each step: linear warm-up, then constant or a cosine decay (trainer/config.py)."""

from __future__ import annotations

import math

from rlfleet.workers.trainer.config import ConstantSchedule, CosineSchedule


def lr_factor(schedule: ConstantSchedule | CosineSchedule, step: int, steps: int) -> float:
    """Multiplier of algorithm.learningRate at trainer step `step` (0-based) of `steps`.

    A pure function of the step, so a resumed run continues the schedule exactly: nothing to checkpoint.
    """
    if step < schedule.warmup_steps:
        return (step + 1) / (schedule.warmup_steps + 1)
    if schedule.type == "constant":
        return 1.0
    decay = max(1, steps - 1 - schedule.warmup_steps)
    progress = min(1.0, (step - schedule.warmup_steps) / decay)
    return schedule.min_ratio + (1 - schedule.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
