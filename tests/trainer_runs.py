"""Trainer ranks run as a job's would (spawned processes over gloo, each a `Trainer`), for tests that compare how
different worlds learn the same batch: FSDP over ranks, pipeline stages, one rank."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
from pathlib import Path

from rlfleet.workers.controller.rollouts import Rollout
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port

from conftest import sampled
from support import FIXED_TOKEN, end_trainer_rank


def rollouts(vocab: int) -> list[Rollout]:
    """Rank 1's share (odd indices) is off-policy, with longer completions: far from mu, clipped at rho, and
    with another log-prob gap than rank 0's share, so one rank's metrics cannot pass for the batch's."""
    rng = random.Random(7)
    found = []
    for index in range(8):
        off_policy = index % 2 == 1
        length = rng.randrange(4, 9) if off_policy else rng.randrange(1, 4)
        completion = [rng.randrange(4, vocab) for _ in range(length)]
        gen_logprobs = [(-9.0 if off_policy else -3.0) - rng.random() for _ in completion]
        found.append(Rollout(
            sample_id=str(index), prompt=index // 4, answer="0",
            prompt_ids=[rng.randrange(4, vocab) for _ in range(rng.randrange(2, 6))],
            turns=sampled(completion, gen_logprobs), advantage=rng.choice([-1.0, 0.5, 1.0]),
        ))
    return found


def _train(rank: int, port: int, job_json: dict, model_dir: str, batch, out: str, resume: bool, join: bool) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.worker import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = parse_job(job_json)
    ctx = WorkerContext(job=job, role="trainer", rank=rank, endpoints=Endpoints(""),
                        grpc_port=0, metrics_port=0, run_dir=out, token=FIXED_TOKEN)
    trainer = Trainer(ctx, model_dir)
    if rank == 0:
        metrics = trainer.train(batch, 0)
        # No generator ever joins this group: the join fails by the deadline, on every rank, without
        # ending any; the next call runs as usual.
        joined = trainer.connect("generator", 0, "127.0.0.1", free_port(), 1) if join else None
        trainer.checkpoint(1, {"policy_version": 1})
        learning_rate = trainer.optimizer.param_groups[0]["lr"]
        if resume:  # from the checkpoint just written: the weights and Adam's moments it holds
            trainer.restore(f"{out}/checkpoints/step-000001")
            trainer.train(batch, 1)
            trainer.checkpoint(2, {"policy_version": 2})
        Path(out, "result.json").write_text(json.dumps({"metrics": metrics, "joined": joined, "lr": learning_rate}))
    else:
        trainer.follow()
    end_trainer_rank(trainer)


def run_trainers(world_size: int, job, model_dir, batch, out: str, resume: bool = False, join: bool = True) -> dict:
    """Rank 0 trains `batch` as step 0, joins a sync group nobody answers (if `join`: it waits for the job's
    weightSync.timeoutSeconds), and checkpoints step 1 (with `resume`, restores it, trains step 1 and checkpoints step
    2). Returns the metrics, the join's error, the learning rate, and each checkpoint's weights (`weights`,
    `weights_2`)."""
    from rlfleet.workers.trainer.checkpoint import read_checkpoint

    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=_train, args=(r, port, job.to_dict(), str(model_dir), batch, out, resume, join))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
        assert proc.exitcode == 0, f"trainer rank exited with {proc.exitcode}"
    weights, optimizer, state = read_checkpoint(f"{out}/checkpoints/step-000001")
    assert state["step"] == 1 and optimizer["state"], "the optimizer state was not gathered"
    found = {"weights": weights, **json.loads(Path(out, "result.json").read_text())}
    if resume:
        found["weights_2"] = read_checkpoint(f"{out}/checkpoints/step-000002")[0]
    return found
