"""Rollouts and the buffer between the generators and the trainer."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.workers.rl.advantages import advantages, gae, whiten
from rlfleet.workers.rl.config import Gae, KlPenalty
from rlfleet.workers.rl.kl import kl_penalties
from rlfleet.workers.trainer.sample import Sample


# What wrote a turn's tokens: the policy sampled them, a guide's worked solution (algorithm.guidance, trained as if
# sampled, with ratio 1), or an environment's observation (context only, never trained).
SAMPLED, GUIDE, OBSERVATION = "sampled", "guide", "observation"
TURN_KINDS = (SAMPLED, GUIDE, OBSERVATION)


@dataclass(frozen=True)
class Turn:
    """Consecutive completion tokens of one kind."""

    kind: str
    token_ids: tuple[int, ...]
    versions: tuple[int, ...]
    """The policy version of each token: the one that sampled it, or (unsampled) the newest of its context."""
    logprobs: tuple[float, ...] = ()
    """log mu of each token, under the temperature and top-p it was sampled with; sampled turns only."""

    def __post_init__(self):
        if self.kind not in TURN_KINDS:
            raise ValueError(f"turn kind {self.kind!r}: one of {', '.join(TURN_KINDS)}")
        if len(self.versions) != len(self.token_ids):
            raise ValueError(f"turn of {len(self.token_ids)} tokens has {len(self.versions)} versions")
        if len(self.logprobs) != (len(self.token_ids) if self.sampled else 0):
            raise ValueError(f"{self.kind} turn of {len(self.token_ids)} tokens has {len(self.logprobs)} logprobs "
                             f"(a sampled turn has one a token, an unsampled one none)")

    @property
    def sampled(self) -> bool:
        return self.kind == SAMPLED

    @property
    def trained(self) -> bool:
        return self.kind != OBSERVATION


def sampled_turn(token_ids: list[int], logprobs: list[float], versions: list[int]) -> Turn:
    return Turn(SAMPLED, tuple(token_ids), tuple(versions), tuple(logprobs))


def unsampled_turn(kind: str, token_ids: list[int], version: int) -> Turn:
    """Tokens the policy did not sample, appended to a context of policy `version`."""
    return Turn(kind, tuple(token_ids), (version,) * len(token_ids))


@dataclass
class Rollout:
    """One episode: a prompt and the turns of its completion, with everything the trainer and the metrics need."""

    sample_id: str
    prompt: int
    """Data position of the prompt it answers (the prompt ledger's key)."""
    prompt_ids: list[int]
    answer: str
    turns: list[Turn] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)
    """The reference executor's log pi_ref of each completion token, once finished (jobs with a reference)."""
    finished: bool = False
    reward: float = 0.0
    """What the scorers gave: the rule scorers' sum plus rewardModel.weight x the reward model's score."""
    reward_model_score: float | None = None
    """The reward model's own score, unweighted (jobs with a reward model)."""
    kl_penalty: float = 0.0
    """Subtracted from the reward before the advantages (algorithm.kl.use: reward)."""
    advantage: float = 0.0
    """One per completion; with GAE the mean of its tokens' (what the metrics show)."""
    token_advantages: list[float] = field(default_factory=list)
    """GAE: one advantage per completion token (algorithm.advantage gae); empty otherwise."""
    values: list[float] = field(default_factory=list)
    """The critic's V before each completion token, once finished (jobs with a critic)."""
    returns: list[float] = field(default_factory=list)
    """GAE's return of each completion token, what the critic learns (jobs with a critic)."""
    scorer_errors: list[str] = field(default_factory=list)
    scorer_failures: list[str] = field(default_factory=list)
    """Why each rule or python scorer in scorer_errors failed (scorer/batch.py: FAILURE_REASONS)."""
    scorer_scores: dict[str, float] = field(default_factory=dict)
    """Each scorer's own score before its weight, by scorer name."""
    components: dict[str, float] = field(default_factory=dict)
    """The named parts of python scorers' scores."""
    token_rewards: dict[str, list[float]] = field(default_factory=dict)
    """Rewards per completion token that stages add, by the stage's name (say, a length penalty): with GAE each joins
    its token's reward; with an outcome advantage their sum joins the completion's."""
    turn_ended: bool = False
    """A multi-turn episode's policy finished a turn that its environment has yet to answer."""
    earlier: list[tuple[list[int], list[Turn]]] = field(default_factory=list)
    """A multi-turn episode's earlier training samples, (prompt ids, turns) each: its chat's rendering stopped being
    an exact prefix of its tokens, and a new sample started (environment/episode.py). Each trains with the
    episode's advantage."""
    episode: EpisodeLog | None = None
    """What the environment did in a multi-turn episode; None for a single completion."""

    @property
    def completion_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def answer_ids(self) -> list[int]:
        """The final answer: the completion's tokens after the environment's last turn (all of a single completion),
        what the scorers grade."""
        last = max((i for i, turn in enumerate(self.turns) if turn.kind == OBSERVATION), default=-1)
        return [t for turn in self.turns[last + 1:] for t in turn.token_ids]

    @property
    def policy_turns(self) -> int:
        """The policy's turns over the episode's samples: runs of its tokens between the environment's."""
        return sum(turn.sampled for _, turns in [*self.earlier, (self.prompt_ids, self.turns)] for turn in turns)

    def restart(self, prompt_ids: list[int]) -> None:
        """A new training sample of the episode, whose prompt is the chat rendered anew."""
        self.earlier.append((self.prompt_ids, self.turns))
        self.prompt_ids, self.turns = prompt_ids, []

    @property
    def versions(self) -> list[int]:
        """The policy version of each completion token (Turn.versions)."""
        return [v for turn in self.turns for v in turn.versions]

    @property
    def gen_logprobs(self) -> list[float]:
        """log mu of each completion token; 0 where the policy did not sample it (`sampled` says which)."""
        return [x for turn in self.turns for x in (turn.logprobs if turn.sampled else (0.0,) * len(turn.token_ids))]

    @property
    def sampled(self) -> list[bool]:
        return [turn.sampled for turn in self.turns for _ in turn.token_ids]

    @property
    def trained(self) -> list[bool]:
        return [turn.trained for turn in self.turns for _ in turn.token_ids]

    @property
    def version(self) -> int:
        """The policy version of the oldest sampled token: staleness is measured from it (spec maxStaleness). One
        that sampled nothing (a guide) has its context's."""
        sampled = [v for turn in self.turns if turn.sampled for v in turn.versions]
        return min(sampled or self.versions or [0])

    def extend(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        """Tokens the policy `version` sampled: a later segment of a partial rollout continues its last sampled turn."""
        if not token_ids:
            return
        versions = [version] * len(token_ids)
        if self.turns and self.turns[-1].sampled:
            last = self.turns.pop()
            token_ids, logprobs, versions = ([*last.token_ids, *token_ids], [*last.logprobs, *logprobs],
                                             [*last.versions, *versions])
        self.turns.append(sampled_turn(token_ids, logprobs, versions))


@dataclass
class EpisodeLog:
    """What a multi-turn episode's environment did (metrics.jsonl: turns_mean, tool_calls, tool_errors, ...)."""

    reward: float = 0.0
    """The environment's own reward, summed over its steps; added to the scorers'."""
    tool_calls: dict[str, int] = field(default_factory=dict)
    tool_errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    """The environment's time on the episode's steps."""
    error: str = ""
    """Why the environment ended the episode in an error (its reason first: raised, timeout, ...)."""
    truncated: bool = False
    """It ended at a limit (maxNewTokens, the prompt budget) before the environment said done."""
    drifted: bool = False
    """Its chat's rendering stopped being an exact prefix of its tokens (environment/episode.py) at least once."""


@dataclass
class Group:
    """The `groupSize` rollouts of one prompt."""

    position: int
    """Where its example is in the training stream."""
    example: Any
    rollouts: list[Rollout]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.rollouts)


