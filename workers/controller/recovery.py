"""A trainer that restarts under its leader (spec.roles.controller: the trainer is an executor of its own): the leader
restores it from the run's last checkpoint, trains again the steps learned since (their batches are kept until the
next checkpoint) and rejoins every sync group, whose trainer end died with it. Meanwhile the producers go on within the
staleness bound, and the rollouts already made are trained, not made again: no leader change, no worker restarted.

The leader's calls that need the trainer's policy go through `guard`; the trainer refuses them until restored
(trainer/server.py), so a restart is seen at the first of them, whichever it is.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, TypeVar

from rlfleet.workers.trainer.link import TrainerRestarted

log = logging.getLogger(__name__)
T = TypeVar("T")


class TrainerRecovery:
    def __init__(self, trainer: Any, checkpointed: int, keeps: bool = True):
        self.trainer = trainer
        self.checkpointed = checkpointed
        """The step of the run's latest checkpoint: what a restarted trainer restores."""
        self.keeps = keeps
        """Whether to keep the steps' samples: not for a trainer in the leader's own process, which never restarts
        without it."""
        self.kept: dict[int, Sequence[Any]] = {}
        """The samples of each step trained since that checkpoint."""
        self.returned: list[Callable[[], None]] = []
        """What rejoins the trainer once restored, in order (the generators' sync groups first)."""

    def train(self, samples: Sequence[Any], step: int) -> dict[str, float]:
        metrics = self.guard(lambda: self.trainer.train(samples, step))
        if self.keeps:
            self.kept[step] = samples
        return metrics

    def checkpoint(self, step: int, state: dict[str, Any]) -> None:
        self.guard(lambda: self.trainer.checkpoint(step, state))
        self.checkpointed = step
        self.kept = {s: samples for s, samples in self.kept.items() if s >= step}

    def guard(self, call: Callable[[], T], again: bool = True) -> T | None:
        """`call()`; if the trainer restarted, restore it first, then call again (None without `again`: for a call
        whose work the restore redoes, a push)."""
        while True:
            try:
                return call()
            except TrainerRestarted as restarted:
                self._recover(restarted)
                if not again:
                    return None

    def _recover(self, why: TrainerRestarted) -> None:
        """Until the trainer holds the policy again and every group is rejoined: a trainer that restarts again
        meanwhile is restored again."""
        while True:
            log.warning("the trainer restarted (%s): restoring it from step %d and training again steps %s", why,
                        self.checkpointed, sorted(self.kept) or "none")
            try:
                self._restore()
                for rejoin in self.returned:
                    rejoin()
            except TrainerRestarted as again:
                why = again
                continue
            log.info("the trainer is restored, and back in every sync group")
            return

    def _restore(self) -> None:
        restored = self.trainer.resume()["step"]
        if restored < self.checkpointed:
            raise RuntimeError(f"the trainer restored step {restored}, older than the run's latest checkpoint "
                               f"({self.checkpointed}): the steps between are not kept to train again")
        for step in sorted(s for s in self.kept if s >= restored):
            self.trainer.train(self.kept[step], step)
