"""The sampling distribution (temperature, then top-p) against a plain per-token reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlfleet.workers.rl import sampling
from rlfleet.workers.rl.sampling import outside_nucleus, processed_logits, sampled_logprobs

VOCAB = 50


def reference_support(row: list[float], target: int, temperature: float, top_p: float) -> list[int]:
    """The most likely tokens while the mass kept before each is < top_p, and the target.

    Among equally likely tokens the target comes first: an engine sampled it, so its nucleus held it.
    """
    weights = [math.exp(x / temperature) for x in row]
    probs = [w / sum(weights) for w in weights]
    kept, mass = [target], 0.0
    for token in sorted(range(len(row)), key=lambda i: (-probs[i], i != target)):
        if mass >= top_p:
            break
        kept.append(token)
        mass += probs[token]
    return sorted(set(kept))


def reference_logprob(row: list[float], target: int, temperature: float, top_p: float) -> float:
    weights = [math.exp(x / temperature) for x in row]
    return math.log(weights[target] / sum(weights[i] for i in reference_support(row, target, temperature, top_p)))


def random_case(seed: int, rows: int = 12, grid: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and targets; a grid > 0 rounds the logits to its multiples, so that many tie (as bfloat16 do)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64) * 3
    if grid:
        logits = (logits / grid).round() * grid
    targets = torch.randint(0, VOCAB, (rows,), generator=generator)
    return logits, targets


@pytest.mark.parametrize("grid", [0.0, 0.5])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05, 1e-6])
def test_sampled_logprobs_equal_the_reference(temperature, top_p, grid):
    logits, targets = random_case(seed=int(temperature * 10 + top_p * 100), grid=grid)
    got = sampled_logprobs(logits.float().view(3, 4, VOCAB), targets.view(3, 4), temperature, top_p)
    expected = [reference_logprob(row.tolist(), int(t), temperature, top_p) for row, t in zip(logits, targets)]
    assert got.dtype == torch.float32 and got.shape == (3, 4)
    assert_close(got.flatten(), torch.tensor(expected, dtype=torch.float32), atol=2e-5, rtol=1e-5)


def test_top_p_1_is_the_tempered_log_softmax():
    logits, targets = random_case(seed=1)
    expected = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, targets[:, None])[:, 0]
    assert_close(sampled_logprobs(logits.float(), targets, 0.7, 1.0), expected)


def test_gradient_flows_through_the_renormalisation_with_the_nucleus_held_fixed():
    logits, targets = random_case(seed=2)
    inputs = logits.float().requires_grad_()
    sampled_logprobs(inputs, targets, 0.8, 0.6).sum().backward()
    support = torch.zeros_like(logits, dtype=torch.bool)
    for row, (values, target) in enumerate(zip(logits, targets)):
        support[row, reference_support(values.tolist(), int(target), 0.8, 0.6)] = True
    reference = logits.clone().requires_grad_()
    scaled = (reference / 0.8).masked_fill(~support, float("-inf"))
    scaled.log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
    assert_close(inputs.grad, reference.grad.float())
    assert (inputs.grad[~support] == 0).all() and support.sum() < support.numel() / 2


# Mass 0.4, then three ties of 0.18, then 0.06: top_p 0.5 is reached with one of the three ties.
TIED = torch.tensor([[0.4, 0.18, 0.18, 0.18, 0.06]]).log()


def test_an_engine_keeps_as_many_ties_as_the_mass_needs_the_lowest_ids():
    assert outside_nucleus(TIED, 0.5).tolist() == [[False, False, True, True, True]]


@pytest.mark.parametrize("target, weights", [
    (0, [0.4, 0.06, 0.06, 0.06, 0.0]),  # the one kept tie is any of the three: each weighs a third
    (2, [0.4, 0.0, 0.18, 0.0, 0.0]),  # the sampled tie was the one kept
    (4, [0.4, 0.06, 0.06, 0.06, 0.06]),  # sampled just past the boundary (float noise): scored, never -inf
])
def test_the_normaliser_counts_as_many_ties_as_the_engine_kept(target, weights):
    logits = TIED.clone().requires_grad_()
    got = sampled_logprobs(logits, torch.tensor([target]), 1.0, 0.5)
    assert_close(got.item(), math.log(TIED.exp()[0, target].item() / sum(weights)))
    got.backward()
    expected = -torch.tensor([weights]) / sum(weights)
    expected[0, target] += 1.0
    assert_close(logits.grad, expected)


def test_chunked_sorting_changes_nothing(monkeypatch):
    logits, targets = random_case(seed=3, rows=7, grid=0.5)
    whole = sampled_logprobs(logits.float(), targets, 1.3, 0.7)
    engine = outside_nucleus(logits.float(), 0.7)
    for chunk in (VOCAB, 3 * VOCAB + 1):
        monkeypatch.setattr(sampling, "SORT_CHUNK_ELEMENTS", chunk)
        assert torch.equal(sampled_logprobs(logits.float(), targets, 1.3, 0.7), whole)
        assert torch.equal(outside_nucleus(logits.float(), 0.7), engine)


def test_bfloat16_logits_give_float32_and_inputs_are_not_modified():
    logits, targets = random_case(seed=4)
    low = logits.bfloat16()
    before = low.clone()
    assert sampled_logprobs(low, targets, 1.0, 0.5).dtype == torch.float32
    assert processed_logits(low, 1.0, 0.5).dtype == torch.float32
    assert torch.equal(low, before)


@pytest.mark.parametrize("grid", [0.0, 0.5])
def test_an_engines_log_mu_is_the_trainers_log_pi_for_every_token_it_can_sample(grid):
    logits, _ = random_case(seed=5, grid=grid)
    processed = processed_logits(logits.float(), 0.9, 0.5)
    mu = processed.log_softmax(-1)
    for token in range(VOCAB):
        targets = torch.full((len(logits),), token)
        pi = sampled_logprobs(logits.float(), targets, 0.9, 0.5)
        sampleable = torch.isfinite(processed[:, token])
        assert_close(pi[sampleable], mu[sampleable, token])


def test_processed_logits_equal_hf_temperature_then_top_p():
    """The torch engine used HF's warpers before: the same rule, but for which tied tokens stay."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    logits, _ = random_case(seed=6, rows=64)
    logits = logits.float()
    for temperature, top_p in [(0.5, 0.9), (1.0, 0.5), (2.0, 0.05)]:
        hf = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        assert torch.equal(torch.isinf(processed_logits(logits, temperature, top_p)), torch.isinf(hf))


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (-1.0, 0.5), (math.nan, 0.5), (1.0, 0.0), (1.0, 1.5)])
def test_settings_outside_the_domain_are_refused(temperature, top_p):
    logits, targets = random_case(seed=7)
    with pytest.raises(ValueError):
        sampled_logprobs(logits, targets, temperature, top_p)


