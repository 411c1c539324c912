"""Packing, trainer logprobs and one AIPO step on a tiny random Llama."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close
from trainer_samples import Sample as Rollout
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.workers.rl.config import AipoLoss, KlPenalty, PpoLoss, ReinforceLoss
from rlfleet.workers.rl.sampling import sampled_logprobs
from rlfleet.workers.trainer.policy import pack_samples, token_logprobs, train_step

PAD = 0


@pytest.fixture
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def rollouts() -> list[Rollout]:
    return [
        Rollout([1, 2, 3], [4, 5], [-0.1, -0.2], 1.0),
        Rollout([6], [7, 8, 9, 10, 11], [-0.3, -0.4, -0.5, -0.6, -0.7], -0.5),
        Rollout([12, 13, 14, 15], [], [], 0.25),
    ]


def manual_logprobs(model: LlamaForCausalLM, ids: list[int], temperature: float) -> torch.Tensor:
    """log pi of tokens 1.. of one unpadded sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    targets = torch.tensor(ids[1:])[:, None]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets)[:, 0]


def test_pack_aligns_completion_with_next_token_targets():
    batch = pack_samples(rollouts(), PAD)
    assert batch.input_ids.tolist() == [
        [1, 2, 3, 4, 5, PAD],
        [6, 7, 8, 9, 10, 11],
        [12, 13, 14, 15, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [[1] * 5 + [0], [1] * 6, [1] * 4 + [0, 0]]
    assert torch.equal(batch.targets, batch.input_ids[:, 1:])
    assert batch.completion_mask.tolist() == [
        [False, False, True, True, False],
        [True, True, True, True, True],
        [False] * 5,
    ]
    assert batch.targets[batch.completion_mask].tolist() == [4, 5, 7, 8, 9, 10, 11]
    expected = torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7])
    assert_close(batch.gen_logprobs[batch.completion_mask], expected)
    assert batch.gen_logprobs[~batch.completion_mask].abs().sum() == 0
    assert batch.advantages[batch.completion_mask].tolist() == [1.0] * 2 + [-0.5] * 5
    assert batch.advantages[~batch.completion_mask].abs().sum() == 0


def test_pack_places_token_advantages_on_their_targets():
    samples = [Rollout([1, 2], [3, 4, 5], [-0.1] * 3, 9.0, token_advantages=[0.5, -1.0, 2.0]),
               Rollout([6, 7, 8], [9], [-0.2], -0.25)]
    batch = pack_samples(samples, PAD)
    assert batch.advantages.tolist() == [[0.0, 0.5, -1.0, 2.0], [0.0, 0.0, -0.25, 0.0]]
    with pytest.raises(ValueError, match="token_advantages"):
        pack_samples([Rollout([1], [2, 3], [-0.1] * 2, 0.0, token_advantages=[1.0])], PAD)


