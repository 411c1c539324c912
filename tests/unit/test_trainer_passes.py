"""The trainer's fast path (sequences packed end to end, prompts shared by their samples, micro-batches, log-probs in
one pass or in chunks, activation checkpointing) gives the reference path's loss, AIPO metrics and gradients, never
builds [B, L, V] logits, nor any [L, L] tensor."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.workers.models.forward import align_forward
from rlfleet.workers.rl.config import KlPenalty
from rlfleet.workers.trainer import shared_prompts
from rlfleet.workers.trainer.micro_batches import micro_batches
from rlfleet.workers.trainer.policy import Passes, pack_samples, plan_passes, token_logprobs, train_step
from rlfleet.workers.trainer.shared_prompts import ATTENTION, checkpoint_layers, shared_cost

from trainer_samples import Sample

VOCAB = 40
METRICS = ("loss", "tokens", "clip_fraction", "ess", "logprob_gap", "ratio_mean")


def tiny_llama(attention: str = ATTENTION, positions: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions,
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


def step(model: LlamaForCausalLM, passes: Passes, top_p: float, samples: list[Sample], **options) -> tuple[dict, dict]:
    """One step's metrics, and its gradient (SGD at lr 1 without clipping moves each weight by it)."""
    model = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), samples, temperature=0.7,
                        top_p=top_p, grad_clip=1e9, pad_id=0, passes=passes, **options)
    return result, {name: before[name] - p.detach() for name, p in model.named_parameters()}


@pytest.fixture(params=["plain-logits", "chunked-logits"])
def logits(request, monkeypatch):
    """Log pi in one plain pass (memory to spare) or in chunks (none free): the fast path's two ways."""
    free = 1 << 50 if request.param == "plain-logits" else 0
    monkeypatch.setattr(shared_prompts, "free_bytes", lambda device: free)
    return request.param