@dataclass
class Batch:
    """The rollouts of one batch of prompts (`promptsPerStep` groups of `groupSize`)."""

    index: int
    rollouts: list[Rollout]
    data_position: int
    """Data examples consumed up to and including this batch."""
    visits: int = 1
    """Generate calls (segments per sequence at most) it took."""
    resumed: int = 0
    """Sequences continued from an earlier segment."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Prompts of this batch never generated (too long, refused), by ledger outcome."""
    replica: int = 0
    """The generator replica that finished it; of a batch split into parts, the one that generated the most."""
    parts: int = 1
    """How many parts its batch was split into (dispatch.py); one once assembled."""
    shares: dict[int, int] = field(default_factory=dict)
    """Rollouts each generator replica finished, by replica."""


class Stopped(Exception):
    """The loop is shutting down."""


class GeneratorDown(Exception):
    """The generator replica stopped answering; its batch goes back to the feed."""


class Refused(Exception):
    """The generator refused the request as one it can never serve (INVALID_ARGUMENT)."""


class RolloutBuffer:
    """Batches by index, each once all its parts are in; the trainer takes them in order and waits for the one it
    needs."""

    def __init__(self):
        self._batches: dict[int, Batch] = {}
        self._parts: dict[int, list[Batch]] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def put(self, part: Batch) -> None:
        with self._cond:
            parts = self._parts.setdefault(part.index, [])
            parts.append(part)
            if len(parts) < part.parts:
                return
            del self._parts[part.index]
            self._batches[part.index] = assembled(parts)
            self._cond.notify_all()

    def take(self, index: int, timeout: float | None = None) -> Batch | None:
        """Batch `index`, or None if it is not there within `timeout`; raises Stopped if a producer failed."""
        with self._cond:
            self._cond.wait_for(lambda: index in self._batches or self._error is not None, timeout)
            if self._error is not None:
                raise Stopped() from self._error
            return self._batches.pop(index, None)

    def fail(self, error: BaseException) -> None:
        """A producer died: wake the trainer with the error."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def depth(self) -> int:
        with self._cond:
            return len(self._batches)


def assembled(parts: list[Batch]) -> Batch:
    """One batch of its parts: rollouts in data order, as one part would have them."""
    if len(parts) == 1:
        return parts[0]
    shares: Counter[int] = Counter()
    dropped: Counter[str] = Counter()
    for part in parts:
        shares.update(part.shares)
        dropped.update(part.dropped)
    return Batch(parts[0].index, sorted((r for part in parts for r in part.rollouts), key=lambda r: r.prompt),
                 parts[0].data_position, visits=max(part.visits for part in parts),
                 resumed=sum(part.resumed for part in parts), dropped=dict(dropped),
                 replica=max(shares, key=lambda replica: (shares[replica], -replica)), shares=dict(shares))


def set_advantages(rollouts: list[Rollout], kind: str = "group_mean") -> None:
    """Advantages (estimator `kind`) over the rollouts that train: a sample dropped as stale is no part of its
    prompt's baseline, so the advantages of the trained samples sum to zero within each group."""
    if not rollouts:
        return
    rewards = torch.tensor([r.reward - r.kl_penalty + sum(map(sum, r.token_rewards.values())) for r in rollouts],
                           dtype=torch.float64)
    found = advantages(kind, rewards, torch.tensor([r.prompt for r in rollouts]))
    for rollout, advantage in zip(rollouts, found.tolist()):
        rollout.advantage = advantage


