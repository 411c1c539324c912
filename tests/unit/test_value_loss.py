"""The critic's clipped value loss against a per-token reference written with plain floats."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.testing import assert_close

from rlfleet.workers.rl.value import value_loss

MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def batch(seed: int):
    """V, V_old and R per token; V moves by up to 0.5 from V_old, so a clip of 0.2 chooses both branches."""
    rng = random.Random(seed)
    old = [[rng.uniform(-1, 1) for _ in row] for row in MASK]
    values = [[v + rng.uniform(-0.5, 0.5) for v in row] for row in old]
    returns = [[rng.uniform(-1.5, 1.5) for _ in row] for row in MASK]
    return values, old, returns


def reference(values, old, returns, clip, normalizer=None):
    """Loss, its gradient in V (worked out by hand) and the metrics."""
    tokens = [(b, t) for b, row in enumerate(MASK) for t, on in enumerate(row) if on]
    n = max(normalizer if normalizer is not None else len(tokens), 1)
    loss, grad, chosen = 0.0, [[0.0] * len(row) for row in MASK], 0
    for b, t in tokens:
        v, r = values[b][t], returns[b][t]
        bounded = v if clip is None else old[b][t] + min(max(v - old[b][t], -clip), clip)
        if (bounded - r) ** 2 > (v - r) ** 2:  # the clipped term; V's gradient is 0 once V is past the clip
            loss += 0.5 * (bounded - r) ** 2 / n
            chosen += 1
        else:
            loss += 0.5 * (v - r) ** 2 / n
            grad[b][t] = (v - r) / n
    targets = [returns[b][t] for b, t in tokens]
    errors = [returns[b][t] - values[b][t] for b, t in tokens]
    explained = 1 - variance(errors) / variance(targets)
    return loss, grad, {"value_clip_fraction": chosen / len(tokens), "explained_variance": explained}


def variance(xs):
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / len(xs)


def run(values, old, returns, clip, normalizer=None, mask=MASK):
    v = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    loss, metrics = value_loss(v, torch.tensor(old, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64),
                               torch.tensor(mask), clip, normalizer)
    loss.backward()
    return loss, v.grad, metrics


@pytest.mark.parametrize("clip, normalizer", [(0.2, None), (None, None), (0.2, 40), (10.0, None)])
@pytest.mark.parametrize("seed", range(3))
def test_value_loss_matches_the_reference(seed, clip, normalizer):
    values, old, returns = batch(seed)
    loss, grad, metrics = run(values, old, returns, clip, normalizer)
    ref_loss, ref_grad, ref_metrics = reference(values, old, returns, clip, normalizer)
    assert_close(loss, torch.tensor(ref_loss, dtype=torch.float64))
    assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64))
    assert metrics == pytest.approx(ref_metrics)


def test_the_batches_clip_some_tokens_and_not_others():
    """Else a bug in either branch of the reference checks would pass."""
    fractions = [reference(*batch(seed), 0.2)[2]["value_clip_fraction"] for seed in range(3)]
    assert all(0 < f < 1 for f in fractions), fractions


def test_no_clip_is_the_plain_squared_error_and_a_wide_clip_changes_nothing():
    values, old, returns = batch(0)
    plain, plain_grad, plain_metrics = run(values, old, returns, None)
    wide, wide_grad, wide_metrics = run(values, old, returns, 100.0)
    n = sum(map(sum, MASK))
    expected = sum(0.5 * (values[b][t] - returns[b][t]) ** 2 for b, row in enumerate(MASK)
                   for t, on in enumerate(row) if on) / n
    assert plain.item() == pytest.approx(expected)
    assert torch.equal(wide, plain) and torch.equal(wide_grad, plain_grad)
    assert plain_metrics["value_clip_fraction"] == 0.0 == wide_metrics["value_clip_fraction"]


def test_the_gradient_flows_only_through_the_chosen_branch():
    """V moved 0.5 away from R, past a clip of 0.1: the unclipped term is the larger, and V gets (V - R) / N; moved
    0.5 towards R: the clipped term (V_old - 0.1 - R) is the larger, and V gets no gradient."""
    values, old, returns = [[1.5, 0.5]], [[1.0, 1.0]], [[0.0, 0.0]]
    loss, grad, metrics = run(values, old, returns, 0.1, mask=[[1, 1]])
    assert_close(grad, torch.tensor([[1.5 / 2, 0.0]], dtype=torch.float64))
    assert loss.item() == pytest.approx((0.5 * 1.5**2 + 0.5 * 0.9**2) / 2)
    assert metrics["value_clip_fraction"] == 0.5


def test_padding_holding_infinities_gives_finite_zero_gradients_there():
    values, old, returns = batch(1)
    poisoned = [[v if on else math.inf for v, on in zip(row, m)] for row, m in zip(values, MASK)]
    loss, grad, _ = run(poisoned, poisoned, returns, 0.2)
    clean, _, _ = run(values, values, returns, 0.2)
    assert loss.item() == pytest.approx(clean.item())
    assert torch.isfinite(grad).all() and (grad[~torch.tensor(MASK).bool()] == 0).all()


def test_explained_variance_edges():
    _, _, perfect = run([[1.0, 2.0]], [[1.0, 2.0]], [[1.0, 2.0]], None, mask=[[1, 1]])
    assert perfect["explained_variance"] == 1.0
    _, _, constant = run([[0.0, 3.0]], [[0.0, 3.0]], [[1.0, 1.0]], None, mask=[[1, 1]])
    assert constant["explained_variance"] == 0.0
    loss, grad, empty = run([[1.0]], [[1.0]], [[2.0]], 0.2, mask=[[0]])
    assert loss.item() == 0.0 and grad.tolist() == [[0.0]]
    assert empty == {"value_clip_fraction": 0.0, "explained_variance": 0.0}


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="returns"):
        value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3), None)
