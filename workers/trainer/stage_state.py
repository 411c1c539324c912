"""The checkpoints of a pipeline-parallel trainer: the same files as without a pipeline (a full state, written by
rank 0), so that a job can resume with another number of stages.

Each stage gathers its own parameters' full state over its ranks (FSDP2's shards); the first rank of each stage
sends it to rank 0, which merges the stages'. A restore hands each rank its stage's part of a full state, and the
stage's ranks load their shards of it. A tied output layer's copy on the last stage (pipeline.py) is never saved: it
is the embedding, which it is made from again on a restore.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn, optim
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlfleet.workers.sync.plan import TrainerLayout
from rlfleet.workers.trainer.pipeline import EMBEDDING, TIED_COPY, Pipeline

State = tuple[dict[str, Any], dict[str, Any]]
"""(model weights, optimizer state), full and named by parameter, as torch's distributed state dicts are."""


def gathered_state(model: nn.Module, optimizer: optim.Optimizer | None, pipeline: Pipeline) -> State:
    """Collective: on rank 0 the whole model's weights and (with `optimizer`) optimizer state, on CPU; elsewhere
    empty."""
    options = StateDictOptions(full_state_dict=True)  # cpu_offload would keep only global rank 0's stage
    weights = get_model_state_dict(model, options=options)
    state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else {}
    part = _on_cpu(_without_copy(weights, state, pipeline)) if pipeline.index == 0 else None
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    if parts is None:
        return {}, {}
    return _merged([found for found in parts if found is not None])


def restore_state(model: nn.Module, optimizer: optim.Optimizer, pipeline: Pipeline, weights: dict[str, Any],
                  state: dict[str, Any]) -> None:
    """Collective: load the full `weights` and optimizer `state` that rank 0 read (elsewhere: ignored) into every
    stage's shards."""
    layout = TrainerLayout(dist.get_world_size(), pipeline.stages, model.config.num_hidden_layers)
    parts = None
    if dist.get_rank() == 0:
        per_stage = [stage_part(weights, state, layout, stage, pipeline.tied) for stage in range(pipeline.stages)]
        parts = [per_stage[rank // pipeline.data_parallel] for rank in range(dist.get_world_size())]
    received: list[Any] = [None]
    dist.scatter_object_list(received, parts, src=0)
    own_weights, own_state = received[0]
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, own_weights, options=options)
    set_optimizer_state_dict(model, optimizer, own_state, options=options)


def stage_part(weights: dict[str, Any], state: dict[str, Any], layout: TrainerLayout, stage: int, tied: bool) -> State:
    """The weights and optimizer state of the parameters `stage` holds; the last stage of a tied model gets the
    embedding's as its output layer's too."""
    names = {name for name in weights if layout.stage_of(name) == stage}
    if tied and stage == layout.stages - 1 and EMBEDDING in weights:
        weights = {**weights, TIED_COPY: weights[EMBEDDING]}
        names.add(TIED_COPY)
        if state:
            state = {**state, "state": {**state["state"], TIED_COPY: state["state"][EMBEDDING]},
                     "param_groups": [{**group, "params": [*group["params"], TIED_COPY]}
                                      for group in state["param_groups"]]}
    return {name: weights[name] for name in names}, _select(state, names)


def _without_copy(weights: dict[str, Any], state: dict[str, Any], pipeline: Pipeline) -> State:
    if not (pipeline.tied and pipeline.last):
        return weights, state
    names = set(weights) - {TIED_COPY}
    return {name: weights[name] for name in names}, _select(state, names)


def _select(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The optimizer state of the parameters `names` only."""
    if not state:
        return {}
    return {"state": {name: value for name, value in state["state"].items() if name in names},
            "param_groups": [{**group, "params": [name for name in group["params"] if name in names]}
                             for group in state["param_groups"]]}


def _merged(parts: list[State]) -> State:
    """The stages' states as one: every parameter's, each optimizer group listing every stage's parameters."""
    weights = {name: tensor for part_weights, _ in parts for name, tensor in part_weights.items()}
    states = [state for _, state in parts if state]
    if not states:
        return weights, {}
    groups = [{**group, "params": [name for state in states for name in state["param_groups"][index]["params"]]}
              for index, group in enumerate(states[0]["param_groups"])]
    return weights, {"state": {name: value for state in states for name, value in state["state"].items()},
                     "param_groups": groups}


def _on_cpu(value: Any) -> Any:
    """`value` with every tensor in it moved to the CPU (what crosses to rank 0 as a pickled object)."""
    if hasattr(value, "cpu"):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value
