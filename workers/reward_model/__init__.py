"""The reward-model executor: a learned reward (a sequence-classification model) served as a batched scorer
(spec.roles.rewardModel)."""
