"""A 2-rank FSDP2 trainer step over gloo equals a 1-rank step on the same batch, weights and metrics alike (PPO's
epochs of uneven mini-batches too);
checkpoints gather the shards; a generator that never joins its sync group fails the join on every rank,
not the trainer."""

from __future__ import annotations

import pytest
import torch

from rlfleet.workers.models import materialize

from conftest import make_job
from trainer_runs import rollouts, run_trainers

pytestmark = pytest.mark.integration


def _pair(tmp_path_factory, model_cache, **job):
    """One 2-rank and one 1-rank trainer, each a train step, a join nobody answers and a checkpoint."""
    job = {"algorithm": {"learningRate": 0.01}, "weightSync": {"backend": "gloo", "timeoutSeconds": 3}, **job}
    two, one = make_job(roles={"trainer": {"replicas": 2}}, **job), make_job(**job)
    model_dir = materialize(two.spec.model, model_cache)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    batch = rollouts(vocab=start["lm_head.weight"].shape[0])
    out = tmp_path_factory.mktemp("trainers")
    sharded = run_trainers(2, two, model_dir, batch, str(out / "fsdp"))
    return start, sharded, run_trainers(1, one, model_dir, batch, str(out / "single"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_cache):
    return _pair(tmp_path_factory, model_cache)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, model_cache):
    """LoRA, activation checkpointing under FSDP, a warm-up, and micro-batches so small that the two ranks have
    different numbers of them (rank 1's samples are longer): the rank with fewer runs padding passes."""
    return _pair(tmp_path_factory, model_cache,
                 training={"microBatchTokens": 16, "logprobChunkTokens": 3, "lora": {"rank": 4},
                           "activationCheckpointing": True, "lrSchedule": {"type": "constant", "warmupSteps": 3}})


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory, model_cache):
    """PPO's epochs and mini-batches: the 8 samples in runs of 2, 3 and 3, so the ranks' shares of a step differ."""
    return _pair(tmp_path_factory, model_cache,
                 algorithm={"learningRate": 0.01, "loss": {"type": "ppo"}, "epochs": 2, "miniBatches": 3})


def test_two_rank_sharded_step_equals_one_rank_step(runs):
    start, sharded, single = runs
    assert sharded["weights"].keys() == single["weights"].keys()
    for name, value in single["weights"].items():
        # Adam divides by sqrt(v): float noise in near-zero gradients moves a weight by far less than lr.
        torch.testing.assert_close(sharded["weights"][name], value, rtol=1e-4, atol=1e-4)
    assert any(not torch.equal(single["weights"][name], start[name]) for name in start), "the step changed nothing"


def test_metrics_are_over_all_ranks_samples(runs):
    _, sharded, single = runs
    assert single["metrics"]["clip_fraction"] > 0.1, "the off-policy half should be clipped"
    for name in ("loss", "clip_fraction", "ess", "logprob_gap", "ratio_mean", "tokens", "grad_norm"):
        assert sharded["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-4, abs=1e-6), name


def test_a_generator_that_never_joins_fails_the_join_not_the_trainer(runs):
    _, sharded, single = runs
    # Both runs went on to checkpoint (every rank exited 0); rank 0 got the reason as a string.
    for run in (sharded, single):
        assert isinstance(run["joined"], str) and run["joined"], run["joined"]


def test_lora_with_uneven_micro_batches_sharded_equals_one_rank(lora_runs):
    _, sharded, single = lora_runs
    assert single["weights"] and all(".lora_" in name for name in single["weights"]), "checkpoints hold the adapters"
    assert sharded["weights"].keys() == single["weights"].keys()
    for name, value in single["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], value, rtol=1e-4, atol=1e-4)
    assert any(name.endswith("lora_B.weight") and value.abs().max() > 0 for name, value in single["weights"].items())
    for name in ("loss", "clip_fraction", "ess", "logprob_gap", "tokens", "grad_norm"):
        assert sharded["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-4, abs=1e-6), name
    # Step 0 of a 3-step warm-up: the optimizer stepped at a quarter of learningRate, and says so.
    for run in (sharded, single):
        assert run["lr"] == pytest.approx(0.01 / 4) and run["metrics"]["learning_rate"] == pytest.approx(0.01 / 4)


def test_ppo_epochs_over_uneven_mini_batches_sharded_equal_one_rank(ppo_runs):
    _, sharded, single = ppo_runs
    assert sharded["metrics"]["optimizer_steps"] == single["metrics"]["optimizer_steps"] == 6
    for name, value in single["weights"].items():
        # Six Adam steps compound the float noise; another split of the mini-batches would differ by ~lr (0.01).
        torch.testing.assert_close(sharded["weights"][name], value, rtol=1e-4, atol=1e-3)
    assert sharded["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-4, abs=1e-6)
