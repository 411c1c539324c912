"""The learning-rate schedule: warm-up, then constant or cosine down to minRatio at the last step."""

from __future__ import annotations

import math

import pytest

from rlfleet.workers.trainer.config import ConstantSchedule, CosineSchedule
from rlfleet.workers.trainer.schedule import lr_factor


def test_constant_after_a_linear_warm_up():
    schedule = ConstantSchedule(warmup_steps=3)
    assert [lr_factor(schedule, s, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(ConstantSchedule(), 0, 10) == 1.0


def test_cosine_runs_from_the_peak_to_min_ratio_at_the_last_step():
    schedule = CosineSchedule(warmup_steps=2, min_ratio=0.1)
    factors = [lr_factor(schedule, s, 12) for s in range(12)]
    assert factors[:2] == pytest.approx([1 / 3, 2 / 3])
    assert factors[2] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert factors[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    assert all(a >= b for a, b in zip(factors[2:], factors[3:])), "cosine must not rise after the warm-up"


def test_a_single_step_or_a_warm_up_longer_than_the_run_stays_finite():
    assert lr_factor(CosineSchedule(), 0, 1) == pytest.approx(1.0)
    assert lr_factor(CosineSchedule(warmup_steps=50), 9, 10) == pytest.approx(10 / 51)
