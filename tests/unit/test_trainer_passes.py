"""The trainer's fast path (micro-batches, prompts shared by their samples, log-probs in chunks, activation
checkpointing) gives the reference path's loss, AIPO metrics and gradients, and never builds [B, L, V] logits."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.workers.trainer.micro_batches import micro_batches
from rlfleet.workers.trainer.policy import Passes, pack_samples, plan_passes, token_logprobs, train_step
from rlfleet.workers.trainer.shared_prompts import attention_for, checkpoint_layers, shared_cost

from trainer_samples import Sample

VOCAB = 40
METRICS = ("loss", "tokens", "clip_fraction", "ess", "logprob_gap", "ratio_mean")


def tiny_llama(attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).eval()


def groups(seed: int = 3) -> list[Sample]:
    """Four prompts of different lengths, five completions each (empty ones included), off-policy enough to clip."""
    rng = random.Random(seed)
    samples = []
    for _ in range(4):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 7))]
        for _ in range(5):
            length = rng.randrange(0, 6)
            samples.append(Sample(prompt, [rng.randrange(4, VOCAB) for _ in range(length)],
                                  [-1.0 - 8.0 * rng.random() for _ in range(length)], rng.choice([-1.0, 0.5, 1.0])))
    return samples


def step(model: LlamaForCausalLM, passes: Passes, top_p: float, samples: list[Sample]) -> tuple[dict, dict]:
    """One step's metrics, and its gradient (SGD at lr 1 without clipping moves each weight by it)."""
    model = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), samples, temperature=0.7,
                        top_p=top_p, grad_clip=1e9, pad_id=0, passes=passes)
    return result, {name: before[name] - p.detach() for name, p in model.named_parameters()}


def assert_same_step(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    for name in METRICS:
        assert got[0][name] == pytest.approx(expected[0][name], rel=1e-5, abs=1e-7), name
    assert expected[0]["clip_fraction"] > 0, "no token was clipped: the batch does not test the clipping"
    for name, gradient in expected[1].items():
        assert_close(got[1][name], gradient, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("passes", "top_p"), [(Passes(None, 1024), 1.0), (Passes(30, 3), 1.0), (Passes(30, 3), 0.8),
                                               (Passes(1, 1), 1.0)],
                         ids=["one-pass", "micro-batches-and-chunks", "with-top-p", "one-token-each"])
def test_fast_path_equals_the_reference_step(passes, top_p):
    model, samples = tiny_llama(), groups()
    assert_same_step(step(model, passes, top_p, samples), step(model, Passes(), top_p, samples))


def test_token_advantages_take_the_same_fast_path():
    """Per-token advantages (GAE's) reach the same tokens packed per sample or per shared prompt."""
    rng = random.Random(5)
    samples = [Sample(s.prompt_ids, s.completion_ids, s.gen_logprobs, s.advantage,
                      token_advantages=[rng.uniform(-2, 2) for _ in s.completion_ids]) for s in groups()]
    model = tiny_llama()
    assert_same_step(step(model, Passes(30, 3), 1.0, samples), step(model, Passes(), 1.0, samples))


def test_activation_checkpointing_changes_nothing():
    model, samples = tiny_llama(), groups()
    checkpointed = copy.deepcopy(model)
    checkpoint_layers(checkpointed)
    assert_same_step(step(checkpointed, Passes(30, 3), 0.8, samples), step(model, Passes(), 0.8, samples))


def test_eager_attention_takes_the_same_masks():
    model, samples = tiny_llama("eager"), groups()
    assert_same_step(step(model, Passes(30, 3), 1.0, samples), step(model, Passes(), 1.0, samples))


def test_bfloat16_on_a_cpu_trains_with_eager_attention_and_the_same_step():
    """CPU bfloat16 loads eager attention (SDPA's bfloat16 backward is slow there); its step is SDPA's, to bfloat16
    rounding."""
    assert attention_for(torch.device("cpu"), torch.bfloat16) == "eager"
    assert attention_for(torch.device("cpu"), torch.float32) == attention_for(torch.device("cuda"), torch.bfloat16) \
        == "sdpa"
    samples = groups()
    runs = [train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), samples, temperature=0.7, top_p=1.0,
                       grad_clip=1e9, pad_id=0, passes=Passes(30, 3))
            for model in (tiny_llama("eager").bfloat16(), tiny_llama("sdpa").bfloat16())]
    assert runs[0]["loss"] == pytest.approx(runs[1]["loss"], rel=2e-2)
    assert runs[0]["grad_norm"] == pytest.approx(runs[1]["grad_norm"], rel=2e-2)


