"""Evaluation in the loop (`spec.evaluation`). Torch-free: part of the RLJob schema."""

from __future__ import annotations

from pydantic import Field

from rlfleet.workers.strict import Strict


class Evaluation(Strict):
    every_steps: int = Field(0, ge=0, le=10**7)
    """Score the held-out prompts greedily through a generator every this many trainer steps and after the last
    (0: never). Training goes on meanwhile; the accuracy goes to metrics.jsonl and Prometheus, and the weights
    that scored best are kept in checkpoints/best beside the latest checkpoints."""
    limit: int = Field(200, ge=1, le=100000)
    """Held-out prompts scored each time (the first ones of the task's held-out set)."""