def test_pack_refuses_mismatched_logprobs():
    with pytest.raises(ValueError, match="gen_logprobs"):
        pack_samples([Rollout([1], [2, 3], [-0.1], 1.0)], PAD)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_unpadded_per_sample_forward(model, temperature):
    samples = rollouts()
    with torch.no_grad():
        got = token_logprobs(model, pack_samples(samples, PAD), temperature, 1.0)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    for row, sample in enumerate(samples):
        ids = sample.prompt_ids + sample.completion_ids
        expected = manual_logprobs(model, ids, temperature)
        assert_close(got[row, : len(ids) - 1], expected, atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_logprobs(model):
    short, long = rollouts()[0], rollouts()[1]
    with torch.no_grad():
        alone = token_logprobs(model, pack_samples([short], PAD), 1.0, 1.0)
        padded = token_logprobs(model, pack_samples([short, long], PAD), 1.0, 1.0)
    assert_close(padded[0, : alone.shape[1]], alone[0], atol=1e-5, rtol=1e-5)


def test_temperature_scales_the_logits(model):
    batch = pack_samples(rollouts()[:1], PAD)
    with torch.no_grad():
        cold = token_logprobs(model, batch, 1.0, 1.0)
        hot = token_logprobs(model, batch, 3.0, 1.0)
        logits = model(batch.input_ids).logits[0, :-1]
    expected = torch.log_softmax(logits / 3.0, dim=-1).gather(-1, batch.targets[0][:, None])[:, 0]
    assert_close(hot[0], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(hot, cold, atol=1e-3)


def test_top_p_scores_under_the_generators_nucleus(model):
    batch = pack_samples(rollouts()[:2], PAD)
    with torch.no_grad():
        got = token_logprobs(model, batch, 0.7, 0.5)
        logits = model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    assert_close(got, sampled_logprobs(logits, batch.targets, 0.7, 0.5), atol=1e-5, rtol=1e-5)
    assert (got[batch.completion_mask] > token_logprobs(model, batch, 0.7, 1.0)[batch.completion_mask]).all()


def test_train_step_raises_logprob_of_positively_rewarded_tokens(model):
    prompt, completion = [1, 2, 3], [4, 5, 6]
    batch = pack_samples([Rollout(prompt, completion, [0.0] * 3, 1.0)], PAD)
    with torch.no_grad():
        before = token_logprobs(model, batch, 1.0, 1.0)[batch.completion_mask]
    # On-policy samples: the generator's logprobs are the trainer's own.
    samples = [Rollout(prompt, completion, before.tolist(), 1.0)] * 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = train_step(model, optimizer, samples, temperature=1.0, top_p=1.0, grad_clip=1.0,
                         pad_id=PAD)
    with torch.no_grad():
        after = token_logprobs(model, batch, 1.0, 1.0)[batch.completion_mask]
    assert after.sum() > before.sum()
    assert metrics["tokens"] == 6.0 and metrics["clip_fraction"] == 0.0 and metrics["skipped"] == 0.0
    assert metrics["logprob_gap"] < 1e-5 and metrics["ess"] == pytest.approx(1.0)
    assert metrics["grad_norm"] > 0.0
    assert metrics["loss"] == pytest.approx(-before.mean().item(), rel=1e-4)
    assert all(p.grad is None for p in model.parameters())


def test_train_step_weights_the_kl_loss_of_a_stale_token_by_pi_over_mu(model):
    """Advantage 0 leaves the KL term alone in the loss; mu = pi / 2 on every token makes its weight 2."""
    prompt, completion = [1, 2, 3], [4, 5, 6]
    batch = pack_samples([Rollout(prompt, completion, [0.0] * 3, 0.0)], PAD)
    with torch.no_grad():
        pi = token_logprobs(model, batch, 1.0, 1.0)[batch.completion_mask]
    ref = pi - torch.tensor([0.5, -1.0, 0.25])
    samples = [Rollout(prompt, completion, (pi - math.log(2.0)).tolist(), 0.0, ref.tolist())]
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), samples, temperature=1.0, top_p=1.0,
                         grad_clip=1.0, pad_id=PAD, kl=KlPenalty(coef=0.1, estimator="k2"))
    k2 = 0.5 * (pi - ref) ** 2
    assert metrics["loss"] == pytest.approx(0.1 * 2.0 * k2.mean().item(), rel=1e-4)
    assert metrics["kl_mean"] == pytest.approx(k2.mean().item(), rel=1e-4)


def test_train_step_trains_with_the_loss_the_job_chose(model):
    """Samples whose generator logprobs lie far below the trainer's: AIPO trains on them (weight capped at rho),
    REINFORCE with masked importance sampling drops every token (all ratios above its cap), and PPO's clip stops
    the gradient of a positive advantage once the ratio is past 1 + epsHigh."""
    prompt, completion = [1, 2, 3], [4, 5, 6]
    samples = [Rollout(prompt, completion, [-30.0] * 3, 1.0)] * 2
    norms = {}
    for name, loss in [("aipo", AipoLoss()), ("mis", ReinforceLoss(correction="mis", cap=2.0)), ("ppo", PpoLoss())]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        metrics = train_step(model, optimizer, samples, loss=loss, temperature=1.0, top_p=1.0, grad_clip=1.0,
                             pad_id=PAD)
        norms[name] = metrics["grad_norm"]
        assert metrics["clip_fraction"] == 1.0, name
    assert norms["aipo"] > 0.0 and norms["mis"] == 0.0 and norms["ppo"] == 0.0
