"""The capacity planner's arithmetic: monotonic where physics says so, async never slower than sync."""

from __future__ import annotations

import math

import pytest

from rlfleet.workers import capacity
from rlfleet.workers.capacity import Cluster, Workload, best_split, llama_like, predict, with_bandwidth

WORK = Workload(sequences=512, prompt_tokens=512, gen_mean=512, gen_max=2048)
SIZES = [1, 3, 8, 13, 34, 70, 180, 405]
BANDWIDTHS = [5, 12.5, 25, 50, 100, 400]


@pytest.mark.parametrize("gpus", [64, 256])
def test_step_time_grows_with_model_size(gpus):
    steps = [best_split(llama_like(size), WORK, gpus) for size in SIZES]
    asyncs = [p.async_step_s for p in steps]
    colocated = [p.colocated_step_s for p in steps]
    assert asyncs == sorted(asyncs)
    assert colocated == sorted(colocated)
    for size_a, size_b in zip(SIZES, SIZES[1:]):
        split = predict(llama_like(size_a), WORK, gpus // 2, gpus // 2)
        bigger = predict(llama_like(size_b), WORK, gpus // 2, gpus // 2)
        assert bigger.generate_s >= split.generate_s and bigger.train_s >= split.train_s
        # At a fixed layout (the chosen TP may change with size, and a wider TP moves less per GPU).
        cluster = Cluster()
        assert (capacity.sync_seconds(llama_like(size_b), gpus // 2, 8, gpus // 2, cluster)
                > capacity.sync_seconds(llama_like(size_a), gpus // 2, 8, gpus // 2, cluster))


@pytest.mark.parametrize("size", [8, 70, 405])
def test_step_time_shrinks_with_bandwidth(size):
    model = llama_like(size)
    results = [best_split(model, WORK, 512, with_bandwidth(Cluster(), bw)) for bw in BANDWIDTHS]
    asyncs = [p.async_step_s for p in results]
    assert asyncs == sorted(asyncs, reverse=True)
    fixed = [predict(model, WORK, 256, 256, with_bandwidth(Cluster(), bw)) for bw in BANDWIDTHS]
    assert [p.sync_s for p in fixed] == sorted((p.sync_s for p in fixed), reverse=True)
    assert fixed[0].sync_s > fixed[-1].sync_s


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("generators", [8, 24, 40, 56])
def test_async_never_slower_than_sync(size, generators):
    p = predict(llama_like(size), WORK, generators, 64 - generators)
    assert p.async_step_s <= p.sync_step_s
    assert p.sync_step_s == pytest.approx(p.generate_s + p.train_s + p.sync_s)


def test_bubbles_are_fractions_and_async_has_fewer():
    p = predict(capacity.LLAMA3["70b"], WORK, 128, 128)
    for mode in ("sync", "async"):
        for bubble in p.bubbles(mode):
            assert 0.0 <= bubble < 1.0
    assert sum(p.bubbles("async")) < sum(p.bubbles("sync"))
    assert min(p.bubbles("async")) == pytest.approx(0.0, abs=p.sync_s / p.async_step_s + 1e-9)


def test_best_split_is_the_minimum_over_splits():
    model, gpus = capacity.LLAMA3["8b"], 64
    best = best_split(model, WORK, gpus)
    every = [predict(model, WORK, g, gpus - g).async_step_s for g in range(8, gpus, 8)]
    assert best.async_step_s == min(every)
    assert best.generator_gpus + best.trainer_gpus == gpus


def test_infeasible_layouts_are_infinite():
    model = capacity.LLAMA3["405b"]
    # 405B of training state (16 bytes a parameter) cannot live on 8 GPUs of 80 GB.
    assert capacity.train_seconds(model, WORK, 8, Cluster()) == math.inf
    # Nor do its bf16 weights fit one GPU.
    assert capacity.generate_seconds(model, WORK, 8, 1, Cluster()) == math.inf
    assert math.isfinite(best_split(model, WORK, 512).async_step_s)


def test_hand_computed_training_time():
    model = capacity.Model(params_b=1.0, layers=16, hidden=2048)
    work = Workload(sequences=100, prompt_tokens=500, gen_mean=500, gen_max=500)
    cluster = Cluster()
    seconds = capacity.train_seconds(model, work, 8, cluster)
    flops = 6 * 1e9 * 100 * 1000
    assert seconds == pytest.approx(flops / (8 * 989.4e12 * 0.40))


def test_llama_like_tracks_the_published_shapes():
    for key, published in capacity.LLAMA3.items():
        shaped = llama_like(published.params_b)
        assert abs(shaped.layers - published.layers) / published.layers < 0.25
        assert abs(shaped.hidden - published.hidden) / published.hidden < 0.25


def test_paper_table_lists_three_settings():
    table = capacity.markdown_paper()
    assert table.count("\n") == 4
    for setting in capacity.PAPER:
        assert f"| {setting.name} |" in table and str(setting.baseline_s) in table
