"""Off-policy guidance (algorithm.guidance): a group that found no reward learns from a reference solution.

A prompt whose `groupSize` completions all scored 0 teaches nothing: every advantage is 0, and RL cannot reach an
answer the policy never samples (SmolLM2 writes a minus sign after "3 - 14 =" with probability about 1e-5). LUFFY
(arXiv 2504.14945) puts a reference solution into such a group. Here the example's worked solution (or its answer),
then the end-of-text token, takes the place of the group's last completion if the scorers reward it. It is one
unsampled turn that trains (kind GUIDE): the trainer takes the policy's own log-probs for its sampling ones (ratio 1),
which makes its loss term the advantage-weighted log-likelihood of the solution.

`auto` guides only while the policy rarely finds rewards itself (UnsolvedShare): on the peer bench, guiding helped
where groups rarely solve anything and hurt late on a task the model already scored on (BENCHMARKS.md).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

from rlfleet.workers.controller.ledger import PromptLedger
from rlfleet.workers.controller.rollouts import GUIDE, Group, Rollout, unsampled_turn
from rlfleet.workers.controller.stages import Stage
from rlfleet.workers.spec import RLJob


def scored_nothing(group: Group) -> bool:
    """Whether the group has completions and none of them scored above 0."""
    return bool(group.rollouts) and max(r.reward for r in group.rollouts) <= 0.0


def unsolved(groups: list[Group]) -> list[Group]:
    """The groups none of whose completions scored above 0."""
    return [g for g in groups if scored_nothing(g)]


def guide_for(group: Group, tokens: list[int]) -> Rollout:
    """The solution `tokens` as a finished completion in the place of the group's last one, not yet scored. Its
    context is that of the newest policy version in the group, so it never makes the group stale."""
    last = group.rollouts[-1]
    version = max((v for r in group.rollouts for v in r.versions), default=0)
    return dataclasses.replace(last, turns=[unsampled_turn(GUIDE, tokens, version)], finished=True, reward=0.0,
                               reward_model_score=None, scorer_errors=[])


class UnsolvedShare:
    """guidance auto's rule: guide a batch while at least three quarters of the newest `window` groups, its own
    included, scored nothing. The share is the policy's own (taken before any guide), so guiding stops once it finds
    rewards by itself, and starts again if it loses them. A window of several batches keeps one batch's luck from
    deciding. Three quarters, not half: on letter_counting, where guides hurt, about half the groups score nothing
    while the model learns; on family_relationships, where guides are all it learns from, nearly all do."""

    def __init__(self, window: int = 32):
        self.outcomes: collections.deque[bool] = collections.deque(maxlen=window)
        self.lock = threading.Lock()  # producers annotate their batches concurrently

    def guides(self, groups: list[Group]) -> bool:
        """Records whether each of `groups` with completions scored nothing, then says whether to guide them."""
        with self.lock:
            self.outcomes.extend(scored_nothing(g) for g in groups if g.rollouts)
            return 4 * sum(self.outcomes) >= 3 * len(self.outcomes) > 0


class Guidance(Stage):
    """After the stages that score: each group that scored nothing gets its example's solution (or answer) as its
    last completion, if it fits in maxNewTokens and those stages reward it (with guidance auto, only while
    UnsolvedShare says so)."""

    def __init__(self, job: RLJob, scoring: list[Stage], ledger: PromptLedger,
                 completion_ids: Callable[[str], list[int]]):
        self.limit = job.spec.generation.max_new_tokens
        self.scoring = scoring
        self.ledger = ledger
        self.completion_ids = completion_ids
        """A text as completion tokens, end-of-text included: how a solution is sent."""
        self.share = UnsolvedShare() if job.spec.algorithm.guidance == "auto" else None

    def annotate(self, index: int, groups: list[Group]) -> None:
        if self.share is not None and not self.share.guides(groups):
            return
        solutions = [(g, self.completion_ids(g.example.solution or g.example.answer)) for g in unsolved(groups)]
        targets = [(group, guide_for(group, ids)) for group, ids in solutions if len(ids) <= self.limit]
        if not targets:
            return
        guides = [Group(group.position, group.example, [guide]) for group, guide in targets]
        for stage in self.scoring:
            stage.annotate(index, guides)
        with self.ledger.lock:
            for group, guide in targets:
                if guide.reward > 0.0:
                    group.rollouts[-1] = guide