def test_float32_logits_are_the_float32_product_whatever_the_weights_and_autocast():
    """bfloat16 weights and hidden states under bfloat16 autocast: the products of their (exact) float32 values,
    not logits rounded to bfloat16 (which move by up to 1/16 near 20)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(20)
    hidden = torch.randn(8, 64).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = sampling.float32_logits(head, hidden)
        rounded = head(hidden)
    assert logits.dtype == torch.float32
    assert_close(logits, hidden.float() @ head.weight.float().T)
    assert (logits - rounded.float()).abs().max() > 1e-2


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_float32_logits_of_no_rows_are_an_empty_batch_of_the_vocabulary(device):
    """A micro-batch with no completion token to predict still runs the output layer (its graph must reach every
    layer): on a GPU the reshape of its empty product once failed a real job's trainer."""
    head = torch.nn.Linear(64, 1000, bias=False, device=device).to(torch.bfloat16)
    assert sampling.float32_logits(head, torch.zeros(0, 64, dtype=torch.bfloat16, device=device)).shape == (0, 1000)


def test_use_float32_logits_makes_a_models_logits_float32_keeping_its_parameters_and_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    lm = LlamaForCausalLM(config).to(torch.bfloat16)
    names = [name for name, _ in lm.named_parameters()]
    sampling.use_float32_logits(lm)
    out = lm(input_ids=torch.tensor([[1, 5, 7, 9]]), output_hidden_states=True)
    assert out.logits.dtype == torch.float32
    assert_close(out.logits, sampling.float32_logits(lm.lm_head, out.hidden_states[-1]))
    assert [name for name, _ in lm.named_parameters()] == names
    out.logits.logsumexp(-1).sum().backward()
    assert lm.lm_head.weight.grad is not None and lm.lm_head.weight.grad.abs().sum() > 0
