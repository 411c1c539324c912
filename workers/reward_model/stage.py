"""The reward model as the controller uses it: after the rule scorers, each completion's reward gains the model's
score times its weight (spec.roles.rewardModel), from any replica of its Scorer service."""

from __future__ import annotations

from rlfleet.workers.controller.rollouts import Group
from rlfleet.workers.scorer.stage import ScoreStage
from rlfleet.workers.spec import RLJob

# A reward-model call answers within its timeout per item (the server's own budget); this covers the transfer.
REWARD_MODEL_MARGIN_SECONDS = 30.0


class RewardModelScoring(ScoreStage):
    role = "reward"

    def annotate(self, index: int, groups: list[Group]) -> None:
        """Add the model's weighted score to each rollout's reward (the rule scorers set it), and its errors."""
        weight = self.job.spec.roles.reward_model.weight
        for rollout, score in self.scored("reward model", index, groups, lambda n: reward_model_deadline(self.job, n)):
            rollout.reward_model_score = score.reward
            rollout.reward += weight * score.reward
            rollout.scorer_errors += list(score.errors)


def reward_model_deadline(job: RLJob, items: int) -> float:
    """Deadline of one Score call to the reward model: it answers within its own timeout per item."""
    return REWARD_MODEL_MARGIN_SECONDS + items * job.spec.roles.reward_model.timeout_seconds
