"""A 2-rank trainer (gloo) served by rank 0 and driven through TrainerLink: its step equals a 1-rank Trainer's called
directly, and a checkpoint, a resume and the best snapshot go through every rank (a follower that missed the resume
would give the gathered weights its own shard of a later step)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.workers import wire
from rlfleet.workers.models import materialize, weight_files
from rlfleet.workers.plan import Endpoints, WorkerContext, free_port
from rlfleet.workers.trainer.checkpoint import BEST_DIR, read_checkpoint
from rlfleet.workers.trainer.link import TrainerLink

from conftest import make_job
from support import FIXED_TOKEN, end_trainer_rank
from trainer_samples import Sample

pytestmark = pytest.mark.integration
SAMPLES = [Sample([1, 2, 3], [4, 5], [-3.0, -3.0], 1.0), Sample([6, 7], [8, 9, 10], [-3.5, -3.0, -2.5], -1.0)]
OTHER = [Sample([1, 2, 3], [4, 6], [-3.0, -3.0], 1.0), SAMPLES[1]]
SPEC = {"algorithm": {"learningRate": 1e-2}}


def _ctx(job, rank: int, run_dir: str, port: int = 0, epoch: int | None = None) -> WorkerContext:
    return WorkerContext(job=job, role="trainer", rank=rank, endpoints=Endpoints(""), grpc_port=port, metrics_port=0,
                         run_dir=run_dir, token=FIXED_TOKEN, listen_host="127.0.0.1", leader_epoch=epoch)


def _rank(rank: int, job_json: dict, model_dir: str, master_port: int, port: int, run_dir: str, done) -> None:
    from rlfleet.workers.spec import parse_job
    from rlfleet.workers.trainer.server import start_trainer_service
    from rlfleet.workers.trainer.worker import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    ctx = _ctx(parse_job(job_json), rank, run_dir, port)
    trainer = Trainer(ctx, model_dir)
    if rank == 0:
        server, _ = start_trainer_service(ctx, trainer)
        done.wait(240)
        server.stop(None).wait(10)
    else:
        trainer.follow()
    end_trainer_rank(trainer)


def _direct(job, model_dir, run_dir, monkeypatch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The metrics and weights of step 0 on a 1-rank Trainer called in this process."""
    from rlfleet.workers.trainer.worker import Trainer

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    trainer = Trainer(_ctx(job, 0, str(run_dir)), model_dir)
    try:
        return trainer.train(SAMPLES, 0), trainer.snapshot()
    finally:
        trainer.stop()


def test_two_served_ranks_train_checkpoint_and_resume_together(tmp_path, model_cache, monkeypatch):
    two, one = make_job(roles={"trainer": {"replicas": 2}}, **SPEC), make_job(**SPEC)
    model_dir = materialize(two.spec.model, model_cache)
    expected, expected_weights = _direct(one, model_dir, tmp_path / "direct", monkeypatch)
    context = multiprocessing.get_context("spawn")
    done, master, port, run_dir = context.Event(), free_port(), free_port(), tmp_path / "served"
    ranks = [context.Process(target=_rank, args=(r, two.to_dict(), str(model_dir), master, port, str(run_dir), done))
             for r in range(2)]
    for rank in ranks:
        rank.start()
    try:
        wire.wait_ready(f"127.0.0.1:{port}", 120)
        link = TrainerLink(_ctx(two, 0, str(run_dir), epoch=1), f"127.0.0.1:{port}")
        assert link.world_size == 2
        assert link.resume()["step"] == 0  # what every leader does first
        metrics = link.train(SAMPLES, 0)
        for name in ("loss", "clip_fraction", "ess", "logprob_gap", "tokens", "grad_norm"):
            assert metrics[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
        state = {"step": 1, "data_position": 2, "in_flight": []}
        link.checkpoint(1, state)
        saved, _, _ = read_checkpoint(run_dir / "checkpoints" / "step-000001")
        for name, value in saved.items():
            torch.testing.assert_close(value, expected_weights[name], rtol=1e-4, atol=1e-4)
        link.train(OTHER, 1)
        assert link.resume() == state
        link.save_best(link.snapshot(), {"step": 1})
        best = {n: t for file in weight_files(run_dir / "checkpoints" / BEST_DIR) for n, t in load_file(file).items()}
        assert best and all(torch.equal(best[name], saved[name]) for name in best), "not every rank resumed"
        link.close()
    finally:
        done.set()
        for rank in ranks:
            rank.join(timeout=60)
            if rank.exitcode is None:
                rank.kill()
    assert [rank.exitcode for rank in ranks] == [0, 0]