def test_logits_exist_a_chunk_at_a_time():
    model, samples = tiny_llama(), groups()
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    step(model, Passes(None, 4), 1.0, samples)
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    assert shapes and all(shape[:-1] in {(4,), (completion_tokens % 4,)} for shape in shapes), shapes
    # Every chunk's logits once in the forward and once more when the backward recomputes them.
    assert sum(shape[0] for shape in shapes) == 2 * completion_tokens


def test_micro_batches_keep_every_sample_within_the_budget():
    samples = groups()
    for budget in (1, 12, 30, 1000):
        batches = micro_batches(samples, budget, shared=True)
        assert sorted(map(id, (s for b in batches for s in b))) == sorted(map(id, samples))
        assert all(shared_cost(b) <= budget or len(b) == 1 for b in batches), budget
    assert len(micro_batches(samples, 1000, shared=True)) == 1
    assert micro_batches(samples, None, shared=True) == [samples]


def test_padding_passes_add_nothing():
    model, samples = tiny_llama(), groups()[:10]
    assert len(plan_passes(samples, Passes(1000, 8), count=4)) == 4
    padded = copy.deepcopy(model)
    result = train_step(padded, torch.optim.SGD(padded.parameters(), lr=1.0), samples, temperature=0.7,
                        top_p=1.0, grad_clip=1e9, pad_id=0, passes=Passes(1000, 8), micro_batch_count=4)
    expected = step(model, Passes(1000, 8), 1.0, samples)
    assert result["loss"] == pytest.approx(expected[0]["loss"], rel=1e-6)
    for (name, p), (_, q) in zip(padded.named_parameters(), model.named_parameters()):
        assert_close(q.detach() - p.detach(), expected[1][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("passes", [Passes(), Passes(30, 3)], ids=["reference", "fast"])
def test_a_guide_trains_as_if_the_policy_had_sampled_it(passes):
    """An unsampled token that trains (a guide's, controller/guidance.py) has the policy's own sampling log-prob: the
    step equals one whose guides carry those log-probs, on either path."""
    model, samples = tiny_llama(), groups()
    batch = pack_samples(samples, pad_id=0)
    with torch.no_grad():
        own = token_logprobs(model, batch, temperature=0.7, top_p=1.0)
    guides = range(0, len(samples), 3)
    as_sampled = [dataclasses.replace(s, gen_logprobs=own[row][batch.completion_mask[row]].tolist()) if row in guides
                  else s for row, s in enumerate(samples)]
    as_guides = [dataclasses.replace(s, gen_logprobs=[0.0] * len(s.completion_ids),
                                     sampled=[False] * len(s.completion_ids)) if row in guides else s
                 for row, s in enumerate(samples)]
    assert_same_step(step(model, passes, 1.0, as_guides), step(model, passes, 1.0, as_sampled))


def with_observations(samples: list[Sample], trained: bool) -> list[Sample]:
    """Every third sample's middle tokens as an environment's observation (unsampled, not trained); with `trained`,
    the same tokens sampled and trained instead but with advantage 0, which adds nothing to the loss either."""
    marked = []
    for row, s in enumerate(samples):
        middle = [row % 3 == 0 and 0 < t < len(s.completion_ids) - 1 for t in range(len(s.completion_ids))]
        if trained:
            marked.append(dataclasses.replace(s, token_advantages=[0.0 if m else s.advantage for m in middle]))
        else:
            marked.append(dataclasses.replace(s, gen_logprobs=[0.0 if m else x for m, x in zip(middle, s.gen_logprobs)],
                                              sampled=[not m for m in middle], trained=[not m for m in middle]))
    return marked


@pytest.mark.parametrize("passes", [Passes(), Passes(30, 3)], ids=["reference", "fast"])
def test_an_observation_is_context_and_adds_nothing_to_the_loss(passes):
    """An unsampled token that does not train (an environment's observation) adds nothing to the loss or its gradient,
    and the tokens after it are still predicted from it."""
    model, samples = tiny_llama(), groups()
    observed = with_observations(samples, trained=False)
    normalizer = sum(sum(s.trained) for s in observed)
    assert normalizer < sum(len(s.completion_ids) for s in samples)

    def run(batch: list[Sample]) -> tuple[dict, dict]:
        copy_ = copy.deepcopy(model)
        before = {name: p.detach().clone() for name, p in copy_.named_parameters()}
        result = train_step(copy_, torch.optim.SGD(copy_.parameters(), lr=1.0), batch, temperature=0.7, top_p=1.0,
                            grad_clip=1e9, pad_id=0, passes=passes, normalizer=normalizer)
        return result, {name: before[name] - p.detach() for name, p in copy_.named_parameters()}

    got, expected = run(observed), run(with_observations(samples, trained=True))
    assert got[0]["loss"] == pytest.approx(expected[0]["loss"], rel=1e-5, abs=1e-7)
    assert got[0]["tokens"] == normalizer
    for name, gradient in expected[1].items():
        assert_close(got[1][name], gradient, rtol=1e-5, atol=1e-6, msg=name)
    # Context: the same step without the observed tokens in the sequence is another step.
    cut = [dataclasses.replace(s, completion_ids=[t for t, k in zip(s.completion_ids, s.trained) if k],
                               gen_logprobs=[x for x, k in zip(s.gen_logprobs, s.trained) if k],
                               sampled=[k for k in s.trained if k], trained=[k for k in s.trained if k])
           for s in observed]
    assert run(cut)[0]["loss"] != pytest.approx(got[0]["loss"], rel=1e-4)


@pytest.mark.parametrize("passes", [Passes(), Passes(30, 3)], ids=["reference", "fast"])
def test_a_guides_training_sample_trains_as_its_nan_log_mu_did(passes):
    """A guide put in by guide_for and packed by training_samples gives the step its NaN log mu gave before turns:
    that of the same tokens sampled with the policy's own log-probs (ratio 1)."""
    from rlfleet.workers.controller.guidance import guide_for
    from rlfleet.workers.controller.rollouts import Group, Rollout, sampled_turn, training_samples

    model, samples = tiny_llama(), [s for s in groups() if s.completion_ids][:6]
    rollouts = [Rollout(str(n), 0, s.prompt_ids, "", turns=[sampled_turn(s.completion_ids, s.gen_logprobs,
                                                                         [0] * len(s.completion_ids))],
                        advantage=s.advantage) for n, s in enumerate(samples)]
    guide = guide_for(Group(0, None, rollouts), samples[-1].completion_ids)
    guide.advantage = 1.5
    rollouts[-1] = guide
    batch = pack_samples(samples, pad_id=0)
    with torch.no_grad():
        own = token_logprobs(model, batch, temperature=0.7, top_p=1.0)
    as_sampled = samples[:-1] + [dataclasses.replace(samples[-1], advantage=1.5,
                                                     gen_logprobs=own[-1][batch.completion_mask[-1]].tolist())]
    assert_same_step(step(model, passes, 1.0, training_samples(rollouts)), step(model, passes, 1.0, as_sampled))