def set_gae_advantages(rollouts: list[Rollout], config: Gae) -> None:
    """GAE over each completion's tokens: its reward (less its KL penalty) on its last token, its token rewards on
    theirs, the critic's values; sets token_advantages (whitened over the batch if the job says so), their mean as
    `advantage`, and returns."""
    if not rollouts:
        return
    lengths = [len(r.completion_ids) for r in rollouts]
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    values = torch.zeros(mask.shape, dtype=torch.float64)
    for row, rollout in enumerate(rollouts):
        if lengths[row]:
            rewards[row, lengths[row] - 1] = rollout.reward - rollout.kl_penalty
            for name, per_token in rollout.token_rewards.items():
                rewards[row, : lengths[row]] += _per_token(rollout, name, per_token)
            values[row, : lengths[row]] = torch.tensor(rollout.values, dtype=torch.float64)
    found, returns = gae(rewards, values, mask, config.gamma, config.lam)
    if config.whiten:
        found = whiten(found, mask)
    for row, rollout in enumerate(rollouts):
        rollout.token_advantages = found[row, : lengths[row]].tolist()
        rollout.returns = returns[row, : lengths[row]].tolist()
        rollout.advantage = sum(rollout.token_advantages) / max(1, lengths[row])


def _per_token(rollout: Rollout, name: str, values: list[float]) -> torch.Tensor:
    if len(values) != len(rollout.completion_ids):
        raise ValueError(f"sample {rollout.sample_id}: stage {name!r} gave {len(values)} token rewards for "
                         f"{len(rollout.completion_ids)} completion tokens")
    return torch.tensor(values, dtype=torch.float64)


