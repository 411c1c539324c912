"""A 2-rank FSDP2 trainer step over gloo equals a 1-rank step on the same batch; checkpoints gather the shards."""

from __future__ import annotations

import multiprocessing
import os
import random

import pytest
import torch

from rlfleet.workers.controller.rollouts import Rollout
from rlfleet.workers.models import materialize
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port

from conftest import make_job

pytestmark = pytest.mark.integration


def _rollouts(vocab: int) -> list[Rollout]:
    rng = random.Random(7)
    rollouts = []
    for index in range(8):
        completion = [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 6))]
        rollouts.append(Rollout(
            sample_id=str(index), prompt=index // 4, answer="0",
            prompt_ids=[rng.randrange(4, vocab) for _ in range(rng.randrange(2, 6))],
            completion_ids=completion, gen_logprobs=[-3.0 - rng.random() for _ in completion],
            versions=[0] * len(completion), advantage=rng.choice([-1.0, 0.5, 1.0]),
        ))
    return rollouts


def _train(rank: int, world_size: int, port: int, job_json: dict, model_dir: str, rollouts, out: str) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.worker import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = parse_job(job_json)
    ctx = WorkerContext(job=job, role="trainer", rank=rank, endpoints=Endpoints([], [], "", "", []),
                        grpc_port=0, metrics_port=0, run_dir=".")
    trainer = Trainer(ctx, model_dir)
    if rank == 0:
        trainer.command("train", rollouts)
        trainer.command("checkpoint", out, 1, {"policy_version": 1})
    else:
        trainer.follow()
    trainer.stop()


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

    weights, optimizer, state = read_checkpoint(f"{out}/step-000001")
    assert state["step"] == 1 and optimizer["state"], "the optimizer state was not gathered"
    return weights


def test_two_rank_sharded_step_equals_one_rank_step(tmp_path, model_cache):
    two = make_job(roles={"trainer": {"replicas": 2}}, algorithm={"learningRate": 0.01})
    one = make_job(algorithm={"learningRate": 0.01})
    model_dir = materialize(two.spec.model, model_cache)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    rollouts = _rollouts(vocab=start["lm_head.weight"].shape[0])
    sharded = _run(2, two, model_dir, rollouts, str(tmp_path / "fsdp"))
    single = _run(1, one, model_dir, rollouts, str(tmp_path / "single"))
    assert sharded.keys() == single.keys()
    for name, value in single.items():
        # Adam divides by sqrt(v): float noise in near-zero gradients moves a weight by far less than lr.
        torch.testing.assert_close(sharded[name], value, rtol=1e-4, atol=1e-4)
    assert any(not torch.equal(single[name], start[name]) for name in start), "the step changed nothing"
