"""Reward functions of the own-task example (docs/rewards.md): one with named components, one that raises on
some completions, one that hangs on some prompts. Each failed call scores 0 and is counted; the run goes on."""

import re
import time


def score(completion, answer, prompt, level, **fields):
    """Named components: their sum is this scorer's score, and each one's mean is a metric (reward/score/<name>)."""
    numbers = re.findall(r"-?\d+", completion)
    correct = float(bool(numbers) and numbers[0] == answer)
    # The row's own fields arrive as keyword arguments: carries are worth more.
    bonus = 0.5 * correct if level == "carry" else 0.0
    return {"correct": correct, "carry_bonus": bonus, "length": -0.01 * len(completion)}


def strict(completion, answer, prompt, **fields):
    """Raises on a completion without a number (AttributeError on None): counted as `raised`, scored 0."""
    return float(int(re.search(r"-?\d+", completion).group()) == int(answer))


def slow(completion, answer, prompt, operands, **fields):
    """Hangs on every prompt with a 9 among its operands: killed at timeoutSeconds, counted as `timeout`."""
    if 9 in operands:
        time.sleep(3600)
    return 1.0 if completion.strip() else 0.0
