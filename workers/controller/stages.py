"""Stages: what runs on each batch between generation and training (scores, guidance, reference log-probs, critic
values, ...), and their hooks in the controller's loop.

A producer thread runs every stage's `annotate` on each finished batch, in order; the loop runs every stage's hooks,
in the same order, naming none. The order comes from the job: the stages that score first, guidance
(algorithm.guidance) after them, then the other executors' stages in the executor table's order. An executor kind
names its stage in workers/executors.py ("module:Class"); the class lives in its package.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from rlfleet.workers.controller.ledger import PromptLedger
from rlfleet.workers.controller.rollouts import Group, Rollout
from rlfleet.workers.controller.version import PolicyVersion
from rlfleet.workers.executors import BY_ROLE
from rlfleet.workers.plan import WorkerContext, job_roles
from rlfleet.workers.spec import guided


@dataclass
class StageRun:
    """What the controller hands a stage it builds, besides the worker's context."""

    trainer: Any
    policy: PolicyVersion
    decode: Callable[[list[int]], str]
    """Completion tokens as text."""
    prompt_budget: int = 0
    """The longest prompt the generators serve with room for a whole completion."""


class Stage:
    """A stage's hooks; each does nothing unless the stage needs it."""

    scores = False
    """Whether it sets (or adds to) each rollout's reward: guidance re-scores its guides through these stages."""
    drives_turns = False
    """Whether the producers hand it every turn the policy finishes (the environment's: environment/stage.py)."""

    @classmethod
    def built(cls, ctx: WorkerContext, run: StageRun) -> Stage:
        """The stage of a job that runs its executor."""
        return cls(ctx)

    def annotate(self, index: int, groups: list[Group]) -> None:
        """Batch `index`'s finished groups (a producer thread; any number at once)."""

    def start(self, step: int) -> None:
        """Before the first step of this run (fresh at 0, or resumed)."""

    def tend(self) -> None:
        """While the loop waits for a batch: look after replicas that came back."""

    def shape(self, fresh: list[Rollout]) -> dict[str, float]:
        """The step's fresh rollouts before their advantages; returns metrics."""
        return {}

    def learn(self, fresh: list[Rollout], step: int) -> None:
        """The step's fresh rollouts, advantages set, as the policy starts training on them."""

    def after_train(self) -> dict[str, float]:
        """After the policy trained on the step: its metrics."""
        return {}

    def after_step(self, version: int) -> None:
        """The policy of `version` is being published to the generators."""

    def trainer_returned(self) -> None:
        """The trainer restarted and was restored to the policy (controller/recovery.py): rejoin the sync groups of
        the replicas it pushes to."""

    def save(self, step: int) -> None:
        """Checkpoint step `step` (before the trainer's: its checkpoint is the promise that the stage's exists)."""

    def finish(self) -> None:
        """The run's last step is done: wait for what is under way."""

    def close(self) -> None:
        """The run ends, however it ends."""


def stage_class(path: str) -> type[Stage]:
    """The class an executor kind names as "module:Class"."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def job_stages(ctx: WorkerContext, run: StageRun, ledger: PromptLedger,
               completion_ids: Callable[[str], list[int]]) -> list[Stage]:
    """The job's stages, in the order every batch goes through them."""
    from rlfleet.workers.controller.guidance import Guidance  # Stages: imported here, after this module
    from rlfleet.workers.controller.temperature import SamplingTemperature

    built = [stage_class(BY_ROLE[role].stage).built(ctx, run) for role in job_roles(ctx.job) if BY_ROLE[role].stage]
    stages = [stage for stage in built if stage.scores]
    if guided(ctx.job.spec):
        stages.append(Guidance(ctx.job, list(stages), ledger, completion_ids))
    stages += [stage for stage in built if not stage.scores]
    if ctx.job.spec.generation.adaptive_temperature is not None:
        stages.append(SamplingTemperature.built(ctx, run))
    return stages
