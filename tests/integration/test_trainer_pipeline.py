"""A pipeline-parallel trainer (roles.trainer.pipelineParallel) learns what one rank learns: 2 stages x 1 rank, 2
stages x 2 ranks (FSDP2 within each stage) and 3 stages over gloo, against one rank on the same batch; weights,
Adam's state through a checkpoint and a restore, and the step's metrics alike, a tied output layer too."""

from __future__ import annotations

import pytest
import torch

from rlfleet.workers.models import materialize

from conftest import make_job
from trainer_runs import rollouts, run_trainers

pytestmark = pytest.mark.integration

JOB = {"algorithm": {"learningRate": 0.01}, "weightSync": {"backend": "gloo", "timeoutSeconds": 3}}
METRICS = ("loss", "clip_fraction", "ess", "logprob_gap", "ratio_mean", "tokens", "grad_norm")


def _runs(tmp_path_factory, model: dict, worlds: dict[str, dict], resume: bool = False, **job) -> dict:
    """The start weights, then for each name a run of the trainer `worlds[name]` describes, and one rank's."""
    model, job = {"type": "tiny", "numLayers": 4, **model}, {**JOB, **job}
    jobs = {name: make_job(model=model, roles={"trainer": trainer}, **job) for name, trainer in worlds.items()}
    jobs["single"] = make_job(model=model, **job)
    model_dir = materialize(jobs["single"].spec.model, tmp_path_factory.mktemp("model"))
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = rollouts(vocab=start.config.vocab_size)
    out = tmp_path_factory.mktemp("pipeline")
    found = {"start": start.state_dict()}
    for name, job in jobs.items():
        found[name] = run_trainers(job.spec.roles.trainer.world_size, job, model_dir, batch, str(out / name), resume,
                                   join=name == "two")
    return found


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """2 stages of one rank each, resumed from its checkpoint for a second step."""
    return _runs(tmp_path_factory, {}, {"two": {"replicas": 2, "pipelineParallel": 2}}, resume=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """The output layer tied to the embedding (SmolLM2's shape), in micro-batches so small that pipelines differ in
    their numbers (the odd samples are longer): 2 stages of 2 ranks each; and 3 stages of 2, 1 and 1 layers, the
    middle one passing hidden states on both ways and holding neither copy of the tied weight."""
    return _runs(tmp_path_factory, {"tieEmbeddings": True},
                 {"two_by_two": {"replicas": 2, "ranksPerPod": 2, "pipelineParallel": 2},
                  "three": {"replicas": 3, "pipelineParallel": 3}},
                 training={"microBatchTokens": 16})


def _assert_same_weights(got: dict, want: dict, atol: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        # Adam divides by sqrt(v): float noise in near-zero gradients moves a weight by far less than lr (0.01).
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=atol, msg=name)


def _assert_same_metrics(got: dict, want: dict) -> None:
    for name in METRICS:
        assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name


def test_two_stages_learn_what_one_rank_learns(untied):
    _assert_same_weights(untied["two"]["weights"], untied["single"]["weights"])
    _assert_same_metrics(untied["two"]["metrics"], untied["single"]["metrics"])
    start = untied["start"]
    assert any(not torch.equal(untied["single"]["weights"][name], start[name]) for name in start), "nothing learned"


def test_a_pipeline_resumes_its_weights_and_adams_state_from_its_checkpoint(untied):
    # The second step's update depends on Adam's moments: restored wrongly, it would differ by about lr.
    _assert_same_weights(untied["two"]["weights_2"], untied["single"]["weights_2"], atol=1e-3)


def test_three_stages_learn_what_one_rank_learns(tied):
    _assert_same_weights(tied["three"]["weights"], tied["single"]["weights"])
    _assert_same_metrics(tied["three"]["metrics"], tied["single"]["metrics"])


def test_two_stages_of_two_ranks_with_a_tied_output_layer_learn_what_one_rank_learns(tied):
    got, want = tied["two_by_two"], tied["single"]
    assert "lm_head.weight" not in want["weights"], "a tied model saves its embedding only"
    _assert_same_weights(got["weights"], want["weights"])
    _assert_same_metrics(got["metrics"], want["metrics"])


def test_a_generator_that_never_joins_a_pipeline_fails_the_join_not_the_trainer(untied):
    assert isinstance(untied["two"]["joined"], str) and untied["two"]["joined"]
