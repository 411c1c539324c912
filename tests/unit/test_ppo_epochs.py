"""PPO's epochs and mini-batches (trainer/epochs.py): one epoch of one mini-batch is today's step to the bit; more
take more optimizer steps; every rank plans the same steps, each sample once per epoch, padding where a rank has
nothing."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.workers.rl.config import PpoLoss
from rlfleet.workers.trainer import epochs as epochs_module, policy
from rlfleet.workers.trainer.epochs import mini_batch_plan, train_epochs
from rlfleet.workers.trainer.policy import Padding, Passes, train_step
from rlfleet.workers.trainer.shared_prompts import ATTENTION

from trainer_samples import Sample

VOCAB = 40
OPTIONS = {"loss": PpoLoss(), "temperature": 0.7, "top_p": 1.0, "grad_clip": 1.0, "pad_id": 0}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         attn_implementation=ATTENTION)
    return LlamaForCausalLM(config).eval()


def groups(prompts: int = 3, size: int = 4, seed: int = 1) -> list[Sample]:
    """`prompts` groups of `size` completions (empty ones included), some with per-token advantages."""
    rng = random.Random(seed)
    samples = []
    for _ in range(prompts):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 5))]
        for _ in range(size):
            length = rng.randrange(0, 5)
            token_advantages = [rng.uniform(-1, 1) for _ in range(length)] if rng.random() < 0.5 else []
            samples.append(Sample(prompt, [rng.randrange(4, VOCAB) for _ in range(length)],
                                  [-2.0 - rng.random() for _ in range(length)], rng.choice([-1.0, 0.5, 1.0]),
                                  token_advantages=token_advantages))
    return samples


def adamw(model: LlamaForCausalLM) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def sgd(model: LlamaForCausalLM) -> torch.optim.Optimizer:
    """Moves the weights in proportion to the gradient (AdamW's first step is blind to its scale)."""
    return torch.optim.SGD(model.parameters(), lr=0.1)


def distance(model: LlamaForCausalLM, start: LlamaForCausalLM) -> float:
    return sum(float((p - q).detach().pow(2).sum()) for p, q in zip(model.parameters(), start.parameters())) ** 0.5


@pytest.mark.parametrize("passes", [Passes(), Passes(20, 3)], ids=["reference", "micro-batches"])
def test_one_epoch_of_one_mini_batch_is_train_step_exactly(passes):
    start, samples = tiny_llama(), groups()
    plain, epoch = copy.deepcopy(start), copy.deepcopy(start)
    expected = train_step(plain, adamw(plain), samples, passes=passes, **OPTIONS)
    got = train_epochs(epoch, adamw(epoch), samples, step=3, seed=5, passes=passes, **OPTIONS)
    for p, q in zip(plain.parameters(), epoch.parameters()):
        assert torch.equal(p, q)
    assert got == expected | {"epochs": 1.0, "optimizer_steps": 1.0}


def test_two_epochs_take_two_steps_and_move_the_weights_further():
    start, samples = tiny_llama(), groups()
    moved = {}
    for epochs in (1, 2):
        model = copy.deepcopy(start)
        optimizer = adamw(model)
        steps = []
        optimizer.register_step_post_hook(lambda *_: steps.append(1))
        metrics = train_epochs(model, optimizer, samples, step=0, seed=0, epochs=epochs, **OPTIONS)
        assert len(steps) == metrics["optimizer_steps"] == epochs and metrics["epochs"] == epochs
        moved[epochs] = distance(model, start)
    assert moved[2] > moved[1] > 0


def test_mini_batches_take_a_step_each_and_wait_for_the_pushes_once_before_the_first():
    model, samples = tiny_llama(), groups()
    optimizer = adamw(model)
    events = []
    optimizer.register_step_pre_hook(lambda *_: events.append("step"))
    metrics = train_epochs(model, optimizer, samples, step=0, seed=0, epochs=2, mini_batches=3,
                           before_update=lambda: events.append("release"), **OPTIONS)
    assert events == ["release"] + ["step"] * 6
    assert metrics["optimizer_steps"] == 6.0 and metrics["skipped"] == 0.0
    assert metrics["tokens"] == sum(len(s.completion_ids) for s in samples)


def test_the_metrics_are_the_last_epochs_token_weighted_and_skips_are_counted(monkeypatch):
    results = iter([{"loss": 100.0, "tokens": 1.0, "skipped": 1.0}, {"loss": 100.0, "tokens": 1.0, "skipped": 0.0},
                    {"loss": 9.0, "tokens": 5.0, "skipped": 0.0}, {"loss": 1.0, "tokens": 3.0, "skipped": 1.0}])
    monkeypatch.setattr(epochs_module, "train_step", lambda *args, **kwargs: next(results))
    metrics = train_epochs(None, None, groups(prompts=2, size=2), step=0, seed=0, epochs=2, mini_batches=2,
                           **OPTIONS)
    assert metrics["loss"] == pytest.approx((9.0 * 5 + 1.0 * 3) / 8)
    assert metrics["tokens"] == 8.0 and metrics["skipped"] == 2.0 and metrics["optimizer_steps"] == 2.0


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("mini_batches", [1, 2, 5, 100])
def test_every_sample_trains_once_an_epoch_on_the_rank_that_would_have_it(world_size, mini_batches):
    samples = groups(prompts=4, size=3)
    plan = mini_batch_plan(samples, world_size, mini_batches, random.Random(0))
    assert len(plan) == min(mini_batches, len(samples))
    assert all(len(shares) == world_size for shares in plan)
    trained = [s for shares in plan for share in shares for s in share if not isinstance(s, Padding)]
    assert sorted(map(id, trained)) == sorted(map(id, samples))
    sizes = [sum(len(share) for share in shares if not isinstance(share[0], Padding)) for shares in plan]
    assert max(sizes) - min(sizes) <= 1, sizes
    if mini_batches == 1:
        assert plan == [[samples[r::world_size] for r in range(world_size)]]


def test_mini_batches_keep_prompt_groups_together_and_shuffle_them_by_the_seed():
    samples = groups(prompts=6, size=2)
    plan = mini_batch_plan(samples, 1, 3, random.Random(0))
    assert all(len({tuple(s.prompt_ids) for s in shares[0]}) == 2 for shares in plan)
    orders = {tuple(id(s) for shares in mini_batch_plan(samples, 1, 3, random.Random(seed)) for s in shares[0])
              for seed in range(6)}
    assert len(orders) > 1
    assert mini_batch_plan(samples, 2, 3, random.Random(4)) == mini_batch_plan(samples, 2, 3, random.Random(4))


def test_a_rank_with_nothing_for_a_step_gets_padding():
    samples = groups(prompts=1, size=5)
    plan = mini_batch_plan(samples, 4, 2, random.Random(0))  # runs of 2 and 3 samples over 4 ranks
    assert [[isinstance(share[0], Padding) for share in shares] for shares in plan] == [
        [False, False, True, True], [False, False, False, True]]


def test_every_rank_runs_the_same_steps_with_the_same_normalizers(monkeypatch):
    """Rank by rank (as each would alone): as many steps, each with the token count of every rank's samples of it
    and the most micro-batches of any rank, though the ranks' shares differ in size."""
    samples = groups(prompts=3, size=3)[:7]  # 7 samples over 2 ranks: 4 and 3
    calls = {0: [], 1: []}
    for rank in (0, 1):
        def record(model, optimizer, share, rank=rank, **kwargs):
            calls[rank].append((kwargs["normalizer"], kwargs["micro_batch_count"], len(share)))
            return {"loss": 0.0, "tokens": 0.0, "skipped": 0.0}
        monkeypatch.setattr(epochs_module, "train_step", record)
        train_epochs(None, None, samples, step=2, seed=1, epochs=2, mini_batches=3, rank=rank, world_size=2,
                     passes=Passes(8, 4), **OPTIONS)
    assert len(calls[0]) == len(calls[1]) == 6
    assert [c[:2] for c in calls[0]] == [c[:2] for c in calls[1]]
    total = sum(len(s.completion_ids) for s in samples)
    assert sum(c[0] for c in calls[0][:3]) == sum(c[0] for c in calls[0][3:]) == total
    assert sum(c[2] for c in calls[0][:3]) + sum(c[2] for c in calls[1][:3]) == 7


@pytest.mark.parametrize("passes", [Passes(), Passes(20, 3)], ids=["reference", "micro-batches"])
def test_samples_without_an_advantage_are_not_run_and_change_nothing(passes, monkeypatch):
    """Groups whose rewards were all equal: their samples add 0 to the loss, so the step skips their forward and
    backward, yet divides by every token as before (a normalizer over the run samples alone would move the
    weights further)."""
    start, samples = tiny_llama(), groups(prompts=4)
    for sample in samples[4:12]:  # two whole groups without an advantage
        sample.advantage, sample.token_advantages = 0.0, []
    plain, skipping = copy.deepcopy(start), copy.deepcopy(start)
    expected = train_step(plain, sgd(plain), samples, passes=passes, **OPTIONS)
    packed = []
    for name in ("pack_samples", "pack_shared"):
        pack = getattr(policy, name)
        monkeypatch.setattr(policy, name, lambda batch, *args, pack=pack: packed.extend(batch) or pack(batch, *args))
    got = train_epochs(skipping, sgd(skipping), samples, step=0, seed=0, passes=passes, **OPTIONS)
    for p, q in zip(plain.parameters(), skipping.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert packed == [s for s in samples if s.advantage or s.token_advantages]
