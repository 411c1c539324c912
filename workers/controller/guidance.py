"""Off-policy guidance (algorithm.guidance: answer): a group that found no reward learns from a reference solution.

A prompt whose `groupSize` completions all scored 0 teaches nothing: every advantage is 0, and RL cannot reach an
answer the policy never samples (SmolLM2 writes a minus sign after "3 - 14 =" with probability about 1e-5). LUFFY
(arXiv 2504.14945) puts a reference solution into such a group. Here the example's worked solution (or its answer),
then the end-of-text token, takes the place of the group's last completion if the scorers reward it. It is one
unsampled turn that trains (kind GUIDE): the trainer takes the policy's own log-probs for its sampling ones (ratio 1),
which makes its loss term the advantage-weighted log-likelihood of the solution.
"""

from __future__ import annotations

import dataclasses

from rlfleet.workers.controller.rollouts import GUIDE, Group, Rollout, unsampled_turn


def unsolved(groups: list[Group]) -> list[Group]:
    """The groups none of whose completions scored above 0."""
    return [g for g in groups if g.rollouts and max(r.reward for r in g.rollouts) <= 0.0]


def guide_for(group: Group, tokens: list[int]) -> Rollout:
    """The solution `tokens` as a finished completion in the place of the group's last one, not yet scored. Its
    context is that of the newest policy version in the group, so it never makes the group stale."""
    last = group.rollouts[-1]
    version = max((v for r in group.rollouts for v in r.versions), default=0)
    return dataclasses.replace(last, turns=[unsampled_turn(GUIDE, tokens, version)], finished=True, reward=0.0,
                               reward_model_score=None, scorer_errors=[])
