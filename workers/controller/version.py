"""The policy version: one owner for the controller."""

from __future__ import annotations


class PolicyVersion:
    """The version of the trainer's policy: the number of steps it has trained (a checkpoint of step k holds version
    k, and step k, 0-based, trains batch k on version k). The loop moves it once a step; the receivers (what a push or a
    rejoin is labelled), the stages, the evaluation and the status read it here."""

    def __init__(self, trained_steps: int):
        self._value = trained_steps

    @property
    def value(self) -> int:
        return self._value

    def trained(self, step: int) -> int:
        """Step `step` (0-based) has trained: the policy is of version step + 1; returns it."""
        self._value = step + 1
        return self._value