def assert_same_step(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    for name in METRICS:
        assert got[0][name] == pytest.approx(expected[0][name], rel=1e-5, abs=1e-7), name
    assert expected[0]["clip_fraction"] > 0, "no token was clipped: the batch does not test the clipping"
    for name, gradient in expected[1].items():
        assert_close(got[1][name], gradient, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("passes", "top_p"), [(Passes(None, 1024), 1.0), (Passes(30, 3), 1.0), (Passes(30, 3), 0.8),
                                               (Passes(1, 1), 1.0)],
                         ids=["one-pass", "micro-batches-and-chunks", "with-top-p", "one-token-each"])
def test_fast_path_equals_the_reference_step(passes, top_p, logits):
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
    checkpoint_layers(checkpointed.model.layers)
    assert_same_step(step(checkpointed, Passes(30, 3), 0.8, samples), step(model, Passes(), 0.8, samples))


def test_length_one_completions_and_several_groups_take_the_same_fast_path(logits):
    """No completion has a token to feed: the second pass runs one pad token of its own, whose output is unused."""
    rng = random.Random(11)
    samples = [Sample(prompt, [rng.randrange(4, VOCAB)], [-1.0 - 8.0 * rng.random()], rng.choice([-1.0, 0.5, 1.0]))
               for prompt in ([5, 6, 7], [8], [9, 10, 11, 12, 13]) for _ in range(3)]
    model = tiny_llama()
    for passes in (Passes(None, 1024), Passes(1, 2)):
        assert_same_step(step(model, passes, 1.0, samples), step(model, Passes(), 1.0, samples))


def test_ref_logprobs_and_a_kl_loss_take_the_same_fast_path(logits):
    rng = random.Random(13)
    # log pi_ref near the untrained model's log pi (about -log 40): a KL term the size of the policy loss's.
    samples = [dataclasses.replace(s, ref_logprobs=[-3.7 + rng.uniform(-0.5, 0.5) for _ in s.completion_ids])
               for s in groups()]
    model, kl = tiny_llama(), KlPenalty(coef=0.1, estimator="k3")
    got, expected = step(model, Passes(30, 3), 0.8, samples, kl=kl), step(model, Passes(), 0.8, samples, kl=kl)
    assert expected[0]["kl_mean"] > 0
    assert got[0]["kl_mean"] == pytest.approx(expected[0]["kl_mean"], rel=1e-5)
    assert_same_step(got, expected)


def test_a_model_loaded_with_another_attention_is_refused():
    with pytest.raises(ValueError, match="attn_implementation='rlfleet_packed'"):
        step(tiny_llama("sdpa"), Passes(30, 3), 1.0, groups())


def gradients(model: LlamaForCausalLM, passes: Passes, samples: list[Sample]) -> tuple[dict, dict]:
    """One step's metrics, and its gradient in float32 as the optimizer sees it (an update of bfloat16 weights would
    round it away)."""
    model, grads = copy.deepcopy(model), {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(
        lambda *_: grads.update({name: p.grad.float().clone() for name, p in model.named_parameters()}))
    result = train_step(model, optimizer, samples, temperature=0.7, top_p=1.0, grad_clip=1e9, pad_id=0, passes=passes)
    return result, grads


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_bfloat16_packed_step_equals_the_reference_step_to_bfloat16_rounding(device):
    """From bfloat16 weights the packed step is the reference step's within 2% (loss, gradient norm, each weight's
    gradient as a whole): bfloat16 keeps 8 bits of mantissa, and the two paths round in another order. On a GPU the
    packed path runs flash's varlen attention, whose causal mask must align bottom-right (a completion's query t
    sees its whole prompt): aligned top-left, it would see the prompt's first t + 1 keys only."""
    samples, model = groups(), tiny_llama().to(device).bfloat16()
    got, expected = (gradients(model, passes, samples) for passes in (Passes(30, 3), Passes()))
    assert got[0]["loss"] == pytest.approx(expected[0]["loss"], rel=2e-2)
    assert got[0]["grad_norm"] == pytest.approx(expected[0]["grad_norm"], rel=2e-2)
    for name, gradient in expected[1].items():
        assert torch.linalg.norm(got[1][name] - gradient) <= 2e-2 * torch.linalg.norm(gradient), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_cpu_packed_log_pi_is_the_reference_paths_bit_for_bit(dtype):
    """Rounded as vLLM's CPU kernels round (models/forward.py), the packed path's log pi of every completion token is
    the reference path's exactly, though one attends segment by segment and the other over a padded batch. Every CPU
    attention call pads its keys to a multiple of KEY_ALIGN, so a query's result does not depend on how many keys its
    call holds; vLLM's CPU attention computes it so too. In bfloat16 the last bit of one attention output moves
    SmolLM2's log-probs by 0.02 nats (test_logprob_parity); a model this small shows that last bit in float32."""
    rng = random.Random(5)
    samples = []
    for _ in range(3):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(17, 41))]
        for _ in range(3):
            length = rng.randrange(1, 31)
            samples.append(Sample(prompt, [rng.randrange(4, VOCAB) for _ in range(length)], [-1.0] * length, 1.0))
    model = tiny_llama(positions=128).to(dtype)
    align_forward(model, generators_on_gpu=False)
    with torch.no_grad():
        packed = shared_prompts.pack_shared(samples)
        got = shared_prompts.completion_logprobs(model, packed, 0.7, 1.0, 64)[packed.completion_mask]
        batch = pack_samples(samples, pad_id=0)
        expected = token_logprobs(model, batch, 0.7, 1.0)[batch.completion_mask]
    assert torch.equal(got, expected)


def test_logits_exist_a_chunk_at_a_time_when_they_do_not_fit(monkeypatch):
    monkeypatch.setattr(shared_prompts, "free_bytes", lambda device: 0)
    model, samples = tiny_llama(), groups()
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    step(model, Passes(None, 4), 1.0, samples)
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    assert shapes and all(shape[:-1] in {(4,), (completion_tokens % 4,)} for shape in shapes), shapes
    # Every chunk's logits once in the forward and once more when the backward recomputes them.
    assert sum(shape[0] for shape in shapes) == 2 * completion_tokens


def test_logits_that_fit_take_one_plain_pass(monkeypatch):
    """One output-layer call for the micro-batch's completion tokens, none recomputed in the backward."""
    monkeypatch.setattr(shared_prompts, "free_bytes", lambda device: 1 << 50)
    model, samples = tiny_llama(), groups()
    shapes = []
    model.lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    step(model, Passes(None, 4), 1.0, samples)
    assert shapes == [(sum(len(s.completion_ids) for s in samples), VOCAB)]


def test_micro_batches_keep_every_sample_within_the_budget():
    samples = groups()
    for budget in (1, 12, 30, 1000):
        batches = micro_batches(samples, budget, shared=True)
        assert sorted(map(id, (s for b in batches for s in b))) == sorted(map(id, samples))
        assert all(shared_cost(b) <= budget or len(b) == 1 for b in batches), budget
    assert len(micro_batches(samples, 1000, shared=True)) == 1
    assert micro_batches(samples, None, shared=True) == [samples]


