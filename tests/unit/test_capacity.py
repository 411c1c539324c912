"""The capacity planner's arithmetic: monotonic where physics says so, and its step times equal the loop played
out event by event (an independent simulation of the schedule, not the closed forms again)."""

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


def generate(start: float, seconds: float, pauses: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The busy spans of `seconds` of generation begun at `start` that stops during each (begin, end) pause."""
    spans, now, left = [], start, seconds
    for begin, end in sorted(pauses):
        if end <= now:
            continue
        if begin >= now + left:
            break
        if begin > now:
            spans.append((now, begin))
            left -= begin - now
        now = end
    return spans + [(now, now + left)]


def busy_within(spans: list[tuple[float, float]], begin: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, begin)) for a, b in spans)


def simulate(generate_s: float, train_s: float, sync_s: float, max_staleness: int, generator_stall_s: float | None = None,
             steps: int = 60) -> tuple[float, float, float]:
    """The loop of the README, event by event: (seconds per step, generator idle fraction, trainer idle fraction)
    once it has settled. Batch k starts once the generators hold version >= k - max_staleness; step k trains
    batch k after step k-1's push; each push takes sync_s, and the generators pause for generator_stall_s of it
    (all of it by default, as the planner charges)."""
    stall = sync_s if generator_stall_s is None else generator_stall_s
    generating, training, pauses = [], [], []
    for k in range(steps):
        version_ready = 0.0 if k - max_staleness <= 0 else training[k - max_staleness - 1][1] + sync_s
        generating += generate(max(generating[-1][1] if generating else 0.0, version_ready), generate_s, pauses)
        train_start = max(generating[-1][1], training[-1][1] + sync_s if training else 0.0)
        training.append((train_start, train_start + train_s))
        pauses.append((training[-1][1], training[-1][1] + stall))
    # Settled, and far from the end, where the generators would already be on batches never simulated.
    first, window = steps // 4, steps // 2
    begin, end = training[first][1], training[first + window][1]
    idle = [1 - busy_within(spans, begin, end) / (end - begin) for spans in (generating, training)]
    return (end - begin) / window, *idle


LAYOUTS = [(size, generators) for size in (1, 8, 70) for generators in (8, 24, 40)]


@pytest.mark.parametrize("size, generators", LAYOUTS)
def test_step_times_are_the_simulated_loops(size, generators):
    """The closed forms (sync = Tg + Tt + Ts, async = max(Tg, Tt) + Ts) against the schedule played out."""
    p = predict(llama_like(size), WORK, generators, 64 - generators)
    assert all(map(math.isfinite, (p.generate_s, p.train_s, p.sync_s)))
    sync = simulate(p.generate_s, p.train_s, p.sync_s, max_staleness=0)
    asynchronous = simulate(p.generate_s, p.train_s, p.sync_s, max_staleness=1)
    assert p.sync_step_s == pytest.approx(sync[0], rel=1e-9)
    assert p.async_step_s == pytest.approx(asynchronous[0], rel=1e-9)
    assert p.bubbles("sync") == pytest.approx(sync[1:], abs=1e-9)
    assert p.bubbles("async") == pytest.approx(asynchronous[1:], abs=1e-9)
    # More staleness buys nothing once generation and training overlap.
    assert simulate(p.generate_s, p.train_s, p.sync_s, max_staleness=3)[0] == pytest.approx(asynchronous[0])


@pytest.mark.parametrize("size, generators", LAYOUTS)
def test_async_step_is_a_conservative_bound(size, generators):
    """Our generators stall only for the load, not the whole push: the real loop is no slower than predicted."""
    p = predict(llama_like(size), WORK, generators, 64 - generators)
    for stall in (0.0, p.sync_s / 2):
        period = simulate(p.generate_s, p.train_s, p.sync_s, max_staleness=1, generator_stall_s=stall)[0]
        assert period <= p.async_step_s * (1 + 1e-9)


def test_simulator_by_hand():
    """The reference itself, on numbers small enough to follow: Tg 3, Tt 2, Ts 1."""
    assert simulate(3.0, 2.0, 1.0, max_staleness=0) == pytest.approx((6.0, 0.5, 2 / 3))
    assert simulate(3.0, 2.0, 1.0, max_staleness=1) == pytest.approx((4.0, 0.25, 0.5))
    assert simulate(2.0, 3.0, 1.0, max_staleness=1) == pytest.approx((4.0, 0.5, 0.25))
    assert simulate(3.0, 2.0, 1.0, max_staleness=1, generator_stall_s=0.0)[0] == pytest.approx(3.0)


# Whole-node splits of 32 GPUs are 8, 16 and 24 generator GPUs; these workloads put the best at either end.
EDGES = [
    (Workload(sequences=64, prompt_tokens=64, gen_mean=4096, gen_max=8192), 24),  # long decode: generators
    (Workload(sequences=4096, prompt_tokens=4096, gen_mean=16, gen_max=16), 8),  # long prompts: trainers
    (WORK, None),
]


@pytest.mark.parametrize("work, expected", EDGES)
def test_best_split_is_the_minimum_over_whole_node_splits(work, expected):
    model, gpus = llama_like(0.5), 32
    every = {g: predict(model, work, g, gpus - g).async_step_s for g in (8, 16, 24)}
    best = best_split(model, work, gpus)
    assert best.async_step_s == min(every.values())
    assert best.generator_gpus in every and best.generator_gpus + best.trainer_gpus == gpus
    assert expected is None or best.generator_gpus == expected
    # GPU by GPU it can only do as well or better, and it is the minimum over all 31 splits.
    fine = best_split(model, work, gpus, granularity=1)
    assert fine.async_step_s == min(predict(model, work, g, gpus - g).async_step_s for g in range(1, gpus))
    assert fine.async_step_s <= best.async_step_s


def test_hand_computed_sync_time():
    """8B in bf16 (16.06 GB): 2 generator replicas of TP 8, 8 trainer GPUs, 24 GPUs so over the NIC at
    50 GB/s x 80%. Each trainer GPU sends its eighth to both replicas; each generator GPU receives an eighth."""
    cluster = Cluster()
    send = 16.06e9 / 8 * 2 / 40e9
    load = 16.06e9 / 8 / (3350e9 * 0.8)
    assert capacity.sync_seconds(capacity.LLAMA3["8b"], 16, 8, 8, cluster) == pytest.approx(send + load)


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