def set_kl_penalties(rollouts: list[Rollout], kl: KlPenalty) -> dict[str, float]:
    """The reward-penalty form of the KL: each completion's coef x summed estimate over the tokens the policy sampled,
    under the policy that sampled them (a guide's or an observation's tokens have no log mu). Returns the mean
    penalty (`kl_penalty_mean`)."""
    def sampled(rollout: Rollout, values: list[float]) -> list[float]:
        return [value for value, sampled in zip(values, rollout.sampled, strict=True) if sampled]

    penalties = kl_penalties([sampled(r, r.gen_logprobs) for r in rollouts],
                             [sampled(r, r.ref_logprobs) for r in rollouts], kl.estimator, kl.coef)
    for rollout, penalty in zip(rollouts, penalties):
        rollout.kl_penalty = penalty
    return {"kl_penalty_mean": sum(penalties) / max(1, len(penalties))}


def guided(rollout: Rollout) -> bool:
    """Whether a reference solution (algorithm.guidance) took the place of the rollout's completion."""
    return any(turn.kind == GUIDE for turn in rollout.turns)


def group_rewards(rollouts: list[Rollout]) -> list[set[float]]:
    """For each prompt's group, the rewards the policy's own samples (guides left out) scored."""
    rewards: dict[int, set[float]] = {}
    for rollout in rollouts:
        if not guided(rollout):
            rewards.setdefault(rollout.prompt, set()).add(rollout.reward)
    return list(rewards.values())


def sampled_entropy(rollouts: list[Rollout]) -> float | None:
    """Mean -log mu of the tokens the policy sampled: an estimate of the entropy per token of the distribution it
    sampled from (its mean over the samples); None if it sampled none."""
    logprobs = [x for r in rollouts for turn in r.turns if turn.sampled for x in turn.logprobs]
    return -sum(logprobs) / len(logprobs) if logprobs else None


def split_stale(rollouts: list[Rollout], step: int, max_staleness: int) -> tuple[list[Rollout], list[Rollout]]:
    """(fresh, stale): a rollout trains at `step` only if step - its oldest token's version <= bound."""
    fresh = [r for r in rollouts if step - r.version <= max_staleness]
    stale = [r for r in rollouts if step - r.version > max_staleness]
    return fresh, stale


def training_samples(rollouts: list[Rollout]) -> list[Sample]:
    """What the trainer takes of each rollout: its tokens, with which were sampled and which train; a multi-turn
    episode's earlier samples first, with its advantage."""
    return [*(_earlier_sample(r, prompt_ids, turns) for r in rollouts for prompt_ids, turns in r.earlier),
            *(Sample(prompt_ids=list(r.prompt_ids), completion_ids=r.completion_ids,
                     gen_logprobs=r.gen_logprobs, sampled=r.sampled, trained=r.trained,
                     ref_logprobs=list(r.ref_logprobs), advantage=r.advantage,
                     token_advantages=list(r.token_advantages)) for r in rollouts)]


def _earlier_sample(rollout: Rollout, prompt_ids: list[int], turns: list[Turn]) -> Sample:
    part = Rollout(rollout.sample_id, rollout.prompt, prompt_ids, rollout.answer, turns=turns)
    return Sample(prompt_ids=list(prompt_ids), completion_ids=part.completion_ids, gen_logprobs=part.gen_logprobs,
                  sampled=part.sampled, trained=part.trained, ref_logprobs=[], advantage=rollout.advantage,
                  token_advantages=[])