def test_a_micro_batch_costs_its_packed_tokens_without_padding():
    """A shared prompt once, and each completion but its last token, whatever the longest: 5 + 0 + 9 tokens."""
    samples = [Sample([1, 2, 3, 4, 5], [6], [-1.0], 1.0), Sample([1, 2, 3, 4, 5], list(range(6, 16)), [-1.0] * 10, 1.0)]
    assert shared_cost(samples) == 14
    assert micro_batches(samples, 14, shared=True) == [samples]
    assert len(micro_batches(samples, 13, shared=True)) == 2


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


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation creates while the mode is on (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.elements = max([self.elements, *sizes])
        return out


def largest_tensor_of_a_step(length: int) -> int:
    """A checkpointed step over one sample of a 32-token prompt and a `length`-token completion."""
    model = tiny_llama(positions=2 * length)
    checkpoint_layers(model.model.layers)
    sample = Sample(list(range(4, 36)), [4 + i % (VOCAB - 4) for i in range(length)], [-3.0] * length, 1.0)
    with LargestTensor() as largest:
        train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), [sample], temperature=0.7, top_p=1.0,
                   grad_clip=1e9, pad_id=0, passes=Passes(None, 256))
    return largest.elements


def test_long_context_memory_grows_linearly_with_the_tokens():
    """Attention never materialises a [length, length] score or mask: doubling a sample's length at most doubles
    (plus a margin) the largest tensor a step creates, where the padded path's scores grew fourfold."""
    short, long = largest_tensor_of_a_step(1500), largest_tensor_of_a_step(3000)
    assert long <= 2.2 * short, (short, long)
    assert long < 3000**2 / 4, long


@pytest.mark.parametrize("block", [4, 256])
def test_attention_by_segment_is_each_segments_causal_attention_aligned_bottom_right(block, monkeypatch):
    """Per segment and in blocks of queries (3 tokens of a prompt-prefixed completion, say, see its prompt and their
    own keys up to themselves): the dense masked softmax of each segment alone, with KV heads shared by two queries."""
    monkeypatch.setattr(shared_prompts, "QUERY_BLOCK", block)
    torch.manual_seed(0)
    query_ends, key_ends = (0, 5, 6, 23), (0, 9, 13, 30)
    q = torch.randn(23, 4, 16, dtype=torch.float64)
    k, v = (torch.randn(30, 2, 16, dtype=torch.float64) for _ in range(2))
    layout = shared_prompts._layout(query_ends, key_ends, torch.arange(30))
    expected = []
    for q0, q1, k0, k1 in zip(query_ends, query_ends[1:], key_ends, key_ends[1:]):
        keys, values = (t[k0:k1].repeat_interleave(2, dim=1).transpose(0, 1) for t in (k, v))
        scores = q[q0:q1].transpose(0, 1) @ keys.transpose(1, 2) * 0.3
        seen = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril((k1 - k0) - (q1 - q0))
        expected.append((scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values).transpose(0, 1))
    assert_close(shared_prompts._by_segment(q, k, v, layout, 0.3), torch.cat(expected))


def tiny_family(kind: str) -> torch.nn.Module:
    """Mistral with a sliding window of 3 tokens, and Gemma 2 with its attention and final logit softcaps and own query
    scale too: what the packed path must honour beyond Llama's."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, max_position_embeddings=64, attn_implementation=ATTENTION)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**sizes, sliding_window=3)).eval()
    config = Gemma2Config(**sizes, sliding_window=3, attn_logit_softcapping=1.5, query_pre_attn_scalar=8,
                          final_logit_softcapping=3.0)
    return Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_sliding_window_and_a_softcap_take_the_same_packed_step_as_eager_attention(kind, logits):
    """The packed path equals the reference path run with transformers' eager attention, which applies the model's
    sliding-window mask, its softcaps and its scale: segments of up to 11 tokens see only their last 3 keys."""
    model, samples = tiny_family(kind), groups()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert_same_step(step(model, Passes(30, 3), 0.8, samples), step(eager, Passes(), 0.8, samples))


def test_micro_batches_are_as_even_as_their_number_allows():
    """Filled to the budget, six samples of 8 tokens would make micro-batches of 40 and 8 tokens: the small one's
    passes wait on the host. The same two micro-batches, even: 24 and 24."""
    samples = [Sample([10 * p + 1, 10 * p + 2, 10 * p + 3, 10 * p + 4], [1, 2, 3, 4, 5], [-1.0] * 5, 1.0)
               for p in range(6)]
    assert [shared_cost(b) for b in micro_batches(samples, 40, shared=True)] == [24, 24]
    assert [len(b) for b in micro_batches(samples, 23, shared=True)] == [2, 2, 2]
