"""A pipeline-parallel trainer's pure parts: the layers of each stage, which ranks hold which rows (and so what each
rank pushes), the 1F1B order of a stage's passes, and micro-batches that give every stage work."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlfleet.workers.sync.plan import GeneratorLayout, RouteBuckets, TrainerLayout, layer_count, plan_routes, stage_layers
from rlfleet.workers.trainer.pipeline import BACKWARD, FORWARD, filling, one_f_one_b
from rlfleet.workers.trainer.policy import Passes
from rlfleet.workers.trainer.shared_prompts import shared_cost

from test_sync_plan import llama_shapes, random_weights, region_mask
from trainer_samples import Sample


@pytest.mark.parametrize("layers", range(1, 10))
def test_stages_hold_contiguous_runs_of_layers_each_once_as_even_as_can_be(layers):
    for stages in range(1, layers + 1):
        runs = stage_layers(layers, stages)
        assert [index for run in runs for index in run] == list(range(layers))
        sizes = [len(run) for run in runs]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes


def test_more_stages_than_layers_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="pipelineParallel"):
        stage_layers(2, 3)


def test_the_embedding_is_the_first_stages_and_the_rest_the_last_stages():
    shapes, _, _ = llama_shapes(0)
    layout = TrainerLayout(ranks=4, stages=2, layers=layer_count(shapes))
    assert layer_count(shapes) == 2
    assert layout.stage_of("model.embed_tokens.weight") == 0
    assert layout.stage_of("model.layers.0.mlp.up_proj.weight") == 0
    assert layout.stage_of("model.layers.1.mlp.up_proj.weight") == 1
    assert layout.stage_of("model.norm.weight") == layout.stage_of("lm_head.weight") == 1
    # The stage's two ranks hold torch.chunk halves; the other stage's ranks hold nothing.
    assert [layout.rows("model.layers.1.mlp.up_proj.weight", 9, rank) for rank in range(4)] == [
        (0, 0), (0, 0), (0, 5), (5, 9)]


@pytest.mark.parametrize("trainers, stages", [(2, 2), (4, 2), (3, 3), (6, 3)])
@pytest.mark.parametrize("tp", [1, 2])
def test_each_stages_ranks_push_their_own_rows_and_every_region_arrives_once(trainers, stages, tp):
    shapes, vocab, head_dim = llama_shapes(1)
    # A third layer, so that three stages hold one each.
    shapes |= {name.replace("layers.1.", "layers.2."): shape for name, shape in shapes.items() if "layers.1." in name}
    owners = TrainerLayout(trainers, stages, layer_count(shapes))
    layout = GeneratorLayout(tp, vocab, head_dim)
    weights = random_weights(shapes, 3)
    per = trainers // stages
    shards = [{name: torch.chunk(w, per)[rank % per].clone() if owners.stage_of(name) == rank // per else w[:0]
               for name, w in weights.items()} for rank in range(trainers)]
    targets = [{name: torch.zeros(shape) for name, shape in shapes.items()} for _ in range(tp)]
    for route in plan_routes(shapes, trainers, layout, stages):
        for block in route.blocks:
            assert owners.stage_of(block.name) == route.src // per, "only the stage that holds a weight sends it"
        buckets = RouteBuckets(route, torch.float32, 256)
        wire = buckets.allocate()
        buckets.pack(shards[route.src], lambda name, src=route.src: owners.rows(name, shapes[name][0], src)[0], wire)
        buckets.unpack([b.clone() for b in wire], targets[route.dst])
    for dst, name in itertools.product(range(tp), shapes):
        mask = region_mask(layout, name, shapes[name], dst)
        assert torch.equal(targets[dst][name][mask], weights[name][mask]), (dst, name)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("count", range(0, 7))
def test_one_forward_one_backward_runs_each_micro_batch_once_each_way_holding_at_most_the_stages_after(stages,
                                                                                                     count):
    for stage in range(stages):
        order = one_f_one_b(stage, stages, count)
        assert sorted(order) == sorted([(FORWARD, i) for i in range(count)] + [(BACKWARD, i) for i in range(count)])
        assert [i for kind, i in order if kind == BACKWARD] == list(range(count)), "backwards in micro-batch order"
        in_flight = 0
        for kind, index in order:
            in_flight += 1 if kind == FORWARD else -1
            assert in_flight >= 0 and (kind == FORWARD or (FORWARD, index) in order[:order.index((kind, index))])
            assert in_flight <= stages - stage, "1F1B holds the activations of at most stages - stage micro-batches"
    # The last stage has nothing to wait for: each forward's backward follows it at once.
    assert one_f_one_b(stages - 1, stages, 2) == [(FORWARD, 0), (BACKWARD, 0), (FORWARD, 1), (BACKWARD, 1)]


def test_filling_cuts_each_share_into_at_least_as_many_micro_batches_as_stages():
    share = [Sample([1, 2, 3], [4, 5, 6, 7], [0.0] * 4, 1.0) for _ in range(8)]
    cost = shared_cost(share)
    passes = filling([share, share[:2]], Passes(micro_batch_tokens=None, chunk_tokens=8), stages=4)
    assert passes.micro_batch_tokens == -(-cost // 4) and passes.chunk_tokens == 8
    # A smaller budget of the job's own stays.
    assert filling([share], Passes(micro_batch_tokens=5, chunk_tokens=8), stages=2).micro_batch_tokens == 5
