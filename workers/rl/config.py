"""The RL algorithm of a job (`spec.algorithm`): batch shape, optimizer, and the policy loss and advantage
estimator it chooses by `type`.
Torch-free: part of the RLJob schema. The formulas are in losses.py and advantages.py, and in docs/algorithms.md."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from rlfleet.workers.strict import MAX_SEED, Strict


class AipoLoss(Strict):
    """AIPO: per-token importance weight min(pi/mu, rho), detached, times the advantage (REINFORCE with token TIS)."""

    type: Literal["aipo"] = "aipo"
    rho: float = Field(2.0, ge=2.0, le=10.0)
    """Upper clip of the importance weight (LlamaRL uses 2..10)."""


class PpoLoss(Strict):
    """PPO/GRPO clipped surrogate -min(r A, clip(r, 1 - epsLow, 1 + epsHigh) A) per token, r = pi/mu. epsHigh above
    epsLow is DAPO's clip-higher (DAPO: 0.2 and 0.28)."""

    type: Literal["ppo"] = "ppo"
    eps_low: float = Field(0.2, gt=0.0, le=1.0)
    eps_high: float = Field(0.2, gt=0.0, le=10.0)


class GspoLoss(Strict):
    """GSPO: the clipped surrogate on the sequence ratio s = exp(mean_t log(pi/mu)), one clip per sequence (the
    paper's ranges are this small: s stays near 1 where token ratios do not)."""

    type: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, gt=0.0, le=1.0)
    eps_high: float = Field(4e-4, gt=0.0, le=10.0)


class CispoLoss(Strict):
    """CISPO: -sg(clip(r, 1 - epsLow, 1 + epsHigh)) A log pi per token: the weight is clipped, never the token's
    gradient (MiniMax-M1 sets no lower clip: epsLow 1)."""

    type: Literal["cispo"] = "cispo"
    eps_low: float = Field(1.0, gt=0.0, le=1.0)
    eps_high: float = Field(1.0, gt=0.0, le=100.0)


class ReinforceLoss(Strict):
    """REINFORCE, -w A log pi, with an off-policy correction w of the sampled tokens: none (w = 1), TIS (truncated:
    min(ratio, cap)) or MIS (masked: the ratio, or 0 above cap), of each token (ratio pi/mu) or of each sequence
    (the product of its tokens' ratios)."""

    type: Literal["reinforce"] = "reinforce"
    correction: Literal["none", "tis", "mis"] = "tis"
    level: Literal["token", "sequence"] = "token"
    cap: float = Field(2.0, ge=1.0, le=1e4)


PolicyLoss = Annotated[Union[AipoLoss, PpoLoss, GspoLoss, CispoLoss, ReinforceLoss], Field(discriminator="type")]

Advantage = Literal["group_mean", "group_mean_std", "rloo", "reinforce_pp", "gae"]


class Gae(Strict):
    """Generalised advantage estimation from the critic's values (algorithm.advantage: gae): one advantage per
    completion token, A_t = delta_t + gamma lambda A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount per token; 1 (the usual for LLMs) leaves the completion's reward undiscounted."""
    lam: float = Field(0.95, ge=0.0, le=1.0, alias="lambda")
    """GAE's lambda (`lambda` in YAML): 0 is the one-step TD error, 1 the return minus V."""
    whiten: bool = True
    """Normalise the batch's token advantages to mean 0 and standard deviation 1 (PPO's usual)."""


