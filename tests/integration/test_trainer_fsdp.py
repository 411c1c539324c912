"""A 2-rank FSDP2 trainer step over gloo equals a 1-rank step on the same batch, weights and metrics alike (PPO's
epochs of uneven mini-batches too);
checkpoints gather the shards; a generator that never joins its sync group fails the join on every rank,
not the trainer."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest
import torch

from rlfleet.workers.controller.rollouts import Rollout
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port

from conftest import make_job, sampled
from support import FIXED_TOKEN, end_trainer_rank

pytestmark = pytest.mark.integration


def _rollouts(vocab: int) -> list[Rollout]:
    """Rank 1's share (odd indices) is off-policy, with longer completions: far from mu, clipped at rho, and
    with another log-prob gap than rank 0's share, so one rank's metrics cannot pass for the batch's."""
    rng = random.Random(7)
    rollouts = []
    for index in range(8):
        off_policy = index % 2 == 1
        length = rng.randrange(4, 9) if off_policy else rng.randrange(1, 4)
        completion = [rng.randrange(4, vocab) for _ in range(length)]
        gen_logprobs = [(-9.0 if off_policy else -3.0) - rng.random() for _ in completion]
        rollouts.append(Rollout(
            sample_id=str(index), prompt=index // 4, answer="0",
            prompt_ids=[rng.randrange(4, vocab) for _ in range(rng.randrange(2, 6))],
            turns=sampled(completion, gen_logprobs), advantage=rng.choice([-1.0, 0.5, 1.0]),
        ))
    return rollouts


def _train(rank: int, world_size: int, port: int, job_json: dict, model_dir: str, rollouts, out: str) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.worker import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = parse_job(job_json)
    ctx = WorkerContext(job=job, role="trainer", rank=rank, endpoints=Endpoints(""),
                        grpc_port=0, metrics_port=0, run_dir=out, token=FIXED_TOKEN)
    trainer = Trainer(ctx, model_dir)
    if rank == 0:
        metrics = trainer.train(rollouts, 0)
        # No generator ever joins this group: the join fails by the deadline, on every rank, without
        # ending any; the next call runs as usual.
        joined = trainer.connect("generator", 0, "127.0.0.1", free_port(), 1)
        trainer.checkpoint(1, {"policy_version": 1})
        learning_rate = trainer.optimizer.param_groups[0]["lr"]
        Path(out, "result.json").write_text(json.dumps({"metrics": metrics, "joined": joined, "lr": learning_rate}))
    else:
        trainer.follow()
    end_trainer_rank(trainer)


def _run(world_size: int, job, model_dir, rollouts, out) -> list[dict]:
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_train, args=(r, world_size, port, job.to_dict(), str(model_dir), rollouts, out))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
        assert proc.exitcode == 0, f"trainer rank exited with {proc.exitcode}"
    from rlfleet.workers.trainer.checkpoint import read_checkpoint

    weights, optimizer, state = read_checkpoint(f"{out}/checkpoints/step-000001")
    assert state["step"] == 1 and optimizer["state"], "the optimizer state was not gathered"
    return {"weights": weights, **json.loads(Path(out, "result.json").read_text())}


def _pair(tmp_path_factory, model_cache, **job):
    """One 2-rank and one 1-rank trainer, each a train step, a join nobody answers and a checkpoint."""
    job = {"algorithm": {"learningRate": 0.01}, "weightSync": {"backend": "gloo", "timeoutSeconds": 3}, **job}
    two, one = make_job(roles={"trainer": {"replicas": 2}}, **job), make_job(**job)
    model_dir = materialize(two.spec.model, model_cache)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    rollouts = _rollouts(vocab=start["lm_head.weight"].shape[0])
    out = tmp_path_factory.mktemp("trainers")
    sharded = _run(2, two, model_dir, rollouts, str(out / "fsdp"))
    return start, sharded, _run(1, one, model_dir, rollouts, str(out / "single"))


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