class KlPenalty(Strict):
    """KL(pi || pi_ref) against the reference executor (spec.roles.reference), estimated per token from
    d = log pi - log pi_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (README: Reference policy and KL)."""

    coef: float = Field(0.0, ge=0.0, le=100.0)
    """Weight of the KL; 0 measures it (kl_mean) without acting on it. Above 0 needs spec.roles.reference."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of the KL."""
    use: Literal["loss", "reward"] = "loss"
    """loss: coef x the token mean of the estimate joins the policy loss (GRPO's form). reward: coef x the estimate
    summed over a completion's tokens, under the policy that sampled it, is subtracted from its reward before the
    advantages (the RLHF reward-penalty form)."""

    @model_validator(mode="after")
    def _gradient_is_a_kl(self) -> KlPenalty:
        # What each estimator's expected gradient is, in docs/algorithms.md's table (Reference policy and KL).
        if self.coef > 0 and self.use == "loss" and self.estimator == "k1":
            raise ValueError("algorithm.kl.estimator k1 with use loss has an expected gradient of 0 (it only adds "
                             "noise): set estimator to k2 (the gradient of KL(pi || pi_ref)) or k3 (of "
                             "KL(pi_ref || pi)), or use to reward")
        if self.coef > 0 and self.use == "reward" and self.estimator != "k1":
            raise ValueError(f"algorithm.kl.estimator {self.estimator} with use reward does not follow the gradient "
                             "of a KL (only k1's penalty does): set estimator to k1, or use to loss")
        return self


class Algorithm(Strict):
    max_staleness: int = Field(1, ge=0, le=64)
    """Staleness of a rollout = trainer step - policy version of its oldest token.
    A rollout trains only if its staleness <= maxStaleness; 0 is the synchronous baseline."""
    group_size: int = Field(8, ge=2, le=1024)
    """Completions sampled per prompt; the group mean reward is the baseline."""
    prompts_per_step: int = Field(4, ge=1, le=65536)
    """Prompts (groups) per trainer step. 4 (32 samples at groupSize 8), not 8: at the same learning rate it makes
    twice the updates of the same samples, and on tasks nobody tuned for it reached TRL's final accuracy in a quarter
    of TRL's time where 8 never did (BENCHMARKS.md, RLFleet's defaults against TRL)."""
    steps: int = Field(100, ge=1, le=10**7)
    """Trainer steps (policy versions) to run."""
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    """AdamW learning rate. 1e-5: at 4 prompts per step, 2e-5 learned as fast at first, then fell apart (BENCHMARKS.md,
    RLFleet's defaults against TRL)."""
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0.0, le=1e6)
    """Max global gradient norm."""
    loss: PolicyLoss = Field(default_factory=AipoLoss)
    """Policy loss, by `type`: aipo, ppo, gspo, cispo or reinforce (README: Training)."""
    kl: KlPenalty = Field(default_factory=KlPenalty)
    """KL regularisation towards the reference policy (needs spec.roles.reference)."""
    advantage: Advantage = "group_mean"
    """Advantage estimator: group_mean, group_mean_std (GRPO), rloo, reinforce_pp, or gae (needs a critic)
    (README: Training)."""
    gae: Gae = Field(default_factory=Gae)
    """GAE's settings; used only when advantage is gae."""
    epochs: int = Field(1, ge=1, le=64)
    """Passes over each batch, PPO's epochs."""
    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer steps per epoch: the batch's samples split into this many."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of sampling and training."""
    guidance: Literal["none", "answer", "auto"] = "auto"
    """Off-policy guidance (LUFFY; README: Guidance): a group none of whose completions scored above 0 gets its
    example's reference solution (or answer) in the place of its last completion, trained as if the policy had sampled
    it. auto, the default: only while at least three quarters of the newest 32 groups scored nothing, so that it stops
    once the policy finds rewards itself; it stays off under kl.use reward, with an environment and with a learned
    reward model (spec.guided). answer: every such group, always. none: never. auto by default because on the peer
    bench it lost on none of four tasks and lifted the two whose base model rarely scores (BENCHMARKS.md, "guidance
    auto becomes the default")."""

    @model_validator(mode="after")
    def _guides_have_no_sampling_logprobs(self) -> Algorithm:
        if self.guidance == "answer" and self.kl.use == "reward":
            raise ValueError("algorithm.guidance answer cannot go with algorithm.kl.use reward (a guide was not "
                             "sampled, so it has no sampling log-probs to penalise): set kl.use to loss, or guidance "
                             "to auto or none")
        return self
